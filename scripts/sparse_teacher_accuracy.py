"""Supervised KD on the toy task from a top-k teacher cache, k in {1, 5, 20, V}, against the dense in-process teacher.

The teacher's top-k log-probs over the training and validation rows are cached once at k = V (the whole 259-token
vocabulary) with ``build_teacher_cache``; ``teacher=cache teacher.top_k=k`` reads the first k of each position (the
same top-k a cache built at k holds). Every run is the addition study's Supervised KD (``experiment=study_addition
recipe=supervised_kd``: λ=0, β=0, forward KL on the ground-truth answers; the sparse loss with its tail bucket,
``sparse_loss=topk``) with the same budget, learning rate and seeds, so the dense row is the comparison. Writes
docs/sparse_teacher.md and .json.

    python scripts/sparse_teacher_accuracy.py               # 3 seeds x 5 teachers (about 10 minutes on 2 cores)
    python scripts/sparse_teacher_accuracy.py --fast --out /tmp/sparse   # a smoke test
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from lightning_gkd.cli.compose import held_out_after, train_seeds
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.studies.reports import generated_by, write_report
from lightning_gkd.teachers.offline.build import build_teacher_cache
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 259  # the toy tokenizer's
FAST_ROWS = {"train": 256, "val": 32, "test": 64}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3, help="docs/results.md's choice for Supervised KD")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 5, 20, VOCAB])
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--fast", action="store_true", help="1 seed, 6 steps, few rows")
    args = parser.parse_args(argv)
    rows = {split: None for split in FAST_ROWS}
    if args.fast:
        args.steps, args.seeds, rows = 6, args.seeds[:1], dict(FAST_ROWS)
    started = time.perf_counter()
    work = args.out / ".runs" / "sparse_teacher"
    cache = work / "teacher_cache_kV"
    build_started = time.perf_counter()
    manifest = build_teacher_cache(
        asset_path("toy/teacher"),
        load_tokenizer(asset_path("toy/teacher")),
        [*addition_rows("train", rows["train"]), *addition_rows("val", rows["val"])],
        cache,
        top_k=VOCAB,
        max_length=64,
    ).manifest
    build_seconds = time.perf_counter() - build_started
    base = ["experiment=study_addition", "recipe=supervised_kd", f"optimizer.lr={args.lr}"]
    base += [f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}"]
    base += [f"data.batch_size={args.batch_size}"]
    base += [f"+data.{split}_data.num_rows={count}" for split, count in rows.items() if count is not None]
    teachers = {"dense (in-process)": []}
    teachers |= {f"cache k={k}": ["teacher=cache", f"teacher.path={cache}", f"teacher.top_k={k}"] for k in args.ks}
    results: dict[str, list[float]] = {}
    for index, (name, teacher) in enumerate(teachers.items()):
        runs = train_seeds([*base, *teacher], args.seeds, output_dir=work / f"teacher{index}")
        results[name] = [held_out_after(run) for run in runs]
        seconds = sum(run["fit_seconds"] for run in runs)
        print(f"{name}: test {[round(a, 3) for a in results[name]]}, {seconds:.0f}s", flush=True)
    report = {
        "command": "python scripts/sparse_teacher_accuracy.py" + (" --fast" if args.fast else ""),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cache": {key: manifest.get(key) for key in ("k", "num_rows", "total_tokens", "bytes_per_million_tokens")},
        "cache_build_seconds": build_seconds,
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    write_report(args.out / "sparse_teacher.md", render(report), report)
    print(render(report))
    return 0


def render(report: dict) -> str:
    dense = statistics.mean(report["results"]["dense (in-process)"])
    lines = [
        "# Supervised KD from a top-k teacher cache (toy task)",
        "",
        generated_by("scripts/sparse_teacher_accuracy.py"),
        "",
        f"- Command: `{report['command']}`; machine: {report['machine']}; total {report['seconds'] / 60:.1f} min",
        f"- Budget: {report['args']['steps']} steps of batch {report['args']['batch_size']}, lr "
        f"{report['args']['lr']}, seeds {report['args']['seeds']}: docs/results.md's Supervised KD (λ=0, β=0).",
        f"- Cache: {report['cache']['num_rows']} rows (train + val), {report['cache']['total_tokens']} supervised "
        f"tokens at k={report['cache']['k']} in {report['cache_build_seconds']:.0f} s; the runs read its first k.",
        "",
        "| teacher | test accuracy (mean ± std) | vs dense |",
        "|---|---|---|",
    ]
    for name, accuracies in report["results"].items():
        mean = statistics.mean(accuracies)
        std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        lines.append(f"| {name} | {mean:.3f} ± {std:.3f} (n={len(accuracies)}) | {100 * (mean - dense):+.1f} pt |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
