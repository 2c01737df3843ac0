"""The side-by-side bench's measurements, each in a fresh process (its peak memory its own): one GKD optimizer step
timed for one configuration (ours through the Python API, through the ``lightning-gkd`` command, or TRL's
GKDTrainer / DistillationTrainer on the same models and rows), where one on-policy step of ours goes, a floor for it
from rates measured on the machine, and our decoder's profile. scripts/bench.py and scripts/device_check.py run them
through ``measure``:

    python -m lightning_gkd.cli.bench_worker --shape small [--tiny] [--device cpu|cuda] <measurement> <lmbda> \\
        <warmup> <steps>

``<measurement>``: a configuration (``CONFIGS``), ``floor``, ``decode`` or ``breakdown:<ours|ours_vllm>[:<levers
joined by +>|:none]``. It prints the result as JSON on its last line. TRL's trainers need ``trl`` (the ``dev``
extra); the vLLM configurations need vLLM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_gkd.studies.bench_models import BenchShape, bench_rows, bench_shape, build_models
from lightning_gkd.studies.process_memory import children_peak_rss_mb, peak_rss_mb, process_start
from lightning_gkd.studies.step_timing import StepEnds, plain_trainer

#: This process's start on the perf_counter clock: "to step 1" counts from here (interpreter start included).
PROCESS_START = process_start()
CONFIGS = (
    "trl",
    "trl_no_gc",
    "ours",
    "ours_fp32",
    "ours_cli",
    "ours_k4",
    "ours_mm_medium",
    "ours_bf16_sampling",
    "trl_distill",
    "trl_distill_vllm",
    "ours_vllm",
    "ours_vllm_k4",
)
#: Our default speed levers, each switchable in the breakdown; "student_medium" (the student's training matmuls at
#: precision 'medium') and "bf16_sampling" (a bf16 sampling copy) are opt-in ones.
LEVERS = ("fused_adamw", "bf16_teacher", "sampler_medium", "tied_rows")


def ours_module(
    shape: BenchShape,
    student: Any,
    teacher: Any,
    tokenizer: Any,
    lmbda: float,
    *,
    frozen_dtype: str = "auto",
    **objects: Any,
) -> Any:
    """GKDModule on the bench's settings (beta 0.5, sampling at temperature 0.9, the shape's new tokens, seed 0, our
    fused AdamW at lr 1e-5, the teacher in ``frozen_dtype``), built from conf/method/gkd.yaml like every method the
    scripts build."""
    from lightning_gkd.cli.compose import build_method
    from lightning_gkd.training.optimizers import adamw

    settings = [f"method.lmbda={lmbda}", "method.divergence.beta=0.5", "method.sampling.temperature=0.9"]
    settings += [f"method.sampling.max_new_tokens={shape.new_tokens}", "seed=0"]
    settings += [f"method.training.frozen_dtype={frozen_dtype}"]
    objects.setdefault("optimizer", partial(adamw, lr=1e-5))  # our default: fused where torch can
    return build_method(["method=gkd", *settings], student=student, teacher=teacher, tokenizer=tokenizer, **objects)


def time_steps(config: str, lmbda: float, warmup: int, steps: int, shape: BenchShape, device: str) -> dict[str, Any]:
    """Seconds per optimizer step of ``config`` after ``warmup`` steps, averaged over ``steps`` (whole generation
    groups), the peak and the pre-training resident memory, and the seconds to step 1 and to built models."""
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer

    torch.manual_seed(0)
    tokenizer = build_chatml_tokenizer()
    answer = shape.supervised_answer if lmbda == 0 else shape.new_tokens
    rows = bench_rows(shape.batch * (warmup + steps) * 2, answer_tokens=answer)
    if config == "ours_cli":
        return cli_steps(shape, tokenizer, rows, lmbda, warmup, steps, device)
    student, teacher = build_models(shape, tokenizer)
    models_ready = time.perf_counter()
    baseline = peak_rss_mb()
    step_ends = StepEnds()
    ends = step_ends.ends
    module = None
    if config in ("trl", "trl_no_gc"):
        group = gkd_trainer(config, student, teacher, tokenizer, rows, lmbda, warmup + steps, ends, shape, device)
    elif config.startswith("trl_distill"):
        group = distillation_trainer(config, student, teacher, tokenizer, rows, warmup + steps, ends, shape, device)
    else:
        from lightning_gkd import ChatDataModule
        from lightning_gkd.samplers import KVCacheSampler, VLLMSampler

        group = 4 if config.endswith("_k4") else 1
        if config == "ours_mm_medium":  # the opt-in student recipe: every float32 matmul with bf16 products
            torch.set_float32_matmul_precision("medium")
        sampler: Callable[..., Any] = (
            VLLMSampler
            if "vllm" in config
            else partial(KVCacheSampler, weights_dtype="bfloat16" if config == "ours_bf16_sampling" else None)
        )
        frozen_dtype = "float32" if config == "ours_fp32" else "auto"  # auto: the default
        module = ours_module(shape, student, teacher, tokenizer, lmbda, sampler=sampler, frozen_dtype=frozen_dtype)
        datamodule = ChatDataModule(
            tokenizer, rows, batch_size=shape.batch, max_length=shape.max_length, steps_per_generation=group
        )
        accelerator, precision = ("gpu", "bf16-mixed") if device == "cuda" else ("cpu", "32-true")
        trainer = plain_trainer(warmup + steps, accelerator=accelerator, precision=precision, callbacks=[step_ends])
        trainer.fit(module, datamodule=datamodule)
    timed = [b - a for a, b in itertools.pairwise(ends[warmup - 1 :])]
    sampler_used = getattr(module, "sampler", None)
    return {
        "engine": dict(getattr(sampler_used, "seconds", {})) | {"syncs": getattr(sampler_used, "syncs", 0)},
        "seconds_per_step": sum(timed) / len(timed),
        "steps": len(timed),
        "group": group,
        "peak_rss_mb": peak_rss_mb(),
        "baseline_rss_mb": baseline,
        "first_step_seconds": ends[0] - PROCESS_START,
        "models_seconds": models_ready - PROCESS_START,
    }


class StepEndsFile(L.Callback):
    """What ``ours_cli`` adds to the ``lightning-gkd`` command (a Hydra override): the peak RSS when training starts,
    then each optimizer step's end (wall clock), appended to the .jsonl file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.path.write_text(json.dumps({"baseline_rss_mb": peak_rss_mb()}) + "\n")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"end": time.time()}) + "\n")


def cli_steps(
    shape: BenchShape, tokenizer: Any, rows: list[dict], lmbda: float, warmup: int, steps: int, device: str
) -> dict[str, Any]:
    """``ours_cli``: the same models saved to folders (float32, as built) and the rows to a .jsonl file, then the
    ``lightning-gkd`` command on them in a child process with the same settings as ``ours`` (no logger, callbacks,
    scheduler, validation or export, which the Python API rows do not have either). Its peak RSS is the child's;
    "to step 1" counts from the command's start (loading both models from their folders included)."""
    with tempfile.TemporaryDirectory() as folder:
        student, teacher = build_models(shape, tokenizer)
        student.save_pretrained(f"{folder}/student")
        tokenizer.save_pretrained(f"{folder}/student")
        teacher.save_pretrained(f"{folder}/teacher")
        del student, teacher
        with open(f"{folder}/train.jsonl", "w") as file:
            file.writelines(json.dumps({"messages": row["messages"]}) + "\n" for row in rows)
        probe = f"{folder}/steps.jsonl"
        overrides = [
            "model=hub",
            f"model.student.name_or_path={folder}/student",
            f"model.teacher.name_or_path={folder}/teacher",
            "data=chat_files",
            f"data.train_data={folder}/train.jsonl",
            f"data.batch_size={shape.batch}",
            f"data.max_length={shape.max_length}",
            f"method.lmbda={lmbda:g}",
            "method.divergence.beta=0.5",
            "method.sampling.temperature=0.9",
            f"method.sampling.max_new_tokens={shape.new_tokens}",
            "optimizer.lr=1e-5",
            "~scheduler",
            "callbacks=none",
            "logger=none",
            f"trainer.max_steps={warmup + steps}",
            "trainer.gradient_clip_val=1.0",
            "trainer.limit_val_batches=0",
            f"trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}",
            f"trainer.precision={'bf16-mixed' if device == 'cuda' else '32-true'}",
            "+trainer.enable_checkpointing=false",
            "+trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "export=false",
            "print_config=false",
            "seed=0",
            f"paths.output_dir={folder}/run",
            "hydra.run.dir=" + f"{folder}/run",
            "+callbacks.step_ends._target_=lightning_gkd.cli.bench_worker.StepEndsFile",  # (here __main__)
            f"+callbacks.step_ends.path={probe}",
        ]
        command = [sys.executable, "-m", "lightning_gkd.cli.train", *overrides]
        started = time.time()
        done = subprocess.run(command, capture_output=True, text=True, cwd=folder)
        if done.returncode != 0:
            raise RuntimeError(f"lightning-gkd failed:\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in Path(probe).read_text().splitlines()]
    ends = [r["end"] for r in records if "end" in r]
    timed = [b - a for a, b in itertools.pairwise(ends[warmup - 1 :])]
    return {
        "engine": {},
        "seconds_per_step": sum(timed) / len(timed),
        "steps": len(timed),
        "group": 1,
        "peak_rss_mb": children_peak_rss_mb(),
        "baseline_rss_mb": records[0]["baseline_rss_mb"],
        "first_step_seconds": ends[0] - started,
        "models_seconds": None,
    }


def trl_arguments(max_steps: int, shape: BenchShape, device: str) -> dict[str, Any]:
    """The TrainingArguments both TRL trainers get here: the shared shapes and optimizer, CPU fp32 (bf16 mixed
    precision on a GPU), no logging."""
    return {
        "per_device_train_batch_size": shape.batch,
        "max_steps": max_steps,
        "beta": 0.5,
        "temperature": 0.9,
        "learning_rate": 1e-5,
        "max_grad_norm": 1.0,
        "logging_steps": 10**6,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": device == "cpu",
        "bf16": device == "cuda",
        "fp16": False,
        "seed": 0,
        "dataloader_num_workers": 0,
    }


def _trl_step_ends(ends: list[float]) -> Any:
    import transformers

    class StepEnds(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    return StepEnds()


def gkd_trainer(
    config: str,
    student: Any,
    teacher: Any,
    tokenizer: Any,
    rows: list[dict],
    lmbda: float,
    max_steps: int,
    ends: list[float],
    shape: BenchShape,
    device: str,
) -> int:
    """TRL's GKDTrainer on the same models and rows (collated by our ChatML collator), gradient checkpointing on
    (``trl``, its default) or off (``trl_no_gc``). Returns its generation group (1)."""
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from lightning_gkd.data.chat import ChatMLCollator

    with tempfile.TemporaryDirectory() as out:
        args = GKDConfig(
            output_dir=out,
            **trl_arguments(max_steps, shape, device),
            lmbda=lmbda,
            max_new_tokens=shape.new_tokens,
            max_length=shape.max_length,
            gradient_checkpointing=(config == "trl"),
        )
        GKDTrainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            data_collator=ChatMLCollator(tokenizer, shape.max_length),
            callbacks=[_trl_step_ends(ends)],
        ).train()
    return 1


def distillation_trainer(
    config: str,
    student: Any,
    teacher: Any,
    tokenizer: Any,
    rows: list[dict],
    max_steps: int,
    ends: list[float],
    shape: BenchShape,
    device: str,
) -> int:
    """TRL's DistillationTrainer (always on-policy) on the same models and prompts; its defaults but bf16 (off on
    CPU) and the shared shape settings. Returns its generation group (1)."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    if "vllm" in config:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    prompts = [{"prompt": row["messages"][:-1]} for row in rows]
    with tempfile.TemporaryDirectory() as out:
        student.save_pretrained(f"{out}/student")  # vLLM colocate starts from a folder
        tokenizer.save_pretrained(f"{out}/student")
        args = DistillationConfig(
            output_dir=out,
            **trl_arguments(max_steps, shape, device),
            max_completion_length=shape.new_tokens,
            use_vllm="vllm" in config,
            vllm_gpu_memory_utilization=0.3,
            vllm_max_model_length=shape.max_length + shape.new_tokens,
        )
        DistillationTrainer(
            model=f"{out}/student" if "vllm" in config else student,
            teacher_model=teacher,
            args=args,
            train_dataset=Dataset.from_list(prompts),
            processing_class=tokenizer,
            callbacks=[_trl_step_ends(ends)],
        ).train()
    return 1


def frozen_dtype_default(device: str) -> str:
    """What ``frozen_dtype="auto"`` gives a teacher loaded from a folder or the hub on this machine."""
    from lightning_gkd.models.precision import bf16_matmul_is_fast

    return "bfloat16" if bf16_matmul_is_fast(device) else "float32"


def breakdown(
    shape: BenchShape, device: str, config: str = "ours", batches: int = 3, levers: frozenset[str] = frozenset(LEVERS)
) -> dict[str, float]:
    """Where one on-policy step of ours goes (``config`` ours: KV-cache sampler; ours_vllm: VLLMSampler): sampling,
    weight sync, teacher forward, student forward + chunked JSD, backward and optimizer step, timed separately
    (median over ``batches`` batches after one warm-up), with the given ``levers`` on. The teacher forward is timed
    on its own, then subtracted from the loss forward, which runs it again."""
    from lightning_gkd import ChatDataModule
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.ops.constants import IGNORE_INDEX
    from lightning_gkd.ops.hf.forward import float32_matmul_precision
    from lightning_gkd.samplers import KVCacheSampler, VLLMSampler
    from lightning_gkd.training.optimizers import adamw

    torch.manual_seed(0)
    tokenizer = build_chatml_tokenizer()
    student, teacher = build_models(shape, tokenizer)
    if "bf16_teacher" in levers and frozen_dtype_default(device) == "bfloat16":
        torch.nn.Module.to(teacher, torch.bfloat16)  # in place, as any module's .to
    precision = "medium" if "sampler_medium" in levers else "highest"
    weights_dtype = "bfloat16" if "bf16_sampling" in levers else None
    sampler: Callable[..., Any] = (
        VLLMSampler
        if config == "ours_vllm"
        else partial(KVCacheSampler, matmul_precision=precision, weights_dtype=weights_dtype)
    )
    module = ours_module(shape, student, teacher, tokenizer, 1.0, sampler=sampler)
    if "tied_rows" not in levers:  # the module makes the tied embedding's gradient the rows looked up; undo it
        student.get_input_embeddings().__class__ = torch.nn.Embedding
    module.sampler.start({"student": student}, max_model_len=shape.max_length + shape.new_tokens)
    rows = bench_rows(shape.batch * (batches + 1), answer_tokens=shape.new_tokens)
    datamodule = ChatDataModule(tokenizer, rows, batch_size=shape.batch, max_length=shape.max_length)
    datamodule.setup("fit")
    if "fused_adamw" in levers:
        optimizer = adamw(student.parameters(), lr=1e-5)
    else:
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5, foreach=False)
    training_precision = "medium" if "student_medium" in levers else None
    names = ["sample", "sync", "teacher forward", "student forward + loss", "backward", "optimizer"]
    parts: dict[str, list[float]] = {name: [] for name in names}
    for index, batch in enumerate(datamodule.train_dataloader()):
        synced_before = getattr(module.sampler, "seconds", {}).get("sync", 0.0)
        start = time.perf_counter()
        sampled = module.sample_batch(student, batch, seed=index)
        sample = time.perf_counter() - start
        sync = getattr(module.sampler, "seconds", {}).get("sync", 0.0) - synced_before
        positions = torch.nn.functional.pad(sampled["labels"][:, 1:] != IGNORE_INDEX, (0, 1), value=False)
        start = time.perf_counter()
        with torch.no_grad():
            module.teacher_source.hidden_states(sampled, positions)
        teacher_forward = time.perf_counter() - start
        with float32_matmul_precision(training_precision):
            start = time.perf_counter()
            loss = module.distillation_loss(sampled).loss
            loss_forward = time.perf_counter() - start
            start = time.perf_counter()
            loss.backward()
            backward = time.perf_counter() - start
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        step = time.perf_counter() - start
        if hasattr(module.sampler, "weights_updated"):
            module.sampler.weights_updated()
        if index:
            values = [sample - sync, sync, teacher_forward, loss_forward - teacher_forward, backward, step]
            for name, value in zip(names, values, strict=True):
                parts[name].append(value)
        if index == batches:
            break
    if hasattr(module.sampler, "close"):
        module.sampler.close()
    return {name: statistics.median(values) for name, values in parts.items()}


def floor(shape: BenchShape, device: str) -> dict[str, Any]:
    """A floor for one on-policy step (lmbda 1) of ours at these shapes, from the shapes and rates measured here:

    * sampling: the prefill's products at the float32 rate, then one read of the student's float32 weights per new
      token at the copy bandwidth (decoding a small batch is bound by that read);
    * teacher forward: 2 x (its non-embedding parameters) x (tokens) plus the head at the supervised positions, at
      the bf16 rate (or float32, as the teacher runs);
    * student forward + backward: 3 x the same count for the student, at the float32 rate;
    * optimizer: AdamW reads weights, gradients and both moments and writes weights and moments (28 bytes a
      parameter) at the copy bandwidth.

    Rates: a (tokens x hidden) @ (hidden x intermediate) product of each model's own shape, and a 256 MB copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_gkd import ChatDataModule
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.ops.hf.forward import float32_matmul_precision

    tokenizer = build_chatml_tokenizer()
    rows = bench_rows(shape.batch, answer_tokens=shape.new_tokens)
    datamodule = ChatDataModule(tokenizer, rows, batch_size=shape.batch, max_length=shape.max_length)
    datamodule.setup("fit")
    prompt = next(iter(datamodule.train_dataloader()))["prompts"].shape[1]
    tokens, supervised = shape.batch * (prompt + shape.new_tokens), shape.batch * shape.new_tokens

    def counts(sizes: dict[str, int]) -> tuple[int, int]:
        config = AutoConfig.for_model("qwen2", vocab_size=shape.vocab, tie_word_embeddings=True, **sizes)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in model.parameters())
        return total, total - shape.vocab * sizes["hidden_size"]

    def seconds_per_call(fn: Callable[[], Any], repeat: int = 7) -> float:  # the fastest call: the best rate seen
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def matmul_rate(sizes: dict[str, int], dtype: torch.dtype) -> float:
        a = torch.randn(tokens, sizes["hidden_size"], dtype=dtype)
        w = torch.randn(sizes["intermediate_size"], sizes["hidden_size"], dtype=dtype)
        return 2 * a.shape[0] * w.shape[0] * w.shape[1] / seconds_per_call(lambda: torch.nn.functional.linear(a, w))

    source = torch.randn(64 * 2**20)
    target = torch.empty_like(source)
    copy_rate = 2 * source.numel() * 4 / seconds_per_call(lambda: target.copy_(source))  # bytes read + written
    student_total, student_layers = counts(shape.student)
    teacher_total, teacher_layers = counts(shape.teacher)
    teacher_dtype = getattr(torch, frozen_dtype_default(device))
    rates = {
        "float32 GFLOP/s (student shape)": matmul_rate(shape.student, torch.float32) / 1e9,
        "bf16 GFLOP/s (teacher shape)": matmul_rate(shape.teacher, torch.bfloat16) / 1e9,
        "float32 GFLOP/s (teacher shape)": matmul_rate(shape.teacher, torch.float32) / 1e9,
        "copy GB/s": copy_rate / 1e9,
    }
    torch.set_float32_matmul_precision("medium")
    rates["float32 'medium' GFLOP/s (student shape)"] = matmul_rate(shape.student, torch.float32) / 1e9
    torch.set_float32_matmul_precision("highest")
    # how exact each arithmetic is here: max |error| against float64 of one student-shaped product
    hidden, intermediate = shape.student["hidden_size"], shape.student["intermediate_size"]
    a = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0))
    w = torch.randn(intermediate, hidden, generator=torch.Generator().manual_seed(1))
    exact = torch.nn.functional.linear(a.double(), w.double())
    errors = {"highest": (torch.nn.functional.linear(a, w).double() - exact).abs().max().item()}
    with float32_matmul_precision("medium"):
        errors["medium"] = (torch.nn.functional.linear(a, w).double() - exact).abs().max().item()
    errors["bfloat16"] = (torch.nn.functional.linear(a.bfloat16(), w.bfloat16()).double() - exact).abs().max().item()
    errors["largest |value|"] = exact.abs().max().item()
    fp32, copy = rates["float32 GFLOP/s (student shape)"] * 1e9, rates["copy GB/s"] * 1e9
    teacher_rate = rates[
        "bf16 GFLOP/s (teacher shape)" if teacher_dtype == torch.bfloat16 else "float32 GFLOP/s (teacher shape)"
    ]
    student_flops = 2 * student_layers * tokens + 2 * shape.vocab * hidden * supervised
    parts = {
        "sample": 2 * student_layers * shape.batch * prompt / fp32 + shape.new_tokens * 4 * student_total / copy,
        "teacher forward": (2 * teacher_layers * tokens + 2 * shape.vocab * shape.teacher["hidden_size"] * supervised)
        / (teacher_rate * 1e9),
        "student forward + backward": 3 * student_flops / fp32,
        "optimizer": 28 * student_total / copy,
    }
    return {
        "parts": parts,
        "rates": rates,
        "errors": errors,
        "shapes": {
            "prompt tokens": prompt,
            "tokens": tokens,
            "supervised": supervised,
            "student parameters": student_total,
            "teacher parameters": teacher_total,
            "teacher dtype": str(teacher_dtype),
        },
    }


def _decode_step(model: Any, token: torch.Tensor, mask: torch.Tensor, cache: Any, i: int) -> None:
    """One KV-cache forward of one token per row at position 60 + i (60-token prompts)."""
    from lightning_gkd.ops.hf.forward import cache_keyword

    model(
        input_ids=token,
        attention_mask=mask[:, : 61 + i],
        position_ids=torch.full((token.shape[0], 1), 60 + i),
        **{cache_keyword(model): cache},
        use_cache=True,
    )


def decode_profile(shape: BenchShape, tokens: int = 12) -> dict[str, dict[str, float]]:
    """Our KV-cache decode step at these shapes, per float32 matmul precision and batch (the shape's, and 4 x it as
    with steps_per_generation 4): milliseconds a token, the weight-read rate that implies (float32 student bytes /
    step time), and the share of the step in matrix products and in attention (torch.profiler)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.ops.decoding.kv_decoders import returned_cache
    from lightning_gkd.ops.hf.forward import float32_matmul_precision
    from lightning_gkd.samplers import KVCacheSampler

    tokenizer = build_chatml_tokenizer()
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=shape.vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        **shape.student,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    weight_bytes = 4 * sum(p.numel() for p in model.parameters())
    bf16_copy = KVCacheSampler(tokenizer, weights_dtype="bfloat16").sampling_model(model)
    out: dict[str, dict[str, float]] = {}
    for precision in ("highest", "medium", "bf16 weights"):
        decoder = bf16_copy if precision == "bf16 weights" else model
        for batch in (shape.batch, 4 * shape.batch):
            prompts = torch.randint(3, len(tokenizer), (batch, 60))
            mask = torch.ones(batch, 60 + tokens + 4, dtype=torch.long)
            with torch.no_grad(), float32_matmul_precision("medium" if precision == "medium" else "highest"):
                cache = returned_cache(
                    decoder(input_ids=prompts, attention_mask=mask[:, :60], use_cache=True, logits_to_keep=1)
                )
                step = partial(_decode_step, decoder, prompts[:, -1:], mask, cache)
                step(0)
                start = time.perf_counter()
                for i in range(1, tokens):
                    step(i)
                seconds = (time.perf_counter() - start) / (tokens - 1)
                with torch.profiler.profile() as profile:
                    for i in range(tokens, tokens + 3):
                        step(i)
            events = {e.key: e.self_cpu_time_total for e in profile.key_averages()}
            total = sum(events.values())
            matmul = sum(v for k, v in events.items() if k in ("aten::mm", "aten::addmm", "aten::bmm"))
            attention = sum(v for k, v in events.items() if "scaled_dot_product" in k)
            out[f"{precision}@{batch}"] = {
                "ms per token": seconds * 1e3,
                "weight GB/s": weight_bytes / (2 if decoder is bf16_copy else 1) / seconds / 1e9,
                "matmul share": matmul / total,
                "attention share": attention / total,
            }
    return out


def with_cell(shape: BenchShape, batch: int | None, new_tokens: int | None) -> BenchShape:
    """``shape`` with its batch and sampled tokens replaced where given; ``max_length`` grown to hold the prompt and
    the longer samples."""
    if batch is not None:
        shape = replace(shape, batch=batch)
    if new_tokens is not None:
        shape = replace(shape, new_tokens=new_tokens, max_length=max(shape.max_length, 128 + new_tokens))
    return shape


def measurement(name: str, lmbda: float, warmup: int, steps: int, shape: BenchShape, device: str) -> Any:
    """The result of one measurement (see the module docstring), in this process."""
    if name == "floor":
        return floor(shape, device)
    if name == "decode":
        return decode_profile(shape)
    if name.startswith("breakdown"):  # breakdown:<config>[:<lever>+<lever>...|:none]
        _, config, *chosen = name.split(":")
        levers = frozenset(LEVERS) if not chosen else frozenset(chosen[0].split("+")) - {"none"}
        return breakdown(shape, device, config, levers=levers)
    if name not in CONFIGS:
        raise ValueError(f"Unknown bench measurement {name!r}: a configuration {CONFIGS}, floor, decode or breakdown.")
    return time_steps(name, lmbda, warmup, steps, shape, device)


def measure(
    name: str,
    lmbda: float,
    warmup: int,
    steps: int,
    *,
    shape: str,
    tiny: bool = False,
    device: str = "cpu",
    batch: int | None = None,
    new_tokens: int | None = None,
) -> Any:
    """``measurement`` in a fresh Python process (its peak memory its own), at ``shape`` with its ``batch`` and
    ``new_tokens`` replaced when given; ``RuntimeError`` with the end of its error output when it fails
    (``Killed:`` when the kernel killed it, usually for memory)."""
    command = [sys.executable, "-m", "lightning_gkd.cli.bench_worker", "--shape", shape, "--device", device]
    command += ["--tiny"] if tiny else []
    command += [] if batch is None else ["--batch", str(batch)]
    command += [] if new_tokens is None else ["--new-tokens", str(new_tokens)]
    done = subprocess.run([*command, name, str(lmbda), str(warmup), str(steps)], capture_output=True, text=True)
    if done.returncode in (-9, 137):  # SIGKILL: on Linux usually the kernel's out-of-memory killer
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        raise RuntimeError(f"Killed: SIGKILL (out of memory? the machine has {total:.0f} GB; see dmesg)")
    if done.returncode != 0:
        raise RuntimeError(f"{name} lmbda={lmbda} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["small", "real"], default="small")
    parser.add_argument("--tiny", action="store_true", help="toy model sizes (checks a script, not speed)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bf16-mixed on one GPU")
    parser.add_argument("--batch", type=int, help="the shape's batch replaced (a cell of a grid)")
    parser.add_argument("--new-tokens", type=int, help="the shape's sampled tokens replaced (a cell of a grid)")
    parser.add_argument("measurement")
    parser.add_argument("lmbda", type=float)
    parser.add_argument("warmup", type=int)
    parser.add_argument("steps", type=int)
    args = parser.parse_args(argv)
    shape = with_cell(bench_shape(args.shape, tiny=args.tiny), args.batch, args.new_tokens)
    result = measurement(args.measurement, args.lmbda, args.warmup, args.steps, shape, args.device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
