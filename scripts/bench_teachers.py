"""Where the teacher lives, side by side: GKD steps with the teacher in process (``local``), read from an offline
cache of its top-20 log-probs (``cache``) or of its final hidden states (``cache_hidden``), and served by vLLM as
top-20 log-probs (``server``: a generative server's ``prompt_logprobs``) or as final hidden states (``server_hidden``:
a pooling server; the student process holds the teacher's head and computes the full distributions), on the bench
models (``lightning_gkd.studies.bench_models``: student 4 x 256, teacher 6 x 512, batch 8, 64-token answers / 64
sampled tokens, float32 on CPU), at two vocabulary sizes: the bench's 32000 and Qwen2.5's padded 151936 (``--vocabs``;
a real-shape head). Each worker's method is built from conf/method/gkd.yaml (``lightning_gkd.cli.compose``).

The bench tokenizer (build_chatml_tokenizer) has 259 tokens; both vocabularies pad it, as Qwen2.5's embeddings (151936
rows) pad its 151665-token tokenizer: the rows are text, so their ids stay within the tokenizer, and the models'
embeddings and heads have the vocabulary's rows. On-policy samples of the random-init student range over the whole
vocabulary (ids every model and server accepts: below the embeddings' rows).

Measured in one run, per vocabulary:

1. the student process's peak resident memory and seconds per optimizer step for each kind, at lmbda 0 (dataset
   completions, beta 0; all five kinds) and lmbda 1 (on-policy, beta 0.5; local, server, server_hidden: a cache
   cannot score new samples), every measurement in a fresh process, kinds alternating per repetition; beside the
   peak of a hidden-state teacher, its head's size (V x H float32: it lives in the student process);
2. the teacher signal's bytes per token: the servers' answers measured on the wire
   (``JsonClient.received_bytes`` over 64 scored rows, per supervised position for top-k, per token sent
   (``HiddenServerTeacher.payload_tokens``) for hidden states), the caches' from their manifests
   (``bytes_per_million_tokens``), and the full float32 logits (4V) for scale;
3. the loss each kind gives on one collated batch against the in-process dense loss
   (``DenseDistillation(LocalTeacher)``), beta 0 and 1: ``DenseDistillation`` over the hidden-state server (float32
   and bfloat16 on the wire) and the hidden-state cache (float16), ``TopKDistillation`` over the top-20 server;
4. the caches' build throughput (bench vocabulary only) and the servers' scoring throughput (64 rows of ~100 tokens,
   one request per row, 4 in flight).

Both servers run on this same 2-core machine (idle while a worker of another kind runs), so a server's forward
competes with the trainer for the cores: on a separate machine (the point of a server) that time leaves the student's
process. The server rows need vLLM (run the script in the vLLM environment, README "vLLM"); without it they are left
out. Writes docs/benchmarks_teachers.md and .json.

    /work/venv-vllm/bin/python scripts/bench_teachers.py            # or: python scripts/bench_teachers.py
    python scripts/bench_teachers.py --vocabs 32000 --reps 1 --steps 2 --out /tmp/bt.md   # a quick look
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
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_gkd.studies.bench_models import SMALL, BenchShape, bench_rows, build_model
from lightning_gkd.studies.process_memory import current_rss_mb, peak_since_reset_mb, reset_peak_rss
from lightning_gkd.studies.reports import write_report

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("local", "cache", "cache_hidden", "server", "server_hidden")
ON_POLICY_KINDS = ("local", "server", "server_hidden")  # a cache holds the dataset completions only
SERVED = {"server": "topk", "server_hidden": "hidden"}  # the kinds a vLLM server answers, and its signal
LABELS = {
    "local": "local (in process, dense)",
    "cache": "cache top-20",
    "cache_hidden": "cache hidden (float16)",
    "server": "server top-20",
    "server_hidden": "server hidden (bfloat16)",
}
TOP_K = 20
WIRE_DTYPE = "bfloat16"  # the hidden-state server's wire dtype in the training runs (its default)
LARGE_VOCAB = 151936  # Qwen2.5's padded vocabulary
TINY_LARGE_VOCAB = 1024  # --tiny's second pass
SCORED_ROWS = 64  # rows of the servers' throughput and wire measurement
BUILD_ROWS = 256  # rows of the caches' build-throughput measurement (bench vocabulary only; --tiny: 32)


def teachers_shape(tiny: bool, vocab: int | None = None) -> BenchShape:
    """The bench's small pair at ``vocab`` (default its own); ``tiny``: its toy sizes, the teacher with 2 heads of 32
    (vLLM's CPU attention needs a head size >= 32)."""
    shape = SMALL
    if tiny:
        shape = SMALL.tiny()
        shape = replace(shape, teacher={**shape.teacher, "num_attention_heads": 2, "num_key_value_heads": 1})
    return shape if vocab is None else shape.with_vocab(vocab)


def teacher_overrides(kind: str, work: Path, urls: Mapping[str, str]) -> list[str]:
    """The ``lightning-gkd`` overrides of each kind's teacher."""
    if kind == "local":
        return [f"model.teacher.name_or_path={work / 'teacher'}"]
    if kind in ("cache", "cache_hidden"):
        return ["teacher=cache", f"teacher.path={work / kind}"]  # the manifest says which signal it holds
    retries = ["teacher.retries=2", "teacher.backoff=0.5"]
    if kind == "server":
        return ["teacher=server", f"teacher.url={urls[kind]}", f"teacher.top_k={TOP_K}", *retries]
    head = [f"teacher.head={work / 'teacher'}", f"teacher.dtype={WIRE_DTYPE}"]
    return ["teacher=server_hidden", f"teacher.url={urls[kind]}", *head, *retries]


def rows(shape: BenchShape, count: int) -> list[dict[str, Any]]:
    return bench_rows(count, answer_tokens=shape.new_tokens)


def teacher_mb(source: Any) -> float:
    """What of the teacher lives in the student process, MB: an in-process model's weights (tied tensors once), a
    hidden-state teacher's head (weight and bias, V x H), nothing for a top-k cache or server."""
    import torch

    from lightning_gkd.teachers import HiddenStateTeacher, LocalTeacher

    tensors: list[torch.Tensor]
    if isinstance(source, LocalTeacher):
        tensors = list({p.data_ptr(): p for p in source.model.parameters()}.values())
    elif isinstance(source, HiddenStateTeacher):
        tensors = [source.head.weight] + ([] if source.head.bias is None else [source.head.bias])
    else:
        return 0.0
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def worker(
    kind: str, lmbda: float, warmup: int, steps: int, work: Path, urls: Mapping[str, str], shape: BenchShape
) -> dict[str, Any]:
    import itertools
    from functools import partial

    import lightning as L
    import torch

    from lightning_gkd import ChatDataModule
    from lightning_gkd.cli.compose import build_method
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.studies.step_timing import plain_trainer
    from lightning_gkd.training.optimizers import adamw

    torch.manual_seed(0)
    tokenizer = build_chatml_tokenizer()
    # the student only: the teacher is the kind's business
    student = build_model(shape.student, shape.vocab, tokenizer, seed=0)
    data_rows = rows(shape, shape.batch * (warmup + steps))  # the rows the caches were built over
    baseline = current_rss_mb()
    reset_peak_rss()  # from here: the teacher's load (local) or its head's (hidden), the engines, the fit
    ends: list[float] = []
    setup_peak: list[float] = []

    class StepEnds(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            setup_peak.append(peak_since_reset_mb())  # built, servers probed (memory-mapped weights count when touched)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            ends.append(time.perf_counter())

    settings = [
        f"method.lmbda={lmbda}",
        f"method.divergence.beta={0.0 if lmbda == 0 else 0.5}",
        "method.sampling.temperature=0.9",
    ]
    settings += [f"method.sampling.max_new_tokens={shape.new_tokens}", "seed=0", "method.validation.metrics={}"]
    # the same arithmetic in every kind: the caches and servers hold float32-made signals
    settings.append("method.training.frozen_dtype=float32")
    module = build_method(
        ["method=gkd", *settings, *teacher_overrides(kind, work, urls)],
        student=student,
        tokenizer=tokenizer,
        optimizer=partial(adamw, lr=1e-5),
    )
    data = ChatDataModule(tokenizer, data_rows, batch_size=shape.batch, max_length=shape.max_length, shuffle=False)
    trainer = plain_trainer(warmup + steps, callbacks=[StepEnds()])
    trainer.fit(module, datamodule=data)
    timed = [b - a for a, b in itertools.pairwise(ends[warmup - 1 :])]
    return {
        "seconds_per_step": statistics.median(timed),  # a step slowed by other work on the machine weighs less
        "step_seconds": timed,
        "load_average": os.getloadavg()[0],  # the machine's, over the last minute: other work slows every figure
        "peak_rss_mb": peak_since_reset_mb(),
        "baseline_rss_mb": baseline,
        "setup_peak_rss_mb": setup_peak[0],
        "teacher_mb": teacher_mb(module.teacher_source),
    }


def build_cache(work: Path, name: str, signal_kind: str, count: int, shape: BenchShape) -> Any:
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.teachers.offline.build import build_teacher_cache

    return build_teacher_cache(
        str(work / "teacher"),
        build_chatml_tokenizer(),
        rows(shape, count),
        work / name,
        top_k=TOP_K,
        signal=signal_kind,
        max_length=shape.max_length,
        batch_size=shape.batch,
        trainer={"accelerator": "cpu", "logger": False, "enable_progress_bar": False},
    )


def prepare(work: Path, cache_rows: int, build_rows: int, shape: BenchShape) -> dict[str, Any]:
    """The teacher folder (tokenizer inside), its top-k and hidden-state caches over the rows every worker reads,
    and (``build_rows`` > 0) each build's throughput over ``build_rows`` rows."""
    import torch

    from lightning_gkd.data.tokenizer import build_chatml_tokenizer

    tokenizer = build_chatml_tokenizer()
    teacher = build_model(shape.teacher, shape.vocab, tokenizer, seed=1)
    teacher.save_pretrained(work / "teacher")
    tokenizer.save_pretrained(work / "teacher")
    head = teacher.get_output_embeddings().weight
    info: dict[str, Any] = {
        "teacher": {
            "hidden_size": int(head.shape[1]),
            "weights_mb": sum(p.numel() * p.element_size() for p in teacher.parameters()) / 2**20,  # tied: once
            "head_mb": head.numel() * head.element_size() / 2**20,
        }
    }
    del teacher, head
    torch.set_num_threads(os.cpu_count() or 1)
    for name, signal_kind in (("cache", "topk"), ("cache_hidden", "hidden")):
        manifest = build_cache(work, name, signal_kind, cache_rows, shape).manifest
        info[name] = {
            "tokens": manifest["total_tokens"],
            "bytes": manifest["total_bytes"],
            "bytes_per_token": manifest["bytes_per_million_tokens"] / 1e6,
        }
        if build_rows:  # more rows than the workers read: the build's fixed costs (Lightning's start) amortised
            big = build_cache(work, f"{name}_big", signal_kind, build_rows, shape)
            info[name] |= {
                "build_rows": build_rows,
                "build_tokens": big.manifest["total_tokens"],
                "build_tokens_per_s": big.tokens_per_second,
            }
    return info


def start_servers(work: Path, kinds: Sequence[str]) -> tuple[dict[str, subprocess.Popen[bytes]], dict[str, str]]:
    """A vLLM server of the teacher folder per served kind in ``kinds``, each on a free port, started together:
    generative with ``--max-logprobs`` (``server``), or the pooling runner sending final hidden states
    (``server_hidden``). Returns their processes and URLs once all answer ``/health``."""
    from lightning_gkd.teachers.hidden_server import POOLER_CONFIG

    processes: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    for kind in (k for k in kinds if k in SERVED):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if SERVED[kind] == "topk":
            runner = ["--max-logprobs", str(TOP_K)]
        else:
            runner = ["--runner", "pooling", "--convert", "embed", "--pooler-config", POOLER_CONFIG]
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *("--model", str(work / "teacher"), *runner, "--dtype", "float32"),
            "--kv-cache-memory-bytes",  # explicit on CPU: the utilization fraction counts the server's own RSS
            str(256 << 20),
            "--enforce-eager",
            *("--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)),
        ]
        with open(work / f"{kind}.log", "wb") as log:
            processes[kind] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        urls[kind] = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    waiting = dict(urls)
    try:
        while waiting:
            for kind, url in list(waiting.items()):
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2):
                        del waiting[kind]
                except OSError:
                    if processes[kind].poll() is not None or time.monotonic() > deadline:
                        tail = (work / f"{kind}.log").read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"the vLLM server of {kind} did not start:\n{tail}") from None
            time.sleep(1)
    except BaseException:  # a failed start, or an interrupt: no server outlives the run
        for process in processes.values():
            stop_server(process, wait=10)
        raise
    return processes, urls


def stop_server(process: subprocess.Popen[bytes], wait: float = 60) -> None:
    """SIGTERM, then SIGKILL after ``wait`` seconds (a server stopped while starting may not finish its shutdown)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=60)


def served_teacher(kind: str, url: str, work: Path, dtype: str = WIRE_DTYPE) -> Any:
    from lightning_gkd.teachers import HiddenServerTeacher, ServerTeacher

    if kind == "server":
        return ServerTeacher(url, top_k=TOP_K, concurrency=4)
    return HiddenServerTeacher(url, head=str(work / "teacher"), dtype=dtype, concurrency=4)


def server_scoring(kind: str, url: str, work: Path, shape: BenchShape) -> dict[str, Any]:
    """Tokens per second of the ``kind`` server scoring ``SCORED_ROWS`` rows (after a warm-up on a batch), and the
    answers' bytes on the wire per token (per supervised position for top-k, per token sent for hidden states)."""
    from lightning_gkd.data.chat import ChatMLCollator
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.teachers import supervised_positions

    collate = ChatMLCollator(build_chatml_tokenizer(), shape.max_length)
    batch = collate(rows(shape, SCORED_ROWS))
    positions = supervised_positions(batch["labels"])
    teacher = served_teacher(kind, url, work)
    score = teacher.topk if kind == "server" else teacher.read_states
    warm = collate(rows(shape, shape.batch))
    score(warm, supervised_positions(warm["labels"]))  # the server's first forwards, the served model resolved
    meter = WireMeter(teacher)
    started = time.perf_counter()
    score(batch, positions)
    seconds = time.perf_counter() - started
    teacher.close()
    tokens = int(batch["attention_mask"].sum())
    return {
        "rows": SCORED_ROWS,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        **meter.read(int(positions.sum())),
    }


class WireMeter:
    """The answer bytes a served teacher receives from now on (``JsonClient.received_bytes``), per token scored:
    per supervised position for top-k (``supervised``, given to ``read``), per token sent for hidden states
    (``HiddenServerTeacher.payload_tokens``)."""

    def __init__(self, teacher: Any) -> None:
        self.teacher = teacher
        self.bytes = teacher.server.client.received_bytes
        self.sent = getattr(teacher, "payload_tokens", 0)

    def read(self, supervised: int) -> dict[str, Any]:
        wire = self.teacher.server.client.received_bytes - self.bytes
        sent = getattr(self.teacher, "payload_tokens", None)
        tokens = supervised if sent is None else sent - self.sent
        return {"wire_bytes": wire, "wire_tokens": tokens, "bytes_per_token": wire / tokens}


def loss_agreement(work: Path, urls: Mapping[str, str], shape: BenchShape) -> dict[str, Any]:
    """On one collated batch of the workers' rows: the in-process dense loss (``DenseDistillation(LocalTeacher)``)
    and each other teacher's, beta 0 and 1; each with its relative difference from the dense one, and the served
    teachers' bytes on the wire per token over both calls."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_gkd.data.chat import ChatMLCollator
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.losses.dense import DenseDistillation
    from lightning_gkd.losses.settings import DivergenceSettings
    from lightning_gkd.losses.sparse import TopKDistillation
    from lightning_gkd.teachers import LocalTeacher, supervised_positions
    from lightning_gkd.teachers.offline.reader import open_teacher_cache

    tokenizer = build_chatml_tokenizer()
    student = build_model(shape.student, shape.vocab, tokenizer, seed=0).eval()
    teacher = AutoModelForCausalLM.from_pretrained(work / "teacher", dtype=torch.float32).eval()
    batch = ChatMLCollator(tokenizer, shape.max_length)(rows(shape, shape.batch))  # the first batch the caches hold
    supervised = int(supervised_positions(batch["labels"]).sum())
    losses: dict[str, dict[str, float]] = {"local": {}}
    sources: dict[str, Any] = {"cache hidden (float16)": open_teacher_cache(work / "cache_hidden")}
    if "server_hidden" in urls:
        for dtype in ("float32", "bfloat16"):
            sources[f"server hidden ({dtype})"] = served_teacher("server_hidden", urls["server_hidden"], work, dtype)
    if "server" in urls:
        sources["server top-20"] = served_teacher("server", urls["server"], work)
    meters = {name: WireMeter(source) for name, source in sources.items() if hasattr(source, "server")}
    with torch.no_grad():
        for beta in (0.0, 1.0):
            key = f"{beta:g}"
            divergence = DivergenceSettings(beta=beta)
            local = DenseDistillation(LocalTeacher(teacher), divergence)(student, batch).loss
            losses["local"][key] = float(local)
            for name, source in sources.items():
                is_topk = hasattr(source, "topk")
                loss = TopKDistillation(source, divergence) if is_topk else DenseDistillation(source, divergence)
                losses.setdefault(name, {})[key] = float(loss(student, batch).loss)
    for source in sources.values():
        if hasattr(source, "close"):
            source.close()
    relative = {
        name: {beta: abs(value - losses["local"][beta]) / abs(losses["local"][beta]) for beta, value in values.items()}
        for name, values in losses.items()
        if name != "local"
    }
    return {
        "tokens": supervised,
        "losses": losses,
        "relative_difference": relative,
        "wire": {name: meter.read(2 * supervised) for name, meter in meters.items()},  # two calls: beta 0 and 1
    }


def run_worker(
    kind: str, lmbda: float, warmup: int, steps: int, work: Path, vocab: int, urls: Mapping[str, str], tiny: bool
) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", kind, str(lmbda), str(warmup), str(steps), str(work), str(vocab)]
    command += [json.dumps(dict(urls)), *(["--tiny"] if tiny else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} lmbda={lmbda} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_pass(
    shape: BenchShape, tiny: bool, reps: int, steps: int, warmup: int, kinds: Sequence[str], build_rows: int
) -> dict[str, Any]:
    """Everything measured at one vocabulary size (``shape.vocab``): the caches (their build throughput over
    ``build_rows`` rows; 0: not measured), the servers' scoring, the loss check, then the workers, kinds alternating
    per repetition."""
    vocab = shape.vocab
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        info = prepare(work, shape.batch * (warmup + steps), build_rows, shape)
        processes, urls = start_servers(work, kinds)
        try:
            scoring = {kind: server_scoring(kind, url, work, shape) for kind, url in urls.items()}
            losses = loss_agreement(work, urls, shape)
            for rep in range(reps):
                for lmbda in (0.0, 1.0):
                    for kind in kinds if rep % 2 == 0 else list(reversed(kinds)):
                        if lmbda == 1.0 and kind not in ON_POLICY_KINDS:
                            continue
                        key = f"{kind}@{lmbda:g}"
                        try:
                            result = run_worker(kind, lmbda, warmup, steps, work, vocab, urls, tiny)
                            runs.setdefault(key, []).append(result)
                        except RuntimeError as error:
                            failures[key] = str(error)
                        print(vocab, key, runs.get(key, [])[-1:] or failures.get(key, "")[-300:], flush=True)
        finally:
            for process in processes.values():
                stop_server(process)
    return {
        "vocab": vocab,
        "reps": reps,
        "steps": steps,
        "warmup": warmup,
        "seconds": time.perf_counter() - started,
        "teacher": info.pop("teacher"),
        "caches": info,
        "scoring": scoring,
        "losses": losses,
        "runs": {k: v for k, v in runs.items() if v},
        "failures": failures,
    }


def figure(result: Mapping[str, Any], key: str, field: str) -> float | None:
    """``field`` of the runs of ``key`` (``kind@lmbda``) at one vocabulary, None when not run: seconds per step, the
    fastest repetition's (other work on the machine only slows a run down); memory, the median."""
    runs = result["runs"].get(key)
    if not runs:
        return None
    values = [float(r[field]) for r in runs]
    return min(values) if field == "seconds_per_step" else float(statistics.median(values))


def payload_rows(result: Mapping[str, Any]) -> list[tuple[str, float, str]]:
    """``(teacher, bytes per token, how it was measured)`` for each kind at one vocabulary."""
    vocab, caches, wire = result["vocab"], result["caches"], result["losses"]["wire"]
    hidden = result["teacher"]["hidden_size"]
    out = [
        ("local", 0.0, "nothing leaves the process"),
        ("cache top-20", caches["cache"]["bytes_per_token"], "manifest: shard bytes per supervised token"),
        (
            "cache hidden (float16)",
            caches["cache_hidden"]["bytes_per_token"],
            f"manifest: shard bytes per supervised token (2H = {2 * hidden} + offsets)",
        ),
    ]
    if "server top-20" in wire:
        how = "wire: JSON `prompt_logprobs` answers per supervised position (entries for every prompt token)"
        out.append(("server top-20", wire["server top-20"]["bytes_per_token"], how))
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        name = f"server hidden ({dtype})"
        if name in wire:
            how = f"wire: base64 in JSON per token sent ({size}H = {size * hidden} bytes decoded)"
            out.append((name, wire[name]["bytes_per_token"], how))
    out.append(("full float32 logits", 4.0 * vocab, "4V, for scale: what a logits server would send"))
    return out


def load_range(result: Mapping[str, Any]) -> str:
    loads = [r["load_average"] for runs in result["runs"].values() for r in runs]
    return f"{min(loads):.1f} to {max(loads):.1f}" if loads else "no runs"


def render_pass(result: Mapping[str, Any], batch: int) -> list[str]:
    vocab, teacher = result["vocab"], result["teacher"]
    lines = [
        f"## Vocabulary {vocab}",
        "",
        f"{result['reps']} repetition(s) of {result['steps']} timed step(s) after {result['warmup']} warm-up "
        f"step(s); this pass took {result['seconds'] / 60:.1f} min. The teacher's float32 weights: "
        f"{teacher['weights_mb']:.0f} MB, of which its head (V x H = {vocab} x {teacher['hidden_size']}, tied to "
        f"the input embedding) {teacher['head_mb']:.0f} MB. The machine's load average (1 min) as the workers "
        f"ended: {load_range(result)}.",
        "",
        "| teacher | lmbda | s / optimizer step | RSS before the module (MB) | peak RSS before the first "
        "step (MB) | peak RSS through the fit (MB) | peak over before (MB) | the teacher's tensors "
        "in the process (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, runs in result["runs"].items():
        kind, lmbda = key.split("@")
        seconds, before = figure(result, key, "seconds_per_step"), figure(result, key, "baseline_rss_mb")
        setup, peak = figure(result, key, "setup_peak_rss_mb"), figure(result, key, "peak_rss_mb")
        assert seconds is not None and before is not None and setup is not None and peak is not None
        held = runs[0]["teacher_mb"]
        lines.append(
            f"| {LABELS[kind]} | {lmbda} | {seconds:.3f} | {before:.0f} | {setup:.0f} | {peak:.0f} | "
            f"{peak - before:+.0f} | {held:.0f} |"
        )
    for key, error in result["failures"].items():
        kind, lmbda = key.split("@")
        lines.append(f"| {LABELS[kind]} | {lmbda} | failed: {error.splitlines()[-1][:120]} | | | | | |")
    lines += [
        "",
        "The teacher's signal per token (servers: on the wire over the loss check's two calls below):",
        "",
        "| teacher | bytes / token | of 4V | measured as |",
        "|---|---|---|---|",
    ]
    for name, value, how in payload_rows(result):
        lines.append(f"| {name} | {value:,.0f} | {value / (4 * vocab):.2%} | {how} |")
    losses = result["losses"]
    lines += [
        "",
        f"The loss on one batch ({batch} rows, {losses['tokens']} supervised tokens) against the in-process "
        "dense loss (`DenseDistillation(LocalTeacher(teacher))`); hidden kinds through `DenseDistillation`, the "
        "top-20 server through `TopKDistillation` (tail bucket):",
        "",
        "| teacher | loss, beta 0 | relative difference | loss, beta 1 | relative difference |",
        "|---|---|---|---|---|",
    ]
    for name, values in losses["losses"].items():
        relative = losses["relative_difference"].get(name)
        cells = []
        for beta in ("0", "1"):
            cells += [f"{values[beta]:.6g}", "" if relative is None else f"{relative[beta]:.1e}"]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    caches, scoring = result["caches"], result["scoring"]
    lines.append("")
    for name in ("cache", "cache_hidden"):
        if "build_tokens_per_s" in caches[name]:
            lines.append(
                f"- {LABELS[name]}: a build over {caches[name]['build_rows']} rows ({caches[name]['build_tokens']} "
                f"supervised tokens, one process) ran at {caches[name]['build_tokens_per_s']:.0f} tokens/s."
            )
    for key in SERVED:
        if key in scoring:
            lines.append(
                f"- {LABELS[key]} scoring ({scoring[key]['rows']} rows, {scoring[key]['tokens']} tokens, 4 "
                f"requests in flight): {scoring[key]['tokens_per_s']:.0f} tokens/s."
            )
    return lines + [""]


def render(results: Mapping[str, Any]) -> str:
    meta = results["meta"]
    passes = "; ".join(
        f"{r['vocab']}: {r['reps']} repetition(s) x {r['steps']} timed step(s) (+{r['warmup']} warm-up)"
        for r in results["passes"]
    )
    if len({(r["reps"], r["steps"], r["warmup"]) for r in results["passes"]}) > 1:
        passes += " (the larger vocabulary's steps are slow on 2 cores: fewer of them, to fit the run's budget)"
    vocabs = " and ".join(str(r["vocab"]) for r in results["passes"])
    student, teacher = meta["student"], meta["teacher"]
    lines = [
        "# Where the teacher lives: local, cache or server; top-k or hidden states",
        "",
        "Generated by `scripts/bench_teachers.py` (do not edit by hand; rerun the script).",
        "",
        f"- Command: `{meta['command']}`; total {meta['seconds'] / 60:.1f} min; 2 CPU cores shared with other "
        f"work (single runs are noisy), float32. Per vocabulary: {passes}.",
        f"- Models: scripts/bench.py's, random init (student {student['num_hidden_layers']} x "
        f"{student['hidden_size']}, teacher {teacher['num_hidden_layers']} x {teacher['hidden_size']}), tied "
        f"embeddings, at vocabularies {vocabs} ({LARGE_VOCAB}: Qwen2.5's padded one, a real-shape head); the "
        "bench tokenizer's 259 tokens pad to each, as Qwen2.5's 151665 do, so the rows' ids stay within the "
        "tokenizer (on-policy samples of the random-init student range over the whole vocabulary). Batch "
        f"{meta['batch']}, {meta['new_tokens']}-token answers (lmbda 0, beta 0) or {meta['new_tokens']} sampled "
        "tokens (lmbda 1, beta 0.5). Top-20 kinds: the tail bucket (`sparse_loss=topk`); "
        "local and hidden kinds: the full distributions.",
        "- Every measurement in a fresh process, kinds alternating per repetition. Seconds per optimizer step: the "
        "median of a run's timed steps, the fastest repetition (other work on the machine only slows runs down; "
        "every run's steps and the load average are in the .json). RSS is the student process's "
        "(VmHWM), counted from just before the module is built (after imports and the student's build). The "
        "teacher's weights (local) and a hidden-state teacher's head (V x H float32) are memory-mapped from "
        "safetensors: their pages count when first touched, in the first step, so the peak before the first step "
        "is the module's construction, the servers' probes and Lightning's setup, and the fit's peak holds the "
        "teacher's tensors (the last column). "
        f"The hidden-state server's head was read by `{meta['head_loader']}`.",
        "- The servers (vLLM, float32) run on the same 2 cores as the trainer: their forward time is in the server "
        "rows' step time. On another machine it would not be; the student process's memory is the point of "
        "comparison there.",
        "",
    ]
    for result in results["passes"]:
        lines += render_pass(result, meta["batch"])
    lines += notes(results)
    return "\n".join(lines).rstrip() + "\n"


def notes(results: Mapping[str, Any]) -> list[str]:
    """What dominates where, computed from the figures."""
    lines = ["## Where time and memory go", ""]
    for result in results["passes"]:
        vocab = result["vocab"]

        def step(key: str, result: Mapping[str, Any] = result) -> float | None:
            return figure(result, key, "seconds_per_step")

        def grown(key: str, result: Mapping[str, Any] = result) -> float | None:
            peak, before = figure(result, key, "peak_rss_mb"), figure(result, key, "baseline_rss_mb")
            return None if peak is None or before is None else peak - before

        topk, hidden, local = step("cache@0"), step("cache_hidden@0"), step("local@0")
        if topk and hidden and local:
            lines.append(
                f"- {vocab}, lmbda 0, time: the top-20 cache ({topk:.2f} s) is about the student's own step "
                "(forward, top-20 loss, backward, AdamW); the "
                f"hidden-state cache adds the teacher's head and the full-vocabulary loss in the student process "
                f"({hidden - topk:+.2f} s); the in-process teacher adds its decoder's forward ({local - hidden:+.2f} "
                "s)."
            )
        served, served_hidden = step("server@0"), step("server_hidden@0")
        if topk and hidden and served and served_hidden:
            lines.append(
                f"- {vocab}, lmbda 0, servers: over the matching cache, the top-20 server adds {served - topk:+.2f} s "
                f"(its forward with the full-vocabulary projection at every prompt token, on the shared cores, and "
                f"the JSON), the hidden-state server {served_hidden - hidden:+.2f} s (its forward without a head)."
            )
        on_local, on_served, on_hidden = step("local@1"), step("server@1"), step("server_hidden@1")
        if on_local and on_served and on_hidden:
            lines.append(
                f"- {vocab}, lmbda 1: local {on_local:.2f} s, top-20 server {on_served:.2f} s, hidden-state server "
                f"{on_hidden:.2f} s a step; sampling 64 tokens from the student is in all three."
            )
        m_topk, m_hidden, m_local = grown("cache@0"), grown("cache_hidden@0"), grown("local@0")
        if m_topk is not None and m_hidden is not None and m_local is not None:
            teacher = result["teacher"]
            lines.append(
                f"- {vocab}, memory (lmbda 0, peak over before): top-20 cache {m_topk:+.0f} MB (the student's "
                f"training state); the hidden-state cache {m_hidden - m_topk:+.0f} MB more (its "
                f"{teacher['head_mb']:.0f} MB head and the dense loss's buffers); local {m_local - m_topk:+.0f} MB "
                f"more (the teacher's {teacher['weights_mb']:.0f} MB of weights and its forward)."
            )
    for result in results["passes"]:
        wire = result["losses"]["wire"]
        if "server top-20" in wire and "server hidden (bfloat16)" in wire:
            topk_bytes = wire["server top-20"]["bytes_per_token"]
            hidden_bytes = wire["server hidden (bfloat16)"]["bytes_per_token"]
            lines.append(
                f"- {result['vocab']}, bytes: the hidden-state server's bfloat16 answer ({hidden_bytes:,.0f} B a "
                f"token, base64) is {hidden_bytes / topk_bytes:.2f}x the top-20 server's JSON ({topk_bytes:,.0f} B a "
                f"supervised token) and {hidden_bytes / (4 * result['vocab']):.2%} of the full logits; it grows with "
                "H, not V."
            )
    scored = [r for r in results["passes"] if {"server", "server_hidden"} <= set(r["scoring"])]
    if len(scored) > 1:
        first, last = scored[0], scored[-1]
        lines.append(
            f"- Scoring throughput from {first['vocab']} to {last['vocab']}: the top-20 server "
            f"{first['scoring']['server']['tokens_per_s']:.0f} -> {last['scoring']['server']['tokens_per_s']:.0f} "
            "tokens/s (it projects every token onto the vocabulary and sorts it), the hidden-state server "
            f"{first['scoring']['server_hidden']['tokens_per_s']:.0f} -> "
            f"{last['scoring']['server_hidden']['tokens_per_s']:.0f} (no head: the vocabulary's cost moves to the "
            "student process, at the supervised positions only)."
        )
    if any(r["losses"]["relative_difference"].get("server top-20") for r in results["passes"]):
        lines.append(
            "- The losses: the hidden kinds give the dense loss up to their wire or storage rounding. The top-20 "
            "loss is far from it here because random-init models have nearly flat distributions: 20 tokens hold "
            "almost none of the mass (top-k's worst case; trained teachers: [Top-k teacher cache](sparse_teacher.md))."
        )
    return lines + [""]


def head_loader() -> str:
    """Which ``load_output_head`` this checkout has (a stand-in loads the whole teacher to take its head)."""
    from lightning_gkd.models import head

    stand_in = "TEMPORARY" in Path(head.__file__).read_text().splitlines()[0]
    return "lightning_gkd.models.head.load_output_head" + (
        " (a temporary stand-in loading the model)" if stand_in else ""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=int, nargs="+", help="vocabulary sizes, one pass each (default: 32000 151936)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of the first vocabulary's pass")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of the first vocabulary's pass")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps of the first vocabulary's pass")
    parser.add_argument("--large-reps", type=int, default=1, help="repetitions of the other vocabularies' passes")
    parser.add_argument("--large-steps", type=int, default=2, help="timed steps of the other passes")
    parser.add_argument("--large-warmup", type=int, default=1, help="warm-up steps of the other passes")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks_teachers.md")
    parser.add_argument("--tiny", action="store_true", help="toy model sizes (checks the script, not speed)")
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, lmbda, warmup, steps, work, vocab, urls = args.worker
        shape = teachers_shape(args.tiny, int(vocab))
        result = worker(kind, float(lmbda), int(warmup), int(steps), Path(work), json.loads(urls), shape)
        print(json.dumps(result))
        return
    started = time.perf_counter()
    have_vllm = importlib.util.find_spec("vllm") is not None
    kinds = [k for k in KINDS if have_vllm or k not in SERVED]
    bench_vocab = teachers_shape(args.tiny).vocab
    vocabs = args.vocabs or [bench_vocab, TINY_LARGE_VOCAB if args.tiny else LARGE_VOCAB]
    passes = []
    for index, vocab in enumerate(vocabs):
        if index == 0:
            reps, steps, warmup = args.reps, args.steps, args.warmup
        else:
            reps, steps, warmup = args.large_reps, args.large_steps, args.large_warmup
        build_rows = (32 if args.tiny else BUILD_ROWS) if vocab == bench_vocab else 0
        shape = teachers_shape(args.tiny, vocab)
        passes.append(run_pass(shape, args.tiny, reps, steps, warmup, kinds, build_rows))
    results = {
        "meta": {
            "command": " ".join(["python scripts/bench_teachers.py", *sys.argv[1:]]),
            "seconds": time.perf_counter() - started,
            "kinds": kinds,
            "student": teachers_shape(args.tiny).student,
            "teacher": teachers_shape(args.tiny).teacher,
            "batch": teachers_shape(args.tiny).batch,
            "new_tokens": teachers_shape(args.tiny).new_tokens,
            "head_loader": head_loader(),
        },
        "passes": passes,
    }
    write_report(args.out, render(results), results)
    print(render(results))


if __name__ == "__main__":
    main()
