"""Studies and benchmarks built on the package: what a sweep of study runs means as tables (``study``), the analyses
of the toy chain task's completions (``chain_analysis``), the sections of docs/results.md (``results_page``), the
benchmarks' models and rows (``bench_models``), a process's memory (``process_memory``), the plain Trainer and step
timing the scripts fit with (``step_timing``) and the report files the generated pages share (``reports``). The runs
themselves come from ``lightning-gkd`` (a multirun of ``conf/experiment/study_*.yaml`` with ``conf/recipe``), whose
``result.json`` files ``study`` reads."""
