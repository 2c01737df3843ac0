"""On-policy reverse KL (GKD λ=1, β=1) on the chain task with the teacher served as final hidden states, against the
same run with the teacher in process (dense) and with its top-20 (what a top-k server or cache gives).

The hidden-state arm trains against a real vLLM pooling server of the chain teacher (`--runner pooling`, per-token
states, bf16 on the wire: `teacher=server_hidden`'s default), the head read from the teacher's safetensors; the top-20
arm reads the in-process teacher's top-20 with the tail bucket (`teacher.top_k=20`, `sparse_loss=topk`: the signal a
server with `prompt_logprobs=20` sends, tests/teachers/test_server.py). Every run is the chain study's "GKD β=1"
(`experiment=study_chain recipe=gkd_beta1`) with its budget, learning rate and seeds. Needs vLLM (the vLLM
environment, README "vLLM"). Writes docs/hidden_teacher.md and .json.

    .venv-vllm/bin/python scripts/hidden_teacher_accuracy.py             # 3 seeds x 3 teachers (~20 min on 2 cores)
    .venv-vllm/bin/python scripts/hidden_teacher_accuracy.py --fast --out /tmp/hidden   # a smoke test
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from lightning_gkd.cli.compose import held_out_after, train_seeds
from lightning_gkd.studies.reports import generated_by, write_report
from lightning_gkd.teachers.hidden_server import POOLER_CONFIG
from lightning_gkd.toy.tiny import asset_path

REPO = Path(__file__).resolve().parents[1]
TEACHER = asset_path("toy_chain/teacher")
FAST_ROWS = ["+data.train_data.num_rows=256", "+data.val_data.num_rows=32", "+data.test_data.num_rows=64"]


def start_pooling_server(log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", TEACHER),
        *("--runner", "pooling", "--convert", "embed", "--pooler-config", POOLER_CONFIG),
        *("--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager"),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return process, url
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(1)
    process.kill()
    raise RuntimeError(f"the vLLM pooling server did not start:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3, help="docs/results.md's choice for chain GKD β=1")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--fast", action="store_true", help="1 seed, 6 steps, few rows")
    args = parser.parse_args(argv)
    if args.fast:
        args.steps, args.seeds = 6, args.seeds[:1]
    torch.set_num_threads(1)  # the server gets the other core
    started = time.perf_counter()
    work = args.out / ".runs_hidden"
    work.mkdir(parents=True, exist_ok=True)
    process, url = start_pooling_server(work / "server.log")
    base = ["experiment=study_chain", "recipe=gkd_beta1", f"optimizer.lr={args.lr}"]
    base += [
        f"data.batch_size={args.batch_size}",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.steps}",
        "~callbacks.study_record",
    ]
    base += FAST_ROWS if args.fast else []
    teachers = {
        "in process (dense)": [],
        "server, hidden states (bf16)": [
            "teacher=server_hidden",
            f"teacher.url={url}",
            f"teacher.head={TEACHER}",
            "teacher.dtype=bfloat16",
            "teacher.concurrency=4",
        ],
        "top-20 + tail": ["teacher.top_k=20"],
    }
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for index, (name, teacher) in enumerate(teachers.items()):
            runs = train_seeds([*base, *teacher], args.seeds, output_dir=work / f"teacher{index}")
            seconds = [run["fit_seconds"] for run in runs]
            results[name] = {"test": [held_out_after(run) for run in runs], "seconds": seconds}
            print(f"{name}: test {[round(a, 3) for a in results[name]['test']]}", flush=True)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    report = {
        "command": "python scripts/hidden_teacher_accuracy.py" + (" --fast" if args.fast else ""),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s) + the server, torch "
        f"{torch.__version__}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    write_report(args.out / "hidden_teacher.md", render(report), report)
    print(render(report))
    return 0


def render(report: dict) -> str:
    results = report["results"]
    dense = results["in process (dense)"]["test"]
    lines = [
        "# On-policy reverse KL from a served teacher's hidden states (chain task)",
        "",
        generated_by("scripts/hidden_teacher_accuracy.py"),
        "",
        f"- Command: `{report['command']}`; machine: {report['machine']}; total {report['seconds'] / 60:.1f} min.",
        f"- Every run: docs/results.md's chain \"GKD β=1\" (λ=1, β=1: reverse KL on the student's own samples), "
        f"{report['args']['steps']} steps of batch {report['args']['batch_size']}, lr {report['args']['lr']}, "
        f"seeds {report['args']['seeds']}; test accuracy greedy on the chain test split.",
        "- Teachers: the chain teacher in process (full distributions); served by a vLLM pooling server as final "
        "hidden states in bf16, its head read from its safetensors (`teacher=server_hidden`); its top-20 log-probs "
        "with a tail bucket (what a top-k server or cache gives; `sparse_loss=topk`).",
        "",
        "| teacher | test accuracy (mean ± std) | per seed | vs in process | s / run |",
        "|---|---|---|---|---|",
    ]
    for name, result in results.items():
        accuracies = result["test"]
        mean = statistics.mean(accuracies)
        std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        seeds = ", ".join(f"{a:.3f}" for a in accuracies)
        delta = 100 * (mean - statistics.mean(dense))
        seconds = statistics.mean(result["seconds"])
        lines.append(
            f"| {name} | {mean:.3f} ± {std:.3f} (n={len(accuracies)}) | {seeds} | {delta:+.1f} pt | {seconds:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
