"""The offline teacher: its signal precomputed over the training rows, read back so distillation runs no teacher.
``format`` (what a cache is: its records, signals and constants), ``shards`` (its Arrow shard files), ``head`` (a
hidden-state cache's head), ``fingerprints`` (the rows', the data's and the teacher's identities), ``manifest``
(``manifest.json`` and the commands that build or resume a cache), ``reader`` (``CacheTeacher``,
``HiddenCacheTeacher``), ``sharded_writer`` (the one resumable predict loop that writes row-sharded files whole),
``build`` (``build_teacher_cache``) and ``completions`` (``build_teacher_completions``: offline SeqKD) on it;
``atomic`` (a file written whole or not at all)."""
