"""A vision-language GKD step beside a text GKD step of the same language model: step time and peak memory, side by
side in one run (each arm in its own process, arms alternated).

    python scripts/bench_vlm_step.py                  # the toy LLaVA pair (lightning_gkd.toy.tiny_vlm), batch 32
    python scripts/bench_vlm_step.py --lmbda 0        # dataset completions: no sampling

The text arm is the same student and teacher language models (their ``language_model`` and ``lm_head`` weights in a
``LlamaForCausalLM``) on the same rows with the image part removed, so its prompts are the image's tokens shorter.
The vision arm's extra cost is the processor in the collator, the vision towers and the image tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import lightning as L
import torch
from transformers import AutoModelForCausalLM

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.studies.process_memory import current_rss_mb, peak_since_reset_mb, reset_peak_rss
from lightning_gkd.studies.step_timing import plain_trainer
from lightning_gkd.toy import shape_rows
from lightning_gkd.toy.tiny_vlm import TOY_VLM_STUDENT, TOY_VLM_TEACHER, tiny_vlm


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def text_model(vlm: torch.nn.Module) -> torch.nn.Module:
    """The vision-language model's language model and head as a text causal LM, with the same weights."""
    model = AutoModelForCausalLM.from_config(vlm.config.text_config)
    state = {f"model.{k}": v for k, v in vlm.model.language_model.state_dict().items()}
    state["lm_head.weight"] = vlm.lm_head.weight.detach()
    model.load_state_dict(state)
    return model


def without_images(row: dict) -> dict:
    messages = [
        {**m, "content": "".join(p["text"] for p in m["content"] if p["type"] == "text")}
        if isinstance(m["content"], list)
        else m
        for m in row["messages"]
    ]
    return {"messages": messages}


def run_arm(arm: str, steps: int, batch_size: int, lmbda: float) -> dict[str, float]:
    student, processor = tiny_vlm("llava", seed=0, **TOY_VLM_STUDENT)
    teacher, _ = tiny_vlm("llava", seed=1, **TOY_VLM_TEACHER)
    rows = shape_rows("train", num_rows=batch_size * steps)
    options: dict[str, Any] = {"processor": processor}
    if arm == "text":
        student, teacher, rows, options = (
            text_model(student),
            text_model(teacher),
            [without_images(r) for r in rows],
            {},
        )
    data = ChatDataModule(processor.tokenizer, rows, batch_size=batch_size, max_length=80, shuffle=False, **options)
    module = GKDModule(
        student,
        teacher,
        processor.tokenizer,
        lmbda=lmbda,
        sampling={"max_new_tokens": 16, "temperature": 1.0},
        training={"frozen_dtype": "float32"},
    )
    times = StepTimes()
    reset_peak_rss()
    start = current_rss_mb()
    plain_trainer(steps, callbacks=[times]).fit(module, data)
    trained = sum(p.numel() for p in module.student.parameters() if p.requires_grad)
    return {
        "median_step_s": statistics.median(times.seconds[2:]),
        "peak_rss_mb": peak_since_reset_mb(),
        "peak_rss_growth_mb": peak_since_reset_mb() - start,  # over the process with its models built
        "trained_parameters": trained,
        "tokens_per_row": float(data.collator(rows[:batch_size])["input_ids"].shape[1]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lmbda", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arm", choices=["vision", "text"], help=argparse.SUPPRESS)  # one measurement, as a child
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.steps, args.batch_size, args.lmbda)))
        return 0
    results: dict[str, list[dict[str, float]]] = {"vision": [], "text": []}
    for _ in range(args.repeats):
        for arm in ("vision", "text"):
            command = [sys.executable, __file__, "--arm", arm, "--steps", str(args.steps)]
            command += ["--batch-size", str(args.batch_size), "--lmbda", str(args.lmbda)]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results[arm].append(json.loads(out.strip().splitlines()[-1]))
    summary = {arm: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for arm, runs in results.items()}
    print(json.dumps(summary, indent=2))
    vision, text = summary["vision"], summary["text"]
    print(
        f"λ={args.lmbda}, batch {args.batch_size}: step {vision['median_step_s']:.3f} s (images) vs "
        f"{text['median_step_s']:.3f} s (text) = {vision['median_step_s'] / text['median_step_s']:.2f}x; peak RSS "
        f"{vision['peak_rss_mb']:.0f} vs {text['peak_rss_mb']:.0f} MB (growth during the fit "
        f"{vision['peak_rss_growth_mb']:.0f} vs {text['peak_rss_growth_mb']:.0f} MB); "
        f"{vision['tokens_per_row']:.0f} vs {text['tokens_per_row']:.0f} tokens per row"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
