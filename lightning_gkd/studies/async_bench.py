"""Asynchronous rollouts' throughput, side by side in one run (scripts/bench_async.py): GKD at λ=1 (every step
samples) of the chain task's student against a teacher, for a few steps at each ``max_staleness``, with the trainer on
one CPU core and the producer's vLLM engine process on another; and today's synchronous run for reference (vLLM in
the trainer's process, ``sampler=vllm``, both cores).

Each configuration runs in a fresh process (``python -m lightning_gkd.studies.async_bench --config <json>``: vLLM
patches torch's thread settings in the process it runs in) and reports, over the steps after ``warmup``: steps per
second; the seconds per step the producer spent sampling (its engine round trips: ``sample``) and the trainer spent
waiting for samples (``idle``); training's own seconds per step (``train``: the step time less ``idle``); weight
snapshot and load seconds. With sampling and training on separate cores the ideal step time is
``max(sample, train)`` instead of the synchronous ``sample + train``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import lightning as L
import torch

#: The configurations of one shape: "sync" (vLLM in the trainer's process, both cores), then the staleness values.
STALENESS = (0, 1, 2, 4)


@dataclass(frozen=True)
class BenchShape:
    """A workload: the chain task's student (2 x 64) sampling ``batch_size`` prompts of up to ``max_new_tokens``
    tokens per step, trained against the shipped chain teacher (4 x 128), or with ``teacher_sizes`` (hidden,
    intermediate, layers, heads, kv heads) a randomly initialised Qwen2 teacher of that size."""

    name: str
    batch_size: int
    max_new_tokens: int
    description: str
    teacher_sizes: tuple[int, int, int, int, int] | None = None


#: the chain task at two batch sizes (decoding a batch costs less than in proportion to its rows, training does
#: not), and with a larger teacher scoring every sample (training dominates)
SHAPES = (
    BenchShape("batch 16", 16, 40, "batch 16, up to 40 new tokens, the shipped 4 x 128 teacher"),
    BenchShape("batch 32", 32, 40, "batch 32, up to 40 new tokens, the shipped 4 x 128 teacher"),
    BenchShape("training-heavy", 32, 40, "batch 32, up to 40 new tokens, an 8 x 384 teacher", (384, 1536, 8, 6, 2)),
)


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: ``max_staleness`` None is the synchronous in-process reference."""

    shape: BenchShape
    max_staleness: int | None
    steps: int
    warmup: int
    trainer_cpus: tuple[int, ...]
    engine_cpus: tuple[int, ...]


class StepFigures(L.Callback):
    """At each optimizer step's end: the time, and the producer's and the ledger's running totals."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        row = {"time": time.perf_counter()}
        producer = getattr(pl_module, "producer", None)
        if producer is not None:
            row.update(producer.figures())
            row.update(pl_module.staleness.figures())
        elif hasattr(pl_module.sampler, "seconds"):  # VLLMSampler's totals
            row["sample_seconds"] = pl_module.sampler.seconds["sample"]
            row["trainer_idle_seconds"] = pl_module.sampler.seconds["sample"] + pl_module.sampler.seconds["sync"]
            row["weight_load_seconds"] = pl_module.sampler.seconds["sync"]
        self.rows.append(row)


def run_config(config: BenchConfig) -> dict[str, Any]:
    """Fit ``config``'s steps in this process and return its figures per step (means over the measured steps)."""
    from lightning_gkd import ChatDataModule, GKDModule
    from lightning_gkd.asynchronous import VLLMProcessEngine
    from lightning_gkd.data.tokenizer import load_tokenizer
    from lightning_gkd.models.loading import load_causal_lm
    from lightning_gkd.samplers import VLLMSampler
    from lightning_gkd.studies.bench_models import build_model, qwen2_sizes
    from lightning_gkd.studies.step_timing import plain_trainer
    from lightning_gkd.toy import chain_rows
    from lightning_gkd.toy.tiny import asset_path

    synchronous = config.max_staleness is None
    cpus = sorted(os.sched_getaffinity(0)) if synchronous else list(config.trainer_cpus)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    student_path = asset_path("toy_chain/student_init")
    tokenizer = load_tokenizer(student_path)
    shape = config.shape
    rows = chain_rows("train", shape.batch_size * (config.steps + 2))
    data = ChatDataModule(tokenizer, rows, batch_size=shape.batch_size, max_length=80, seed=0)
    sampling: dict[str, Any] = {"max_new_tokens": shape.max_new_tokens, "temperature": 1.0}
    asynchronous: dict[str, Any] | None = None
    if synchronous:
        sampling["sampler"] = VLLMSampler
    else:
        engine = partial(VLLMProcessEngine, cpus=list(config.engine_cpus))
        asynchronous = {"max_staleness": config.max_staleness, "engine": engine}
    if shape.teacher_sizes is None:
        teacher = load_causal_lm(asset_path("toy_chain/teacher"))
    else:
        teacher = build_model(qwen2_sizes(*shape.teacher_sizes), len(tokenizer), tokenizer, seed=1)
    module = GKDModule(
        load_causal_lm(student_path),
        teacher,
        tokenizer,
        lmbda=1.0,
        sampling=sampling,
        asynchronous=asynchronous,
        training={"optimizer": partial(torch.optim.AdamW, lr=1e-3), "frozen_dtype": "float32"},
        validation={"metrics": {}},
    )
    figures = StepFigures()
    plain_trainer(config.steps, callbacks=[figures]).fit(module, datamodule=data)
    first, last = figures.rows[config.warmup - 1], figures.rows[-1]
    steps = len(figures.rows) - config.warmup

    def per_step(name: str) -> float:
        return (last.get(name, 0.0) - first.get(name, 0.0)) / steps

    step_seconds = (last["time"] - first["time"]) / steps
    idle = per_step("trainer_idle_seconds")
    return {
        **asdict(config),
        "steps_per_second": 1.0 / step_seconds,
        "step_seconds": step_seconds,
        "sample_seconds": per_step("sample_seconds"),
        "idle_seconds": idle,
        "train_seconds": step_seconds - idle,
        "weight_load_seconds": per_step("weight_load_seconds"),
        "snapshot_seconds": per_step("snapshot_seconds"),
        "producer_idle_seconds": per_step("producer_idle_seconds"),
        "staleness_mean": float(last.get("staleness_mean", 0.0)),
        "dropped": float(last.get("dropped", 0.0)),
    }


def run_in_process(config: BenchConfig) -> dict[str, Any]:
    """``run_config`` in a fresh Python process (its figures)."""
    import subprocess

    payload = json.dumps(asdict(config))
    done = subprocess.run(
        [sys.executable, "-m", "lightning_gkd.studies.async_bench", "--config", payload],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(len(config.trainer_cpus))},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the benchmark of {payload} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape: each configuration's medians over repeats, its speed-up over staleness 0 and over the synchronous
    in-process run, and the ideal: (sample + train) / max(sample, train) at staleness 0."""
    shapes: dict[str, Any] = {}
    for result in results:
        name = result["shape"]["name"]
        key = "sync" if result["max_staleness"] is None else str(result["max_staleness"])
        shapes.setdefault(name, {"shape": result["shape"], "configs": {}})["configs"].setdefault(key, []).append(result)
    for entry in shapes.values():
        medians = {
            key: {field: statistics.median(r[field] for r in runs) for field in _FIELDS}
            for key, runs in entry["configs"].items()
        }
        base = medians.get("0")
        for figures in medians.values():
            if base:
                figures["speedup_vs_staleness0"] = figures["steps_per_second"] / base["steps_per_second"]
            if "sync" in medians:
                figures["speedup_vs_sync"] = figures["steps_per_second"] / medians["sync"]["steps_per_second"]
        entry["medians"] = medians
        if base:
            serial = base["sample_seconds"] + base["train_seconds"]
            entry["ideal_speedup"] = serial / max(base["sample_seconds"], base["train_seconds"])
        entry["repeats"] = max(len(runs) for runs in entry["configs"].values())
        del entry["configs"]
    return shapes


_FIELDS = (
    "steps_per_second",
    "step_seconds",
    "sample_seconds",
    "idle_seconds",
    "train_seconds",
    "weight_load_seconds",
    "snapshot_seconds",
    "producer_idle_seconds",
    "staleness_mean",
    "dropped",
)


def markdown(summary: dict[str, Any]) -> str:
    """A table per shape: steps/s, speed-ups, where a step's time goes."""
    lines: list[str] = []
    order = {shape.name: index for index, shape in enumerate(SHAPES)}
    for name, entry in sorted(summary.items(), key=lambda item: order.get(item[0], len(order))):
        shape = entry["shape"]
        lines += [
            f"### {name}: {shape['description']}",
            "",
            f"Ideal speed-up from overlapping (staleness 0's sample + train over their max): "
            f"**{entry.get('ideal_speedup', float('nan')):.2f}×**; medians of {entry['repeats']} runs.",
            "",
            "| run | steps/s | × staleness 0 | × sync in process | sample s/step | train s/step | trainer idle s/step "
            "| weight snapshot + load s/step | staleness (mean) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, figures in entry["medians"].items():
            label = "sync, vLLM in process (2 cores)" if key == "sync" else f"max_staleness {key} (1 + 1 cores)"
            lines.append(
                f"| {label} | {figures['steps_per_second']:.2f} | {figures.get('speedup_vs_staleness0', 0):.2f} "
                f"| {figures.get('speedup_vs_sync', 0):.2f} | {figures['sample_seconds']:.3f} "
                f"| {figures['train_seconds']:.3f} | {figures['idle_seconds']:.3f} "
                f"| {figures['snapshot_seconds']:.4f} + {figures['weight_load_seconds']:.4f} "
                f"| {figures['staleness_mean']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def page(summary: dict[str, Any], *, command: str, machine: str, minutes: float, steps: int, warmup: int) -> str:
    """docs/benchmarks_async.md: how it was measured, a table per shape, and what the figures say about the target
    (staleness 1 at least 1.5x the synchronous step rate where sampling and training take similar times)."""
    lines = [
        "# Asynchronous rollouts: steps per second",
        "",
        "Generated by `scripts/bench_async.py` (do not edit by hand; rerun the script). The topic's home is "
        "[Asynchronous rollouts](asynchronous.md).",
        "",
        f"- Command: `{command}`; total {minutes:.1f} min; machine: {machine}.",
        f"- GKD, λ=1 (every step samples), β=0.5, temperature 1, AdamW, float32, the chain task's rows and student "
        f"(2 x 64); {steps} optimizer steps per run, the first {warmup} not timed (the engine's start, the first "
        "weight loads). Every run in a fresh process; the configurations alternate within each repetition.",
        "- `max_staleness k (1 + 1 cores)`: the trainer pinned to one core (1 torch thread), the producer's vLLM "
        "engine process (`producer=vllm`) pinned to the other. `sync, vLLM in process (2 cores)`: today's synchronous "
        "`sampler=vllm`, trainer and engine in one process on both cores.",
        "- Per optimizer step: `sample` is the producer's engine round trip for one batch (or the in-process engine's "
        "generate), `trainer idle` the time the trainer waited for samples (for the in-process run: sampling and "
        "weight syncs), `train` the step time less that wait. Sampling and training overlap fully when the step takes "
        "max(sample, train) instead of sample + train.",
        "",
    ]
    lines.append(markdown(summary))
    balanced_name = most_similar_shape(summary)
    if balanced_name is not None:
        balanced = summary[balanced_name]
        one = balanced["medians"]["1"]
        verdict = "meets" if one.get("speedup_vs_staleness0", 0) >= 1.5 else "misses"
        zero = balanced["medians"]["0"]
        ideal_step = max(zero["sample_seconds"], zero["train_seconds"])
        slower_sample = one["sample_seconds"] / zero["sample_seconds"]
        slower_train = one["train_seconds"] / zero["train_seconds"]
        lines += [
            "## Reading these numbers",
            "",
            f"- Where sampling and training take the most similar times ({balanced_name}: "
            f"{balanced['medians']['0']['sample_seconds']:.3f} s and {balanced['medians']['0']['train_seconds']:.3f} s "
            "a step at max_staleness 0), max_staleness 1 runs "
            f"{one.get('speedup_vs_staleness0', 0):.2f}× the steps per second of max_staleness 0 on the same two "
            f"cores ({verdict} the 1.5× target; the ideal is {balanced.get('ideal_speedup', 0):.2f}×), and "
            f"{one.get('speedup_vs_sync', 0):.2f}× today's synchronous run with vLLM in process on both cores, whose "
            "sampling and training each use two cores.",
            f"- Where the rest goes: a step takes {one['step_seconds']:.3f} s instead of the ideal max(sample, train) "
            f"= {ideal_step:.3f} s. Side by side, sampling takes {slower_sample:.2f}× and training {slower_train:.2f}× "
            "their time at max_staleness 0 (the two cores share the memory system and its caches), the trainer "
            f"still waits {one['idle_seconds']:.3f} s a step for samples (sampling times vary from batch to batch), "
            f"and the weight snapshot costs it {one['snapshot_seconds'] * 1000:.1f} ms (the engine's load, "
            f"{one['weight_load_seconds'] * 1000:.0f} ms, overlaps training).",
        ]
        heavy = summary.get("training-heavy")
        if heavy and "1" in heavy["medians"]:
            heavy_one, heavy_zero = heavy["medians"]["1"], heavy["medians"]["0"]
            lines.append(
                f"- Where training dominates (training-heavy), the ideal is {heavy.get('ideal_speedup', 0):.2f}× and "
                f"max_staleness 1 gives {heavy_one.get('speedup_vs_staleness0', 0):.2f}× (training's own time was "
                f"{heavy_one['train_seconds'] / heavy_zero['train_seconds']:.2f}× staleness 0's in those runs): "
                "overlapping hides the sampling time, which is small there. Giving the engine a core takes it from "
                f"training: {heavy_one.get('speedup_vs_sync', 0):.2f}× the in-process run on both cores."
            )
        larger = [key for key in ("2", "4") if key in balanced["medians"]]
        if larger:
            speedups = ", ".join(
                f"max_staleness {key}: {balanced['medians'][key].get('speedup_vs_staleness0', 0):.2f}×"
                for key in larger
            )
            lines.append(
                f"- Larger bounds ({balanced_name}; {speedups}) absorb the variance of the sampling time (long "
                "samples, multi-turn rollouts) but cannot make a step shorter than training; they cost accuracy: see "
                "[the accuracy study](results.md#asynchronous-rollouts-staleness-on-the-chain-task)."
            )
        lines.append("")
    return "\n".join(lines)


def most_similar_shape(summary: dict[str, Any]) -> str | None:
    """The measured shape (with staleness 0 and 1) whose sampling and training times at staleness 0 are closest to
    equal (by their ratio); None without one."""
    import math

    measured = {
        name: entry["medians"]["0"]
        for name, entry in summary.items()
        if {"0", "1"} <= set(entry["medians"]) and entry["medians"]["0"]["train_seconds"] > 0
    }
    if not measured:
        return None
    return min(
        measured, key=lambda name: abs(math.log(measured[name]["sample_seconds"] / measured[name]["train_seconds"]))
    )


def _config_from_json(payload: str) -> BenchConfig:
    data = json.loads(payload)
    shape = data["shape"]
    data["shape"] = BenchShape(**{**shape, "teacher_sizes": tuple(shape["teacher_sizes"] or ()) or None})
    data["trainer_cpus"], data["engine_cpus"] = tuple(data["trainer_cpus"]), tuple(data["engine_cpus"])
    return BenchConfig(**data)


def _main() -> None:
    parser = argparse.ArgumentParser(description="one configuration of the asynchronous benchmark (a child process)")
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    result = run_config(_config_from_json(args.config))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main()
