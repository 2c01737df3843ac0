"""Where the teacher lives, side by side: GKD steps with the teacher in process (``local``), read from an offline
top-k cache (``cache``) and served by vLLM (``server``), on the bench models of scripts/bench.py (student 4 x 256,
teacher 6 x 512, vocabulary 32000, batch 8, 64-token answers / 64 sampled tokens, float32 on CPU).

Measured in one run: the student process's peak resident memory and seconds per optimizer step for each kind, at
lmbda 0 (dataset completions; the only case a cache serves) and lmbda 1 (on-policy; local and server), every
measurement in a fresh process, kinds alternating per repetition; the cache build's throughput and size (k = 20);
the server's scoring throughput (rows of ~100 tokens, k = 20, one request per row, 4 in flight). The server runs on
this same 2-core machine, so its forward competes with the trainer for the cores: on a separate machine (the point
of a server) that time leaves the student's process. Needs vLLM for the server rows (run it in the vLLM environment,
README "vLLM"); without vLLM they are left out. Writes docs/benchmarks_teachers.md and .json.

    /work/venv-vllm/bin/python scripts/bench_teachers.py            # or: python scripts/bench_teachers.py
    python scripts/bench_teachers.py --reps 1 --steps 2 --out /tmp/bt.md   # a quick look
    python scripts/bench_teachers.py --tiny --reps 1 --steps 2 --warmup 1 --out /tmp/bt.md   # checks the script
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the bench models, rows and peak-memory reading)

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("local", "cache", "server")
TOP_K = 20


def teacher_spec(kind: str, work: Path, url: str | None) -> object:
    if kind == "local":
        return {"kind": "local", "model": str(work / "teacher")}
    if kind == "cache":
        return {"kind": "cache", "path": str(work / "cache")}
    return {"kind": "server", "url": url, "top_k": TOP_K, "retries": 2, "backoff": 0.5}


def rows(count: int) -> list[dict]:
    return bench.bench_rows(count, answer_tokens=bench.NEW_TOKENS)


def worker(kind: str, lmbda: float, warmup: int, steps: int, work: Path, url: str | None) -> dict:
    import itertools
    from functools import partial

    import lightning as L
    import torch

    from lightning_gkd import ChatDataModule, GKDModule
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.training.optimizers import adamw

    torch.manual_seed(0)
    tokenizer = build_chatml_tokenizer()
    student = bench.build_model(bench.STUDENT, 0, tokenizer)  # the student only: the teacher is the kind's business
    data_rows = rows(bench.BATCH * (warmup + steps))  # the rows the cache was built over
    baseline = current_rss_mb()
    reset_peak_rss()  # from here: the teacher's load (local), the engines, the fit
    ends: list[float] = []

    class StepEnds(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())

    module = GKDModule(
        student,
        teacher_spec(kind, work, url),
        tokenizer,
        lmbda=lmbda,
        beta=0.0 if lmbda == 0 else 0.5,
        temperature=0.9,
        max_new_tokens=bench.NEW_TOKENS,
        optimizer=partial(adamw, lr=1e-5),
        seed=0,
        metrics={},
        frozen_dtype="float32",  # the same arithmetic in every kind: the cache and the server hold float32 log-probs
    )
    data = ChatDataModule(tokenizer, data_rows, batch_size=bench.BATCH, max_length=bench.MAX_LENGTH, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        callbacks=[StepEnds()],
    )
    trainer.fit(module, datamodule=data)
    timed = [b - a for a, b in itertools.pairwise(ends[warmup - 1 :])]
    return {"seconds_per_step": sum(timed) / len(timed), "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def current_rss_mb() -> float:
    return _status_mb("VmRSS")


def reset_peak_rss() -> None:
    """Linux: restart the peak-RSS count (VmHWM) at the current RSS, so imports and the student's build (the same
    in every kind) do not hide the peak of what differs."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float:
    return _status_mb("VmHWM")


def prepare(work: Path, cache_rows: int) -> dict:
    """The teacher folder (tokenizer inside) and its top-k cache over the rows every worker reads."""
    import torch

    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.teachers.cache_build import build_teacher_cache_report

    tokenizer = build_chatml_tokenizer()
    _, teacher = bench.build_models(tokenizer)
    teacher.save_pretrained(work / "teacher")
    tokenizer.save_pretrained(work / "teacher")
    del teacher
    torch.set_num_threads(os.cpu_count() or 1)
    report = build_teacher_cache_report(
        str(work / "teacher"),
        tokenizer,
        rows(cache_rows),
        work / "cache",
        top_k=TOP_K,
        max_length=bench.MAX_LENGTH,
        batch_size=bench.BATCH,
        trainer={"accelerator": "cpu", "logger": False, "enable_progress_bar": False},
    )
    manifest = report.manifest
    # the build's throughput on more rows than the workers read (its fixed costs, Lightning's start, amortised)
    big = build_teacher_cache_report(
        str(work / "teacher"),
        tokenizer,
        rows(512),
        work / "cache_512",
        top_k=TOP_K,
        max_length=bench.MAX_LENGTH,
        batch_size=bench.BATCH,
        trainer={"accelerator": "cpu", "logger": False, "enable_progress_bar": False},
    )
    return {
        "cache_tokens": manifest["total_tokens"],
        "cache_bytes": manifest["total_bytes"],
        "cache_mb_per_million_tokens": manifest["bytes_per_million_tokens"] / 1e6,
        "cache_build_tokens": big.manifest["total_tokens"],
        "cache_build_tokens_per_s": big.tokens_per_second,
    }


def start_server(work: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(work / "teacher"),
        "--dtype",
        "float32",
        "--max-logprobs",
        str(TOP_K),
        "--kv-cache-memory-bytes",  # explicit on CPU: the utilization fraction counts the server's own RSS
        str(256 << 20),
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = open(work / "server.log", "wb")  # noqa: SIM115  (kept open while the server runs)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
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
    raise RuntimeError(f"the vLLM server did not start:\n{(work / 'server.log').read_text()[-3000:]}")


def server_throughput(url: str) -> dict:
    from lightning_gkd.data.chat import ChatMLCollator
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.teachers import ServerTeacher, supervised_positions

    tokenizer = build_chatml_tokenizer()
    batch = ChatMLCollator(tokenizer, bench.MAX_LENGTH)(rows(64))
    teacher = ServerTeacher(url, top_k=TOP_K, concurrency=4)
    positions = supervised_positions(batch["labels"])
    teacher.topk(batch, positions)  # warm
    started = time.perf_counter()
    teacher.topk(batch, positions)
    seconds = time.perf_counter() - started
    teacher.close()
    tokens = int(batch["attention_mask"].sum())
    return {"server_rows": 64, "server_tokens": tokens, "server_tokens_per_s": tokens / seconds}


def run_worker(kind: str, lmbda: float, warmup: int, steps: int, work: Path, url: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, __file__, "--worker", kind, str(lmbda), str(warmup), str(steps), str(work), url or ""]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} lmbda={lmbda} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "# Where the teacher lives: local vs cache vs server",
        "",
        "Generated by `scripts/bench_teachers.py` (do not edit by hand; rerun the script).",
        "",
        f"- Command: `{meta['command']}`; {meta['reps']} repetitions of {meta['steps']} timed steps after "
        f"{meta['warmup']} warm-up steps; total {meta['seconds'] / 60:.1f} min; 2 CPU cores, float32.",
        "- Models: scripts/bench.py's (student 4 x 256, teacher 6 x 512, vocabulary 32000), batch 8, 64-token "
        "answers (lmbda 0) or 64 sampled tokens (lmbda 1). cache and server: top-20 with the tail bucket "
        "(`sparse_loss=topk`); local: the full distributions.",
        "- The server runs on the same 2 cores as the trainer: its forward time is in the server rows' step time. "
        "On another machine it would not be; the student process's memory is the point of comparison there.",
        "",
        "| teacher | lmbda | s / optimizer step (median) | student process: RSS before the module (MB) | peak RSS "
        "from the module's construction through the fit (MB) | peak over before (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for key, runs in results["runs"].items():
        kind, lmbda = key.split("@")
        seconds = statistics.median(r["seconds_per_step"] for r in runs)
        peak = statistics.median(r["peak_rss_mb"] for r in runs)
        before = statistics.median(r["baseline_rss_mb"] for r in runs)
        lines.append(f"| {kind} | {lmbda} | {seconds:.3f} | {before:.0f} | {peak:.0f} | {peak - before:+.0f} |")
    for key, error in results.get("failures", {}).items():
        lines.append(f"| {key.replace('@', ' | ')} | failed: {error.splitlines()[-1][:120]} | | | |")
    info = results["info"]
    lines += [
        "",
        f"- Cache (k={TOP_K}): the workers' {info['cache_tokens']} supervised tokens take "
        f"{info['cache_bytes'] / 1e6:.2f} MB, {info['cache_mb_per_million_tokens']:.1f} MB per million tokens; a "
        f"build over 512 rows ({info['cache_build_tokens']} tokens, one process) ran at "
        f"{info['cache_build_tokens_per_s']:.0f} tokens/s.",
    ]
    if "server_tokens_per_s" in info:
        lines.append(
            f"- Server scoring ({info['server_rows']} rows, {info['server_tokens']} tokens, k={TOP_K}, 4 requests in "
            f"flight): {info['server_tokens_per_s']:.0f} tokens/s."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks_teachers.md")
    parser.add_argument("--tiny", action="store_true", help="toy model sizes (checks the script, not speed)")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        bench.use_tiny_sizes()  # and BENCH_TINY for the workers, which import bench
    if args.worker:
        kind, lmbda, warmup, steps, work, url = args.worker
        print(json.dumps(worker(kind, float(lmbda), int(warmup), int(steps), Path(work), url or None)))
        return
    started = time.perf_counter()
    have_vllm = importlib.util.find_spec("vllm") is not None
    kinds = [k for k in KINDS if have_vllm or k != "server"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        info = prepare(work, bench.BATCH * (args.warmup + args.steps))
        process, url = start_server(work) if "server" in kinds else (None, None)
        try:
            if url:
                info.update(server_throughput(url))
            runs: dict[str, list[dict]] = {}
            failures: dict[str, str] = {}
            for rep in range(args.reps):
                for lmbda in (0.0, 1.0):
                    for kind in kinds if rep % 2 == 0 else list(reversed(kinds)):
                        if kind == "cache" and lmbda == 1.0:
                            continue  # a cache holds the dataset completions only
                        key = f"{kind}@{lmbda:g}"
                        try:
                            runs.setdefault(key, []).append(run_worker(kind, lmbda, args.warmup, args.steps, work, url))
                        except RuntimeError as error:
                            failures[key] = str(error)
                        print(key, runs.get(key, [])[-1:] or failures.get(key, "")[-300:], flush=True)
        finally:
            if process is not None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
    results = {
        "meta": {
            "command": " ".join(["python scripts/bench_teachers.py", *sys.argv[1:]]),
            "reps": args.reps,
            "steps": args.steps,
            "warmup": args.warmup,
            "seconds": time.perf_counter() - started,
        },
        "info": info,
        "runs": {k: v for k, v in runs.items() if v},
        "failures": failures,
    }
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
