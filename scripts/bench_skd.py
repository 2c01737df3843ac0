"""What speculative KD's sampling costs, side by side in one run: the chain task's student (2 x 64) sampling 32 prompts
of up to 40 tokens with our KV-cache sampler (``sampler=hf``) and with ``sampler=skd`` (the 4 x 128 teacher
verifying), at K in {5, 25} and draft lengths {1, 2, 4}, for two students: the shipped start (``student_init``, which
the teacher corrects often) and the teacher itself as the student (a student that agrees with its teacher: the
verification's floor). The configurations alternate within every repetition; the median of ``--repeats`` calls is
reported with each one's replacement rate, tokens kept per verification, and both models' forward positions per
sampled token. Writes docs/benchmarks_skd.json and a table on stdout (docs/sampling.md quotes it).

    python scripts/bench_skd.py                   # about 2 minutes on 2 cores
    python scripts/bench_skd.py --fast --out /tmp/skd   # a smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.samplers import KVCacheSampler, SpeculativeKDSampler
from lightning_gkd.toy.tasks import toy_task
from lightning_gkd.toy.tiny import asset_path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--fast", action="store_true", help="2 repeats, 4 rows, 8 tokens")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args(argv)
    task = toy_task("chain")
    max_new_tokens = 8 if args.fast else task.max_new_tokens
    repeats, rows = (2, 4) if args.fast else (args.repeats, args.rows)
    tokenizer = load_tokenizer(asset_path(f"{task.assets}/teacher"))
    teacher = load_causal_lm(asset_path(f"{task.assets}/teacher")).eval()
    students = {
        "student_init": load_causal_lm(asset_path(f"{task.assets}/student_init")).eval(),
        "teacher": copy.deepcopy(teacher),  # a student that agrees with its teacher (another object: not seq_kd)
    }
    batch = ChatMLCollator(tokenizer, max_length=task.max_length)(task.rows("val")[:rows])
    prompts, mask = batch["prompts"], batch["prompt_attention_mask"]
    options = dict(max_new_tokens=max_new_tokens, temperature=1.0)
    samplers = {"hf": KVCacheSampler(tokenizer, **options)}
    for k in (5, 25):
        for draft in (1, 2, 4):
            skd = partial(SpeculativeKDSampler, accept_top_k=k, draft_tokens=draft)(tokenizer, **options)
            skd.teacher = teacher
            samplers[f"skd K={k} n={draft}"] = skd
    results = []
    for student_name, student in students.items():
        times: dict[str, list[float]] = {name: [] for name in samplers}
        stats: dict[str, list[dict[str, float]]] = {name: [] for name in samplers}
        tokens: dict[str, list[int]] = {name: [] for name in samplers}
        for repeat in range(repeats + 1):  # the first round warms up
            for name, sampler in samplers.items():
                started = time.perf_counter()
                out = sampler.sample(student, prompts, mask, seed=repeat)
                elapsed = time.perf_counter() - started
                if repeat:
                    times[name].append(elapsed)
                    stats[name].append(sampler.last_stats())
                    tokens[name].append(int((out["labels"] != -100).sum()))
        base = statistics.median(times["hf"]) / statistics.fmean(tokens["hf"])
        for name in samplers:
            per_token = statistics.median(times[name]) / statistics.fmean(tokens[name])
            mean = (
                {key: statistics.fmean(s[key] for s in stats[name]) for key in stats[name][0]} if stats[name][0] else {}
            )
            results.append(
                {
                    "student": student_name,
                    "sampler": name,
                    "ms_per_token": per_token * 1e3,
                    "vs_hf": per_token / base,
                    "sampled_tokens": statistics.fmean(tokens[name]),
                    **mean,
                }
            )
    print("| student | sampler | ms / sampled token | × hf | replaced | kept / verification | teacher pos. / token |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['student']} | {row['sampler']} | {row['ms_per_token']:.2f} | {row['vs_hf']:.2f} | "
            f"{row.get('replacement_rate', 0.0):.1%} | {row.get('tokens_per_block', float('nan')):.2f} | "
            f"{row.get('teacher_tokens_per_token', 0.0):.2f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmarks_skd.json").write_text(
        json.dumps(
            {
                "results": results,
                "rows": rows,
                "max_new_tokens": max_new_tokens,
                "repeats": repeats,
                "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
                "command": "python scripts/bench_skd.py " + " ".join(sys.argv[1:] if argv is None else argv),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
