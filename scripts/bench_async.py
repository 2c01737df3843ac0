"""Asynchronous rollouts' steps per second, side by side in one run (lightning_gkd.studies.async_bench): GKD at λ=1
on the chain task's student with the producer's vLLM engine process on one core and the trainer on the other, at
max_staleness {0, 1, 2, 4}, and today's synchronous run (vLLM in the trainer's process, both cores), for three shapes:
the chain task at batch 16 and 32, and with a larger teacher (training dominates). Needs vLLM (run it in the vLLM
environment, README "vLLM") and two CPU cores. Writes docs/benchmarks_async.md and .json.

    .venv-vllm/bin/python scripts/bench_async.py                 # about 20 minutes on 2 cores
    .venv-vllm/bin/python scripts/bench_async.py --shapes "batch 16" --add   # one shape, the others' runs kept
    .venv-vllm/bin/python scripts/bench_async.py --fast --out /tmp/ba   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from lightning_gkd.studies.async_bench import SHAPES, STALENESS, BenchConfig, page, run_in_process, summarise

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=6, help="first steps not timed")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fast", action="store_true", help="one shape, staleness 0 and 1, 5 steps, 1 repeat")
    parser.add_argument("--shapes", nargs="+", default=None, help="run only these shapes (names in SHAPES)")
    parser.add_argument("--add", action="store_true", help="keep <out>/benchmarks_async.json's runs of other shapes")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--rerender", action="store_true", help="rewrite the page from <out>/benchmarks_async.json")
    args = parser.parse_args(argv)
    if args.rerender:
        saved = json.loads((args.out / "benchmarks_async.json").read_text())
        first = saved["runs"][0]
        text = page(
            summarise(saved["runs"]),
            command=saved["command"],
            machine=saved["machine"],
            minutes=saved["minutes"],
            steps=first["steps"],
            warmup=first["warmup"],
        )
        (args.out / "benchmarks_async.md").write_text(text)
        print(text)
        return 0
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"bench_async needs two CPU cores (one for the trainer, one for the engine); found {cores}.")
    steps, warmup, repeats = (5, 2, 1) if args.fast else (args.steps, args.warmup, args.repeats)
    shapes = [shape for shape in SHAPES if args.shapes is None or shape.name in args.shapes]
    if not shapes:
        raise SystemExit(f"--shapes {args.shapes}: no such shape; the shapes: {[shape.name for shape in SHAPES]}")
    shapes = shapes[:1] if args.fast else shapes
    staleness: list[int | None] = [None, 0, 1] if args.fast else [None, *STALENESS]
    started = time.perf_counter()
    results = []
    for repeat in range(repeats):
        for shape in shapes:
            for value in staleness:
                config = BenchConfig(shape, value, steps, warmup, trainer_cpus=(cores[0],), engine_cpus=(cores[1],))
                result = run_in_process(config)
                print(
                    f"repeat {repeat} {shape.name} staleness {value}: {result['steps_per_second']:.2f} steps/s",
                    flush=True,
                )
                results.append(result)
    minutes = (time.perf_counter() - started) / 60
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python scripts/bench_async.py", *(shlex.quote(arg) for arg in given)])
    if args.add and (args.out / "benchmarks_async.json").exists():
        saved = json.loads((args.out / "benchmarks_async.json").read_text())
        names = {shape.name for shape in shapes}
        results = [run for run in saved["runs"] if run["shape"]["name"] not in names] + results
        # the earlier commands that measured the shapes kept, then this one
        earlier = [part for part in saved["command"].split(" && ") if not any(name in part for name in names)]
        command = " && ".join([*earlier, command])
        minutes += float(saved["minutes"])
    summary = summarise(results)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmarks_async.json").write_text(
        json.dumps(
            {"summary": summary, "runs": results, "command": command, "machine": machine, "minutes": minutes},
            indent=2,
        )
        + "\n"
    )
    text = page(summary, command=command, machine=machine, minutes=minutes, steps=steps, warmup=warmup)
    (args.out / "benchmarks_async.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
