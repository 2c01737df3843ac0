"""A prepared GPU check: one script, a few minutes on one GPU, that runs each GPU code path of the package and
measures what only a GPU can tell (docs/developing.md, "A prepared GPU check").

    bash scripts/device_wheels.sh                   # here, with network: wheels into device_wheels/ (git-ignored)
    python scripts/device_check.py --setup          # on the GPU machine: install them offline, then run every part
    python scripts/device_check.py --dry-run        # anywhere: the same code paths on CPU at toy sizes (~1 minute)

Parts (each timed and guarded: one failing prints its traceback and the rest still run):

* ``default_job``    the ``lightning-gkd`` CLI's default job (toy GKD) for a few steps with ``trainer=gpu``
* ``methods``        GKD (lambda 1), OPD, SFT and DPO for a few steps at Qwen2.5-0.5B / 1.5B shapes (random init,
                     ``lightning_gkd.studies.bench_models``), bf16-mixed: seconds a step, peak GPU memory, the last loss
* ``lean_memory``    peak GPU memory of one GKD loss forward + backward, lean (hidden states, chunked) vs full
                     logits, at vocabulary 151,936 x 4,096 supervised tokens (scripts/lean_memory.py's comparison)
* ``sampler``        decode tokens/s of our KVCacheSampler (its defaults: a bf16 copy, the compiled static-cache
                     decoder on CUDA) vs Hugging Face ``generate`` on the 0.5B-shaped student, at every cell of the
                     grid (batch {2, 16, 64} x new tokens {32, 256}), repetitions interleaved, first calls apart
* ``bench_trl``      the bench's real-shape worker (``lightning_gkd.cli.bench_worker``) on the GPU: ours vs TRL's
                     DistillationTrainer (lambda 1) at every cell of the grid, repetitions interleaved (ours, TRL,
                     TRL, ours), seconds a step, tokens/s and MFU, and ours' phase breakdown per cell; skipped
                     without trl
* ``step_profile``   one on-policy GKD step with bench_trl's settings, in-process: synchronised seconds of each
                     phase, host-device syncs a step and where, torch.profiler's top operators
* ``step_profile_cpu_built``  the same with the models built on the CPU, as the bench worker builds them
* ``fsdp``           GKD for a few steps under FSDP2 on one device (Lightning's ModelParallelStrategy, as trainer=fsdp)
* ``teacher_cache``  ``lightning-gkd-cache`` with ``trainer=gpu`` (bf16-mixed): top-k and bf16 hidden-state caches

Writes ``device_check.json`` and ``device_check.md`` (a table ready for docs/benchmarks_gpu.md) to ``--out``
(default: ``$OUT`` if set, else ./device_check_out). ``--dry-run`` runs every part on CPU at toy sizes; GPU-only
measurements (peak GPU memory, MFU) are then left out with a note, so the dry run checks the script, not speed.
Where this checkout's package is not installed, the script runs again with it on PYTHONPATH (its parts' processes
inherit it).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial, wraps
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "device_wheels"
#: Dense bf16 peak of the GPU, TFLOP/s, for MFU (NVIDIA's data sheets; the SXM parts).
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}
#: (batch, new tokens) cells of the decode and step grids: on the GPU (Qwen2.5-0.5B / 1.5B shapes), and in the dry run
GPU_GRID = [(2, 32), (16, 32), (64, 32), (2, 256), (16, 256), (64, 256)]
DRY_RUN_GRID = [(2, 4), (4, 8)]
PARTS = (
    "default_job",
    "methods",
    "lean_memory",
    "sampler",
    "bench_trl",
    "step_profile",
    "step_profile_cpu_built",
    "fsdp",
    "teacher_cache",
)


class Skipped(Exception):
    """A part that cannot run here (e.g. trl not installed); recorded as skipped with the message."""


class Check:
    """The settings every part reads: where it runs and at which sizes."""

    def __init__(self, dry_run: bool, out: Path, steps: int) -> None:
        self.dry_run = dry_run
        self.out = out
        self.steps = steps
        self.device = "cpu" if dry_run else "cuda"
        self.trainer = "cpu" if dry_run else "gpu"
        from lightning_gkd.studies.bench_models import bench_shape

        # the bench's shapes: toy sizes of its small pair (dry run), Qwen2.5-0.5B / 1.5B's (GPU)
        self.shape_name = "small" if dry_run else "real"
        self.shape = bench_shape(self.shape_name, tiny=dry_run)

    # -- helpers shared by the parts ------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def cli(self, module: str, overrides: list[str], name: str) -> tuple[str, float]:
        """Run ``python -m <module> <overrides>`` with its Hydra run folder under the output folder; its stdout and
        wall seconds. A failure raises with the end of its stderr."""
        run_dir = self.out / name
        command = [sys.executable, "-m", module, *overrides, f"hydra.run.dir={run_dir}"]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=self.env(), cwd=self.out, timeout=300)
        seconds = time.perf_counter() - start
        (self.out / f"{name}.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
        return done.stdout, seconds

    def synchronize(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gb(self) -> float | None:
        """Peak GPU memory allocated since ``reset_peak`` (None on CPU: a shared process's peak RSS says nothing
        about one part)."""
        import torch

        return torch.cuda.max_memory_allocated() / 2**30 if self.device == "cuda" else None

    def model(self, sizes: dict, seed: int, tokenizer, vocab: int | None = None):
        """The bench's ``build_model`` (random init, float32; the shape's vocabulary unless given), initialised on
        the check's device (on a GPU that takes a second, not the CPU's minute for a 1.5B model)."""
        import torch

        from lightning_gkd.studies.bench_models import build_model

        with torch.device(self.device):
            return build_model(sizes, vocab or self.shape.vocab, tokenizer, seed)

    def tokenizer(self):
        from lightning_gkd.data.tokenizer import build_chatml_tokenizer

        return build_chatml_tokenizer()

    def lightning_trainer(self, steps: int, callbacks: list, strategy: Any = "auto"):
        """``plain_trainer`` at trainer=gpu's precision (autocast on CPU too in the dry run)."""
        from lightning_gkd.studies.step_timing import plain_trainer

        return plain_trainer(
            steps, accelerator=self.trainer, precision="bf16-mixed", callbacks=callbacks, strategy=strategy
        )

    def fit_timed(self, module, datamodule, strategy: Any = "auto") -> dict[str, Any]:
        """Fit ``self.steps`` optimizer steps; seconds a step after the first, peak GPU memory, the last loss."""
        from lightning_gkd.studies.step_timing import StepEnds

        step_ends = StepEnds(self.synchronize)
        self.reset_peak()
        trainer = self.lightning_trainer(self.steps, [step_ends], strategy)
        trainer.fit(module, datamodule=datamodule)
        loss = float(trainer.callback_metrics["train/loss"])
        if not loss == loss or abs(loss) == float("inf"):
            raise RuntimeError(f"the last train/loss is not finite: {loss}")
        timed = [b - a for a, b in zip(step_ends.ends, step_ends.ends[1:], strict=False)]
        return {
            "steps": trainer.global_step,
            "s_per_step": sum(timed) / len(timed),
            "loss": loss,
            "peak_gpu_gb": self.peak_gb(),
        }

    # -- the parts ------------------------------------------------------------------------------------------------

    def default_job(self) -> dict[str, Any]:
        steps = self.steps
        overrides = [f"trainer={self.trainer}", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
        overrides += ["trainer.limit_val_batches=1", f"paths.cache_dir={self.out / 'cache'}"]
        if self.dry_run:  # the held-out evaluation and validation generate over every row: fewer rows on CPU
            overrides += ["+data.val_data.num_rows=32", "+data.test_data.num_rows=32"]
        stdout, seconds = self.cli("lightning_gkd.cli.train", overrides, "default_job")
        if "== lightning_gkd summary ==" not in stdout:
            raise RuntimeError("the run printed no summary:\n" + stdout[-2000:])
        found = re.search(r"^steps: (\d+)  fit time: ([\d.]+)s  throughput: (\d+) tokens/s", stdout, re.M)
        losses = {k: float(v) for k, v in re.findall(r"^(train/loss|val/loss): ([-\d.eE+]+)$", stdout, re.M)}
        if found is None or "train/loss" not in losses:
            raise RuntimeError("the summary has no steps or train/loss:\n" + stdout[-2000:])
        return {
            "command": "lightning-gkd " + " ".join(overrides[:3]),
            "steps": int(found[1]),
            "fit_s": float(found[2]),
            "tokens_per_s": int(found[3]),
            "wall_s": seconds,
            **losses,
        }

    def methods(self) -> dict[str, Any]:
        import torch

        from lightning_gkd import ChatDataModule, PreferenceDataModule
        from lightning_gkd.cli.compose import build_method
        from lightning_gkd.studies.bench_models import bench_rows
        from lightning_gkd.training.optimizers import adamw

        shape, tokenizer = self.shape, self.tokenizer()
        rows = bench_rows(shape.batch * (self.steps + 1), answer_tokens=shape.new_tokens)
        pairs = [
            {"prompt": row["messages"][:1], "chosen": row["messages"][1:], "rejected": other["messages"][1:]}
            for row, other in zip(rows, rows[1:] + rows[:1], strict=True)
        ]
        optimizer = partial(adamw, lr=1e-5)
        sampling = [f"method.sampling.max_new_tokens={shape.new_tokens}", "seed=0"]

        def student():
            return self.model(shape.student, 0, tokenizer)

        def teacher():
            return self.model(shape.teacher, 1, tokenizer)

        def distillation(kind: str, *settings: str):
            modules = {"student": student(), "teacher": teacher(), "tokenizer": tokenizer, "optimizer": optimizer}
            return build_method([f"method={kind}", *settings, *sampling], **modules), chat()

        def chat():
            return ChatDataModule(tokenizer, rows, batch_size=shape.batch, max_length=shape.max_length)

        builders: dict[str, Callable[[], tuple]] = {
            "gkd (lambda 1)": lambda: distillation("gkd", "method.lmbda=1.0"),
            "opd": lambda: distillation("opd"),
            "sft": lambda: (
                build_method(["method=sft"], model=student(), tokenizer=tokenizer, optimizer=optimizer),
                chat(),
            ),
            "dpo": lambda: (
                build_method(
                    ["method=dpo"], model=student(), reference=student(), tokenizer=tokenizer, optimizer=optimizer
                ),
                PreferenceDataModule(tokenizer, pairs, batch_size=shape.batch, max_length=shape.max_length),
            ),
        }
        results, failed = {}, []
        for name, build in builders.items():
            try:
                module, datamodule = build()
                results[name] = self.fit_timed(module, datamodule)
            except Exception:
                traceback.print_exc()
                failed.append(name)
                results[name] = {"error": traceback.format_exc(limit=-3)}
            finally:
                module = datamodule = None
                gc.collect()  # the models of one method go before the next one's are built
                if self.device == "cuda":
                    torch.cuda.empty_cache()
        if failed:
            raise RuntimeError(f"methods that failed: {failed}; results: {json.dumps(results)[:3000]}")
        return results

    def lean_memory(self) -> dict[str, Any]:
        """One GKD loss forward + backward over ``positions`` supervised tokens, lean vs full logits: the decoder
        is 2 layers of the student's width (the loss, not the decoder, is what differs), the vocabulary 151,936."""
        import torch

        from lightning_gkd.cli.compose import build_method

        tokenizer = self.tokenizer()
        vocab, positions = (self.shape.vocab, 64) if self.dry_run else (151_936, 4096)
        sizes = {**self.shape.student, "num_hidden_layers": 2}
        out: dict[str, Any] = {"vocab": vocab, "supervised_tokens": positions}
        for lean in (False, True):
            torch.manual_seed(0)
            student, teacher = self.model(sizes, 0, tokenizer, vocab), self.model(sizes, 1, tokenizer, vocab)
            settings = ["method=gkd", f"method.divergence.lean_loss={lean}", "method.sampling.max_new_tokens=4"]
            module = build_method(settings, student=student, teacher=teacher.to(torch.bfloat16), tokenizer=tokenizer)
            module.to(self.device)
            rows = 2
            ids = torch.randint(3, vocab, (rows, positions // rows + 1), generator=torch.Generator().manual_seed(0))
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
            batch["labels"][:, 0] = -100
            batch = {k: v.to(self.device) for k, v in batch.items()}
            self.synchronize()
            self.reset_peak()
            baseline = torch.cuda.memory_allocated() / 2**30 if self.device == "cuda" else None
            start = time.perf_counter()
            with torch.autocast(self.device, dtype=torch.bfloat16):
                loss = module.distillation_loss(batch).loss
            loss.backward()
            self.synchronize()
            kind = "lean" if lean else "full"
            peak = self.peak_gb()
            out[kind] = {
                "loss": float(loss),
                "seconds": time.perf_counter() - start,
                "peak_gpu_gb": peak,
                "added_gpu_gb": None if peak is None else peak - baseline,
                "lean_taken": module.lean_path.enabled,
            }
            del module, student, teacher, loss, batch
        if not out["lean"]["lean_taken"]:
            raise RuntimeError("the lean path was not taken with lean_loss=True")
        out["loss_rel_diff"] = abs(out["lean"]["loss"] - out["full"]["loss"]) / abs(out["full"]["loss"])
        if out["loss_rel_diff"] > 2e-2:
            raise RuntimeError(f"lean and full losses differ: {out['lean']['loss']} vs {out['full']['loss']}")
        if self.device == "cuda":
            out["lean_over_full_added"] = out["lean"]["added_gpu_gb"] / out["full"]["added_gpu_gb"]
        else:
            out["note"] = "CPU dry run: losses compared, GPU memory not measured"
        return out

    def grid(self) -> list[tuple[int, int]]:
        """The (batch, new tokens) cells: ``GPU_GRID`` on the GPU, ``DRY_RUN_GRID`` in the dry run."""
        return DRY_RUN_GRID if self.dry_run else GPU_GRID

    def sampler(self) -> dict[str, Any]:
        """Decode tokens/s of our KVCacheSampler (its defaults: on a GPU a bf16 copy decoded by the compiled
        static-cache decoder) and of HF ``generate`` (sampling, temperature 0.9, its dynamic cache), the float32
        student under bf16 autocast as in training, ~60-token prompts, at every cell of the grid; repetitions
        interleaved (ours, generate, generate, ours, ...), the first call of each (compilation) timed apart."""
        import torch

        from lightning_gkd.samplers import KVCacheSampler

        tokenizer = self.tokenizer()
        model = self.model(self.shape.student, 0, tokenizer).to(self.device).eval()
        reps = 2 if self.dry_run else 3
        cells: dict[str, Any] = {}
        for batch, new in self.grid():
            prompts = torch.randint(3, len(tokenizer), (batch, 60), generator=torch.Generator().manual_seed(0))
            prompts, mask = prompts.to(self.device), torch.ones_like(prompts, device=self.device)
            ours = KVCacheSampler(tokenizer, max_new_tokens=new, temperature=0.9)

            def run_ours(seed: int, ours: Any = ours, prompts: Any = prompts, mask: Any = mask) -> int:
                out = ours.sample(model, prompts, mask, seed=seed)["input_ids"]
                return prompts.shape[0] * (out.shape[1] - prompts.shape[1])

            def run_hf(seed: int, prompts: Any = prompts, mask: Any = mask, new: int = new) -> int:
                torch.manual_seed(seed)
                with torch.no_grad():
                    out = model.generate(
                        input_ids=prompts,
                        attention_mask=mask,
                        do_sample=True,
                        temperature=0.9,
                        top_k=0,
                        max_new_tokens=new,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                return prompts.shape[0] * (out.shape[1] - prompts.shape[1])

            runs = {"ours": run_ours, "hf_generate": run_hf}
            cell: dict[str, Any] = {name: {"tokens": 0, "seconds": 0.0} for name in runs}
            if self.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.autocast(self.device, dtype=torch.bfloat16):
                for name, fn in runs.items():  # the first call: compilation, the sampling copy, allocator warm-up
                    started = time.perf_counter()
                    fn(0)
                    self.synchronize()
                    cell[name]["first_call_s"] = time.perf_counter() - started
                for rep in range(reps):
                    for name in runs if rep % 2 == 0 else reversed(list(runs)):
                        started = time.perf_counter()
                        tokens = runs[name](1 + rep)
                        self.synchronize()
                        cell[name]["seconds"] += time.perf_counter() - started
                        cell[name]["tokens"] += tokens
            for name in runs:
                cell[name]["tokens_per_s"] = cell[name]["tokens"] / cell[name]["seconds"]
            cell["ours_over_generate"] = cell["ours"]["tokens_per_s"] / cell["hf_generate"]["tokens_per_s"]
            cell["decoder"] = type(ours._decoder).__name__ + (
                " (compiled)" if getattr(ours._decoder, "compile", 0) else ""
            )
            if self.device == "cuda":
                cell["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
            cell["batch"], cell["new_tokens"] = batch, new
            cells[f"b{batch}_n{new}"] = cell
            print(f"  decode b={batch} n={new}: ours/generate {cell['ours_over_generate']:.2f}x", flush=True)
        return cells

    def bench_trl(self) -> dict[str, Any]:
        """The bench's worker (``lightning_gkd.cli.bench_worker``, its own process each) for ours and TRL's
        DistillationTrainer at lambda 1, at every cell of the grid, repetitions interleaved (ours, TRL, TRL, ours),
        and ours' phase breakdown per cell (sampling, teacher, student forward + loss, backward, optimizer)."""
        if importlib.util.find_spec("trl") is None:
            raise Skipped("trl is not installed here (pip install trl==1.16.0 to compare with its DistillationTrainer)")
        from lightning_gkd.cli.bench_worker import measure

        warmup, steps, reps = (1, 2, 2) if self.dry_run else (2, 3, 2)
        peak = self.peak_flops()
        cells: dict[str, Any] = {}
        for batch, new in self.grid():
            flops, tokens = self.step_flops(batch, new)
            cell: dict[str, Any] = {"batch": batch, "new_tokens": new, "tokens_per_step": tokens}
            cell_options = {"shape": self.shape_name, "tiny": self.dry_run, "device": self.device}
            cell_options |= {"batch": batch, "new_tokens": new}
            timings: dict[str, list[float]] = {"ours": [], "trl_distill": []}
            for rep in range(reps):
                for config in ("ours", "trl_distill") if rep % 2 == 0 else ("trl_distill", "ours"):
                    result = measure(config, 1.0, warmup, steps, **cell_options)
                    timings[config].append(result["seconds_per_step"])
            for config, seconds in timings.items():
                best = min(seconds)
                cell[config] = {
                    "s_per_step": best,
                    "s_per_step_reps": seconds,
                    "tokens_per_s": tokens / best,
                    "mfu": None if peak is None else flops / best / peak,
                }
            cell["ours_over_trl"] = cell["ours"]["s_per_step"] / cell["trl_distill"]["s_per_step"]
            try:
                cell["ours_phases_s"] = measure("breakdown:ours", 1.0, 0, 0, **cell_options)
            except RuntimeError as error:
                cell["ours_phases_s"] = {"error": str(error).strip().splitlines()[-1][:300]}
            cells[f"b{batch}_n{new}"] = cell
            print(f"  step b={batch} n={new}: ours/TRL {cell['ours_over_trl']:.2f}x", flush=True)
        out: dict[str, Any] = {"cells": cells}
        if peak is None:
            out["note"] = "MFU needs a GPU with a known bf16 peak (BF16_PEAK_TFLOPS)"
        return out

    def step_flops(self, batch: int | None = None, new_tokens: int | None = None) -> tuple[float, int]:
        """Model FLOPs of one on-policy step at the bench's shapes, and the tokens it trains on: the student's
        forward + backward (6 x non-embedding parameters x tokens, head 6 x V x H x supervised), the teacher's
        forward (2 x, head at the supervised positions), and the decode (2 x student parameters x sampled)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from lightning_gkd import ChatDataModule
        from lightning_gkd.cli.bench_worker import with_cell
        from lightning_gkd.studies.bench_models import bench_rows

        shape, tokenizer = with_cell(self.shape, batch, new_tokens), self.tokenizer()
        rows = bench_rows(shape.batch, answer_tokens=shape.new_tokens)
        datamodule = ChatDataModule(tokenizer, rows, batch_size=shape.batch)
        datamodule.setup("fit")
        prompt = next(iter(datamodule.train_dataloader()))["prompts"].shape[1]
        sampled = shape.batch * shape.new_tokens
        tokens = shape.batch * prompt + sampled

        def layers(sizes: dict) -> int:
            config = AutoConfig.for_model("qwen2", vocab_size=shape.vocab, tie_word_embeddings=True, **sizes)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            return sum(p.numel() for p in model.parameters()) - shape.vocab * sizes["hidden_size"]

        student, teacher = layers(shape.student), layers(shape.teacher)
        head = 2 * shape.vocab * sampled
        flops = 6 * student * tokens + 3 * head * shape.student["hidden_size"]
        flops += 2 * teacher * tokens + head * shape.teacher["hidden_size"]
        flops += 2 * student * sampled + head * shape.student["hidden_size"]
        return float(flops), tokens

    def peak_flops(self) -> float | None:
        import torch

        if self.device != "cuda":
            return None
        name = torch.cuda.get_device_name()
        return next((tf * 1e12 for key, tf in BF16_PEAK_TFLOPS.items() if key in name), None)

    def step_profile_cpu_built(self) -> dict[str, Any]:
        """``step_profile`` with the models built on the CPU and moved by Lightning, as the bench's worker (and a
        user's script) does."""
        return self.step_profile(build_on_cpu=True)

    def step_profile(self, build_on_cpu: bool = False) -> dict[str, Any]:
        """Where one on-policy GKD step's time goes, with bench_trl's settings (lambda 1, beta 0.5, temperature
        0.9, the bench's batch and sampled tokens): synchronised seconds of sampling, the teacher's forward, the
        student's forward + loss, backward and the optimizer step (means over the timed steps), the number of
        host-device synchronisations in one step (torch.cuda.set_sync_debug_mode), and torch.profiler's top
        operators of one step by self device time and by self CPU time."""
        import warnings

        import lightning as L
        import torch

        from lightning_gkd import ChatDataModule
        from lightning_gkd.cli.bench_worker import ours_module
        from lightning_gkd.samplers import KVCacheSampler
        from lightning_gkd.studies.bench_models import bench_rows, build_models

        shape, tokenizer = self.shape, self.tokenizer()
        warmup, timed, profiled = 2, 3, 1
        steps = warmup + timed + profiled
        rows = bench_rows(shape.batch * (steps + 1), answer_tokens=shape.new_tokens)
        if build_on_cpu:
            student, teacher = build_models(shape, tokenizer)
        else:
            student, teacher = self.model(shape.student, 0, tokenizer), self.model(shape.teacher, 1, tokenizer)
        module = ours_module(shape, student, teacher, tokenizer, 1.0, sampler=KVCacheSampler)
        phases: list[dict[str, float]] = []
        check = self

        def timed_call(name: str, fn: Callable) -> Callable:
            @wraps(fn)  # the signature stays visible: the lean path checks forward's parameters (logits_to_keep)
            def call(*args: Any, **kwargs: Any) -> Any:
                check.synchronize()
                start = time.perf_counter()
                result = fn(*args, **kwargs)
                check.synchronize()
                if phases:
                    phases[-1][name] = phases[-1].get(name, 0.0) + time.perf_counter() - start
                return result

            return call

        class Phases(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                check.synchronize()
                self.start = time.perf_counter()
                phases.append({})

            def on_before_backward(self, trainer, pl_module, loss):
                check.synchronize()
                self.backward = time.perf_counter()
                phases[-1]["forward_and_loss_total"] = self.backward - self.start

            def on_after_backward(self, trainer, pl_module):
                check.synchronize()
                self.backward_end = time.perf_counter()
                phases[-1]["backward"] = self.backward_end - self.backward

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                check.synchronize()
                end = time.perf_counter()
                phases[-1]["optimizer_and_logging"] = end - self.backward_end
                phases[-1]["step"] = end - self.start
                if len(phases) == warmup + timed:  # the next step is the profiled one
                    if check.device == "cuda":
                        torch.cuda.set_sync_debug_mode("warn")
                    self.caught = warnings.catch_warnings(record=True)
                    self.records = self.caught.__enter__()
                    warnings.simplefilter("always")
                    self.profile = torch.profiler.profile()
                    self.profile.__enter__()
                elif len(phases) == steps and hasattr(self, "profile"):
                    self.profile.__exit__(None, None, None)
                    if check.device == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
                    self.caught.__exit__(None, None, None)

        trainer = self.lightning_trainer(steps, [Phases()])
        wrapped = {"done": False}

        class Wrap(L.Callback):
            def on_train_start(self, trainer, pl_module):
                if not wrapped["done"]:
                    pl_module.sampler.sample = timed_call("sampling", pl_module.sampler.sample)
                    pl_module.teacher.forward = timed_call("teacher_forward", pl_module.teacher.forward)
                    wrapped["done"] = True

        trainer.callbacks.append(Wrap())
        datamodule = ChatDataModule(tokenizer, rows, batch_size=shape.batch, max_length=shape.max_length)
        trainer.fit(module, datamodule=datamodule)
        means = {
            key: sum(p.get(key, 0.0) for p in phases[warmup : warmup + timed]) / timed
            for key in ("step", "forward_and_loss_total", "sampling", "teacher_forward", "backward")
        }
        means["optimizer_and_logging"] = sum(p["optimizer_and_logging"] for p in phases[warmup : warmup + timed])
        means["optimizer_and_logging"] /= timed
        means["student_forward_and_loss"] = means["forward_and_loss_total"] - means["sampling"]
        means["student_forward_and_loss"] -= means["teacher_forward"]
        out: dict[str, Any] = {"batch": shape.batch, "new_tokens": shape.new_tokens, "mean_s": means}
        out["lean_taken"] = module.lean_path.enabled  # the timing wrappers must not hide forward's signature
        phases_cb = next(c for c in trainer.callbacks if isinstance(c, Phases))
        if hasattr(phases_cb, "profile"):
            sync_sites: dict[str, int] = {}
            for record in phases_cb.records:
                if "synchroniz" in str(record.message):
                    site = f"{Path(record.filename).name}:{record.lineno}"
                    sync_sites[site] = sync_sites.get(site, 0) + 1
            if self.device == "cuda":  # torch.cuda.set_sync_debug_mode reports them
                out["syncs_in_profiled_step"] = sum(sync_sites.values())
                out["sync_sites"] = dict(sorted(sync_sites.items(), key=lambda kv: -kv[1])[:12])
            averages = phases_cb.profile.key_averages()

            def top(attribute: str) -> list[tuple[str, int, float]]:
                ranked = sorted(averages, key=lambda e: -getattr(e, attribute, 0.0))[:15]
                return [(e.key, e.count, round(getattr(e, attribute, 0.0) / 1e3, 2)) for e in ranked]

            out["top_self_device_ms"] = top("self_device_time_total")
            out["top_self_cpu_ms"] = top("self_cpu_time_total")
            out["device_busy_ms"] = round(sum(getattr(e, "self_device_time_total", 0.0) for e in averages) / 1e3, 1)
            out["profiled_step_s"] = phases[-1]["step"]
        del module, student, teacher
        return out

    def fsdp(self) -> dict[str, Any]:
        """GKD (lambda 1) under FSDP2 on one device, in its own process (it starts a process group)."""
        command = [sys.executable, __file__, "--fsdp-worker", "--out", str(self.out), "--steps", str(self.steps)]
        command += ["--dry-run"] if self.dry_run else []
        done = subprocess.run(command, capture_output=True, text=True, env=self.env(), cwd=self.out, timeout=300)
        (self.out / "fsdp.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"the FSDP2 worker exited with {done.returncode}:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def fsdp_worker(self) -> dict[str, Any]:
        from lightning.pytorch.strategies import ModelParallelStrategy

        from lightning_gkd import ChatDataModule
        from lightning_gkd.cli.compose import build_method
        from lightning_gkd.studies.bench_models import bench_rows
        from lightning_gkd.training.optimizers import adamw

        shape, tokenizer = self.shape, self.tokenizer()
        rows = bench_rows(shape.batch * (self.steps + 1), answer_tokens=shape.new_tokens)
        module = build_method(
            ["method=gkd", "method.lmbda=1.0", f"method.sampling.max_new_tokens={shape.new_tokens}"],
            student=self.model(shape.student, 0, tokenizer),
            teacher=self.model(shape.teacher, 1, tokenizer),
            tokenizer=tokenizer,
            optimizer=partial(adamw, lr=1e-5),
        )
        datamodule = ChatDataModule(tokenizer, rows, batch_size=shape.batch, max_length=shape.max_length)
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
        result = self.fit_timed(module, datamodule, strategy)
        from torch.distributed.tensor import DTensor

        weight = module.student.get_input_embeddings().weight
        result["student_sharded"] = isinstance(weight, DTensor)
        if not result["student_sharded"]:
            raise RuntimeError("the student's weights are not DTensors: FSDP2 did not wrap it")
        return result

    def teacher_cache(self) -> dict[str, Any]:
        """``lightning-gkd-cache`` on the toy task's rows with the 1.5B-shaped teacher (random init, saved in bf16 with
        the ChatML tokenizer): top-k log-probs, then bf16 hidden states."""
        import torch

        folder = self.out / "teacher_model"
        tokenizer = self.tokenizer()
        self.model(self.shape.teacher, 1, tokenizer).to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        rows = (32, 16) if self.dry_run else (1024, 128)
        model = [f"model.{key}={folder}" for key in ("tokenizer", "student.name_or_path", "teacher.name_or_path")]
        model += [f"+data.train_data.num_rows={rows[0]}", f"+data.val_data.num_rows={rows[1]}"]
        out: dict[str, Any] = {
            "teacher": f"{self.shape.teacher['num_hidden_layers']} x {self.shape.teacher['hidden_size']}, bf16",
            "rows": sum(rows),
        }
        for name, extra in (("topk", []), ("hidden_bf16", ["cache.signal=hidden", "cache.hidden_dtype=bfloat16"])):
            overrides = [f"trainer={self.trainer}", f"cache.path={self.out}/cache_{name}", *model, *extra]
            stdout, seconds = self.cli("lightning_gkd.cli.cache_teacher", overrides, f"teacher_cache_{name}")
            found = re.search(r"built this run: (\d+) shards, (\d+) tokens in ([\d.]+)s \((\d+) tokens/s\)", stdout)
            if found is None:
                raise RuntimeError("the cache build printed no report:\n" + stdout[-2000:])
            out[name] = {"tokens": int(found[2]), "tokens_per_s": int(found[4]), "wall_s": seconds}
        return out


def run_part(check: Check, name: str) -> dict[str, Any]:
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    record: dict[str, Any]
    try:
        record = {"status": "ok", "results": getattr(check, name)()}
    except Skipped as why:
        record = {"status": "skipped", "note": str(why)}
    except Exception:
        traceback.print_exc()
        record = {"status": "failed", "error": traceback.format_exc()[-4000:]}
    record["seconds"] = time.perf_counter() - start
    print(f"== {name}: {record['status']} in {record['seconds']:.1f} s", flush=True)
    if record["status"] == "ok":
        print(json.dumps(record["results"], indent=1, default=str)[:2000], flush=True)
    return record


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def render(report: dict[str, Any]) -> str:
    """The markdown report: set-up, then one table per part."""
    meta, parts = report["meta"], report["parts"]
    lines = [
        "# GPU check (scripts/device_check.py)",
        "",
        f"Made by `{meta['command']}` on {meta['date']} in {meta['seconds'] / 60:.1f} min: {meta['device']}, "
        f"torch {meta['torch']}, transformers {meta['transformers']}, lightning {meta['lightning']}"
        + (f", trl {meta['trl']}" if meta.get("trl") else "")
        + ".",
        "",
        "| part | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {part['status']} | {part['seconds']:.1f} |" for name, part in parts.items()]
    get = {name: part.get("results", {}) for name, part in parts.items()}
    if get.get("methods"):
        lines += ["", "Training steps (bf16-mixed, random init):", ""]
        lines += ["| method | steps | s / step | peak GPU GiB | last loss |", "|---|---|---|---|---|"]
        for name, row in [*get["methods"].items(), *([("gkd under FSDP2", get["fsdp"])] if get.get("fsdp") else [])]:
            lines.append(
                f"| {name} | {row.get('steps')} | {fmt(row.get('s_per_step'))} | {fmt(row.get('peak_gpu_gb'))} | "
                f"{fmt(row.get('loss'), 5)} |"
            )
    if get.get("lean_memory"):
        lean = get["lean_memory"]
        lines += ["", f"GKD loss forward + backward, V={lean['vocab']} x {lean['supervised_tokens']} tokens:", ""]
        lines += ["| loss path | peak GPU GiB | added GiB | seconds | loss |", "|---|---|---|---|---|"]
        for kind in ("full", "lean"):
            row = lean[kind]
            lines.append(
                f"| {kind} | {fmt(row['peak_gpu_gb'])} | {fmt(row['added_gpu_gb'])} | {fmt(row['seconds'])} | "
                f"{fmt(row['loss'], 6)} |"
            )
    if get.get("sampler"):
        lines += [
            "",
            "Decode (the 0.5B-shaped student, ~60-token prompts, sampling at temperature 0.9, bf16 autocast):",
            "",
        ]
        lines += [
            "| batch | new tokens | ours tokens / s | generate tokens / s | ours / generate | ours' decoder | "
            "first call s (ours / generate) | peak GPU GiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for cell in get["sampler"].values():
            ours, hf = cell["ours"], cell["hf_generate"]
            lines.append(
                f"| {cell.get('batch', '')} | {cell.get('new_tokens', '')} | {ours['tokens_per_s']:.0f} | "
                f"{hf['tokens_per_s']:.0f} | {cell['ours_over_generate']:.2f}x | {cell['decoder']} | "
                f"{ours['first_call_s']:.1f} / {hf['first_call_s']:.1f} | {fmt(cell.get('peak_gpu_gb'))} |"
            )
    if get.get("bench_trl"):
        lines += [
            "",
            "On-policy step, ours vs TRL's DistillationTrainer (lambda 1; best of interleaved repetitions):",
            "",
        ]
        lines += [
            "| batch | new tokens | ours s / step | TRL s / step | ours / TRL | ours MFU | TRL MFU | "
            "ours' phases (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for cell in get["bench_trl"]["cells"].values():
            ours, trl = cell["ours"], cell["trl_distill"]
            phases = cell.get("ours_phases_s") or {}
            phase_text = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in phases.items())
            mfu = ["—" if row["mfu"] is None else f"{row['mfu']:.1%}" for row in (ours, trl)]
            lines.append(
                f"| {cell['batch']} | {cell['new_tokens']} | {ours['s_per_step']:.3f} | {trl['s_per_step']:.3f} | "
                f"{cell['ours_over_trl']:.2f}x | {mfu[0]} | {mfu[1]} | {phase_text} |"
            )
    for name in ("step_profile", "step_profile_cpu_built"):
        if get.get(name):
            prof = get[name]
            syncs = prof.get("syncs_in_profiled_step", "—")
            title = f"`{name}`, batch {prof['batch']}, {prof['new_tokens']} sampled tokens, {syncs} host syncs a step"
            lines += ["", f"Where an on-policy step goes ({title}):", ""]
            lines += ["| phase | seconds (mean) |", "|---|---|"]
            lines += [f"| {phase} | {fmt(seconds)} |" for phase, seconds in prof["mean_s"].items()]
    if get.get("teacher_cache"):
        c = get["teacher_cache"]
        lines += ["", f"Teacher cache build ({c['teacher']} teacher, {c['rows']} toy rows):", ""]
        lines += ["| signal | tokens | tokens / s |", "|---|---|---|"]
        lines += [f"| {k} | {c[k]['tokens']} | {c[k]['tokens_per_s']} |" for k in ("topk", "hidden_bf16")]
    for name, part in parts.items():
        if part["status"] != "ok":
            reason = part.get("note") or part["error"].strip().splitlines()[-1]
            lines += ["", f"- `{name}` {part['status']}: {reason}"]
    return "\n".join(lines) + "\n"


def setup() -> None:
    """Install every wheel in device_wheels/ (scripts/device_wheels.sh) without network access or dependency
    resolution (the image's own packages stay), then this checkout, editable, with the image's setuptools."""
    if not WHEELS.is_dir():
        raise SystemExit(f"{WHEELS} is missing: run `bash scripts/device_wheels.sh` where pip can reach an index.")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    subprocess.run([*pip, *sorted(str(wheel) for wheel in WHEELS.glob("*.whl"))], check=True)
    editable = subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)])
    if editable.returncode != 0:  # the parts import the checkout through PYTHONPATH: the console scripts are a nicety
        print(f"pip install -e {ROOT} failed ({editable.returncode}); the parts run from the checkout", flush=True)


def run_again(*, without: str | None = None, with_checkout: bool = False) -> None:
    """Replace this process by the same command (less ``without``): after ``--setup`` installed the wheels, or with
    this checkout on PYTHONPATH (``with_checkout``) where its package is not installed; every part's process
    inherits that environment."""
    env = dict(os.environ)
    if with_checkout:
        if env.get("DEVICE_CHECK_CHECKOUT") == str(ROOT):
            raise SystemExit(f"lightning_gkd cannot be imported from {ROOT}: install it (pip install -e .).")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["DEVICE_CHECK_CHECKOUT"] = str(ROOT)
    argv = [arg for arg in sys.argv if arg != without]
    os.execve(sys.executable, [sys.executable, *argv], env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks the script, not speed")
    parser.add_argument("--setup", action="store_true", help="first install device_wheels/ and this checkout")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "device_check_out"))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per training part (default 4; 2 dry)")
    parser.add_argument("--fsdp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setup:
        setup()
        run_again(without="--setup")  # a fresh interpreter sees what was installed
    if importlib.util.find_spec("lightning_gkd") is None:
        run_again(with_checkout=True)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (2 if args.dry_run else 4)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or use --dry-run to check the script on CPU")
    check = Check(args.dry_run, args.out, steps)
    if args.fsdp_worker:
        print(json.dumps(check.fsdp_worker()))
        return
    started = time.perf_counter()
    import lightning
    import transformers

    trl = importlib.util.find_spec("trl") and __import__("trl").__version__
    device = torch.cuda.get_device_name() if not args.dry_run else f"CPU dry run ({os.cpu_count()} cores)"
    meta = {
        "command": ("python scripts/device_check.py " + " ".join(sys.argv[1:])).strip(),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": 0.0,
        "device": device,
        "dry_run": args.dry_run,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lightning": lightning.__version__,
        "trl": trl or None,
    }
    report: dict[str, Any] = {"meta": meta, "parts": {}}
    for name in args.parts:
        report["parts"][name] = run_part(check, name)
        meta["seconds"] = time.perf_counter() - started
        write_report(report, args.out)  # after each part: a run stopped at a time limit keeps what it measured
    print(render(report))
    print(f"wrote {args.out / 'device_check.json'} and device_check.md")


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "device_check.md").write_text(render(report))


if __name__ == "__main__":
    main()
