"""The per-turn sampling cost of a multi-turn rollout with ``sampler=hf``, re-prefilling every turn against reusing
each row's KV cache across turns (``KVCacheSampler(reuse_turn_cache=...)``), side by side in one process.

The workload is deterministic: a batch of prompts of uneven lengths; each turn the sampler writes exactly
``new_tokens`` tokens per row (no EOS: every turn runs to ``max_new_tokens``), then an environment appends a reply
of ``reply_tokens`` fixed tokens, for ``turns`` turns. The two settings alternate within every repetition (their
order flips each time), after one untimed warm-up rollout each; each turn's seconds are the median over the
repetitions. The transcripts of both settings are compared token for token (greedy, top_k=1). ``scripts/
bench_turns.py`` runs it and writes docs/benchmarks_turns.md and .json."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch

from lightning_gkd.data.chat_tokens import left_pad
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.samplers import KVCacheSampler
from lightning_gkd.studies.bench_models import BenchShape, bench_shape, build_model

SETTINGS = ("re-prefill", "reuse")


@dataclass(frozen=True)
class TurnBenchConfig:
    """A run of the bench: the ``bench_models`` shape whose student samples (``tiny``: its toy sizes), its batch,
    the prompt lengths (rows spread evenly from ``prompt_min`` to ``prompt_max`` tokens: a system prompt with tool
    schemas and a question), the tokens sampled and replied per turn (a tool call and its result), the turns, the
    timed repetitions, torch's threads (default 1: on a shared machine one thread is disturbed least; None: torch's
    default)."""

    shape: str = "small"
    tiny: bool = False
    batch: int | None = None  # None: the shape's
    prompt_min: int = 256
    prompt_max: int = 384
    new_tokens: int = 24
    reply_tokens: int = 96
    turns: int = 4
    repeats: int = 5
    threads: int | None = 1


def workload(config: TurnBenchConfig) -> tuple[BenchShape, torch.nn.Module, list[list[int]]]:
    """The shape, its student (random weights, float32, eval mode, no EOS: turns run to ``new_tokens``) and the
    prompts' token ids."""
    shape = bench_shape(config.shape, tiny=config.tiny)
    model = build_model(shape.student, shape.vocab, SimpleNamespace(eos_token_id=None, pad_token_id=0), 0).eval()
    model.generation_config.eos_token_id = None
    batch = config.batch or shape.batch
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(config.prompt_min, config.prompt_max, batch).round().long().tolist()
    prompts = [torch.randint(3, shape.vocab, (n,), generator=generator).tolist() for n in lengths]
    return shape, model, prompts


def rollout(
    sampler: KVCacheSampler, model: torch.nn.Module, prompts: list[list[int]], config: TurnBenchConfig, vocab: int
) -> tuple[list[float], list[dict[str, float]], list[list[int]]]:
    """One multi-turn rollout: each turn's seconds in ``sample`` and ``last_stats``, and the transcripts. The reply
    after turn ``t`` is ``reply_tokens`` tokens derived from ``t`` and the row (the same in every run)."""
    contexts = [list(p) for p in prompts]
    seconds, stats = [], []
    for turn in range(config.turns):
        ids, mask = left_pad(contexts, 0), left_pad([[1] * len(c) for c in contexts], 0)
        started = time.perf_counter()
        out = sampler.sample(model, ids, mask, seed=turn)
        seconds.append(time.perf_counter() - started)
        stats.append(sampler.last_stats())
        width = ids.shape[1]
        for row, (tokens, labels) in enumerate(zip(out["input_ids"], out["labels"], strict=True)):
            contexts[row] += tokens[width:][labels[width:] != IGNORE_INDEX].tolist()
            if turn + 1 < config.turns:
                contexts[row] += [3 + (7 * turn + 13 * row + i) % (vocab - 3) for i in range(config.reply_tokens)]
    sampler.end_rollout()
    return seconds, stats, contexts


def run(config: TurnBenchConfig) -> dict[str, Any]:
    """The bench: per setting, each turn's median seconds and prefill/reused tokens, the per-turn ratios
    (re-prefill / reuse) and the whole rollout's, whether the transcripts matched, and the timings of every
    repetition."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    shape, model, prompts = workload(config)
    samplers = {
        name: KVCacheSampler(
            SimpleNamespace(eos_token_id=None, pad_token_id=0),
            max_new_tokens=config.new_tokens,
            top_k=1,
            reuse_turn_cache=name == "reuse",
        )
        for name in SETTINGS
    }
    transcripts = {}
    for name in SETTINGS:  # warm-up: allocator, oneDNN kernels; and the transcripts to compare
        transcripts[name] = rollout(samplers[name], model, prompts, config, shape.vocab)[2]
    timings: dict[str, list[list[float]]] = {name: [] for name in SETTINGS}
    stats: dict[str, list[dict[str, float]]] = {}
    for repeat in range(config.repeats):
        order = SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]
        for name in order:
            seconds, stats[name], _ = rollout(samplers[name], model, prompts, config, shape.vocab)
            timings[name].append(seconds)
    per_turn = []
    for turn in range(config.turns):
        row: dict[str, Any] = {"turn": turn + 1}
        for name in SETTINGS:
            row[f"{name}_seconds"] = statistics.median(t[turn] for t in timings[name])
            row[f"{name}_min_seconds"] = min(t[turn] for t in timings[name])
            row[f"{name}_prefill_tokens"] = stats[name][turn]["prefill_tokens"]
            row[f"{name}_reused_tokens"] = stats[name][turn]["reused_tokens"]
        row["ratio"] = row["re-prefill_seconds"] / row["reuse_seconds"]
        per_turn.append(row)
    totals = {name: statistics.median(sum(t) for t in timings[name]) for name in SETTINGS}
    return {
        "config": asdict(config),
        "shape": {"name": shape.name, "student": shape.student, "vocab": shape.vocab},
        "batch": len(prompts),
        "prompt_lengths": [len(p) for p in prompts],
        "per_turn": per_turn,
        "rollout_seconds": totals,
        "rollout_ratio": totals["re-prefill"] / totals["reuse"],
        "transcripts_equal": transcripts["re-prefill"] == transcripts["reuse"],
        "timings": timings,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
    }


def page(result: dict[str, Any], *, command: str, load: str, minutes: float) -> str:
    """docs/benchmarks_turns.md from ``run``'s result."""
    config, shape = result["config"], result["shape"]
    student = shape["student"]
    lines = [
        "# Benchmark: KV reuse across the turns of a multi-turn rollout",
        "",
        "`sampler=hf` (`KVCacheSampler`) with `sampler.reuse_turn_cache=false` re-prefills every row's whole "
        "transcript at every turn; with `true` (the default) it reuses each row's KV cache from the previous turn "
        "and prefills only the new suffix ([Sampling](sampling.md#kv-reuse-across-turns)). Both sample the same "
        "tokens (checked here: "
        + (
            "the transcripts of both settings were equal token for token"
            if result["transcripts_equal"]
            else "**the transcripts differed**"
        )
        + ").",
        "",
        f"- Command: `{command}`; total {minutes:.1f} min; machine: {result['machine']}, torch threads "
        f"{result['threads']}; load while running: {load}.",
        f"- Model: the `{shape['name']}` bench shape's student (`lightning_gkd.studies.bench_models`: Qwen2 "
        f"{student['num_hidden_layers']} x {student['hidden_size']}, vocabulary {shape['vocab']}), random weights, "
        "float32, greedy, the dynamic decoder (the CPU default).",
        f"- Workload: {result['batch']} rows, prompts of {min(result['prompt_lengths'])} to "
        f"{max(result['prompt_lengths'])} tokens, {config['turns']} turns of exactly {config['new_tokens']} sampled "
        f"tokens (no EOS), each answered by a fixed {config['reply_tokens']}-token reply "
        "(`lightning_gkd.studies.turn_bench`).",
        f"- Timing: one untimed warm-up rollout per setting, then {config['repeats']} repetitions alternating the "
        "two settings (their order flipped each time); each figure is the median over the repetitions of the "
        "seconds in `sample` (the last column: the ratio of each setting's fastest repetition, the least "
        "disturbed). The machine is shared with other work, so the absolute seconds are noisy: read the ratios, "
        "which are measured side by side.",
        "",
        "| turn | prefill tokens (re-prefill / reuse) | reused tokens | re-prefill s | reuse s | ratio | ratio of "
        "the fastest runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["per_turn"]:
        fastest = row["re-prefill_min_seconds"] / row["reuse_min_seconds"]
        lines.append(
            f"| {row['turn']} | {row['re-prefill_prefill_tokens']:.0f} / {row['reuse_prefill_tokens']:.0f} | "
            f"{row['reuse_reused_tokens']:.0f} | {row['re-prefill_seconds']:.3f} | {row['reuse_seconds']:.3f} | "
            f"{row['ratio']:.2f}x | {fastest:.2f}x |"
        )
    totals = result["rollout_seconds"]
    lines += [
        f"| whole rollout | | | {totals['re-prefill']:.3f} | {totals['reuse']:.3f} | {result['rollout_ratio']:.2f}x "
        "| |",
        "",
        "The first turn is the same work in both settings (nothing is kept yet; its ratio is the noise). From the "
        "second on, the re-prefill's prefill grows with the transcript while reuse prefills the previous turn's "
        "last sampled token, the reply and nothing else; the decode steps cost the same in both, so the saving is "
        "the prefill's share of a turn, which grows with the transcript and the model.",
        "",
    ]
    return "\n".join(lines)
