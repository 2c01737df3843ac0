"""The accuracy of asynchronous rollouts on the chain task (docs/results.md, "Asynchronous rollouts"): forward KL
(GKD β=0), the default mix (λ=0.5, β=0.5), reverse KL (GKD β=1) and OPD, each at its chosen rate of the chain study
(docs/results_chain.json), at max_staleness 0, 1, 2 and 4, seeds 0, 1, 2: 48 runs of conf/experiment/study_async.yaml,
the same optimizer steps each (lightning_gkd.studies.async_study).

    python scripts/async_accuracy.py                      # the runs (2 at a time), docs/results_async.json, the section
    python scripts/async_accuracy.py --workers 1          # one run at a time
    python scripts/async_accuracy.py --rerender           # the section from docs/results_async.json
    python scripts/async_accuracy.py --fast --out /tmp/async   # 2 recipes, staleness 0 and 1, 1 seed, 6 steps: a smoke

An interrupted study resumes: a run whose folder (under --work) holds its finished result is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from lightning_gkd.cli.sweep import collect_jobs
from lightning_gkd.studies.async_study import (
    RECIPES,
    SEEDS,
    STALENESS,
    async_section,
    chain_learning_rates,
    grid,
    run_grid,
    summarize,
    write_async_section,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = "results_async.json"
FAST = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "+data.train_data.num_rows=256",
    "+data.val_data.num_rows=32",
    "+data.test_data.num_rows=64",
]
FAST_RECIPES = ("gkd_beta0", "opd")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="where results.md and results_async.json go")
    parser.add_argument("--work", type=Path, default=None, help="the runs' folder (default: <out>/.sweeps/async)")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time, one core and one torch thread each")
    parser.add_argument(
        "--chain", type=Path, default=REPO / "docs" / "results_chain.json", help="the chain study: each recipe's rate"
    )
    parser.add_argument("--rerender", action="store_true", help="rewrite the section from <out>/results_async.json")
    parser.add_argument("--fast", action="store_true", help="2 recipes, staleness 0 and 1, 1 seed, 6 steps: a smoke")
    args = parser.parse_args(argv)
    path = args.out / RESULTS
    if args.rerender:
        write_async_section(args.out / "results.md", async_section(json.loads(path.read_text())))
        return 0
    lrs = chain_learning_rates(json.loads(args.chain.read_text()), FAST_RECIPES if args.fast else RECIPES)
    runs = grid(
        lrs,
        staleness=STALENESS[:2] if args.fast else STALENESS,
        seeds=SEEDS[:1] if args.fast else SEEDS,
        extra=FAST if args.fast else (),
    )
    work = args.work or args.out / ".sweeps" / "async"
    started = time.perf_counter()
    run_grid(runs, work, workers=args.workers)
    minutes = (time.perf_counter() - started) / 60
    command = " ".join(["python scripts/async_accuracy.py", *(argv if argv is not None else sys.argv[1:])])
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, {args.workers} worker processes of 1 torch thread, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )
    jobs = [job for run in runs for job in collect_jobs(work / run.name, final=True)]
    summary = summarize(jobs, commands=[command], machine=machine, minutes=minutes)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    write_async_section(args.out / "results.md", async_section(summary))
    print("\n".join(async_section(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
