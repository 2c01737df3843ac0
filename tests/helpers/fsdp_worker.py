"""Two-process FSDP2 run on CPU (gloo) for tests/models/test_sharding.py; writes its measurements to <out>/result.json.

    python tests/helpers/fsdp_worker.py <out_dir> [file|distributed]

Lightning's ModelParallelStrategy starts rank 1 by re-running this script; everything below runs on both ranks.
1. GKD (lambda = 1: the sharded student samples every batch) for STEPS steps with a small gradient_clip_val, saving
   checkpoints (one file, or Lightning's distributed folder); every batch trained on, each rank's loss and the
   gradient norms before and after clipping are recorded. Then the student is exported (full state dict gathered
   at fit end, written by rank 0).
2. A second fit resumes from last.ckpt for one more step.
3. Rank 0 replays both runs unsharded in one process (same weights, same recorded batches, same AdamW, the same
   clipping on the mean of the per-rank losses) and the results are compared: losses per step, final logits, the
   export reloaded with from_pretrained.
4. Standalone check for the memory-lean loss: decoder hidden state captured by a hook after the root forward,
   multiplied by get_output_embeddings().weight inside torch.utils.checkpoint; gradients vs unsharded.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from helpers.fitting import small_trainer  # tests/ is on PYTHONPATH (tests/models/test_sharding.py)
from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.ops.decoding.sampling import generate_completions
from lightning_gkd.teachers.base import supervised_positions
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

STEPS, CLIP, LR, BATCH, NEW_TOKENS = 3, 0.05, 1e-2, 2, 6
KEYS = ("input_ids", "attention_mask", "labels")


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_norm(params: list[torch.Tensor]) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    return float(full(torch.nn.utils.get_total_norm(grads)))


class Recorded(GKDModule):
    """GKDModule that records the batches it trains on, its losses and the gradient norms around clipping."""

    def __init__(self, *args, **kwargs) -> None:
        # a float32 teacher: the equalities compare batch splits, and bf16 products' rounding depends on the split
        kwargs["training"] = {"frozen_dtype": "float32", **(kwargs.get("training") or {})}
        super().__init__(*args, **kwargs)
        self.trained: list[dict] = []
        self.clipping: list[tuple[float, float]] = []

    def distillation_loss(self, batch):
        out = super().distillation_loss(batch)
        if self._trainer is not None and self.trainer.training:
            self.trained.append(
                {"step": self.global_step, "loss": out.loss.item(), **{k: batch[k].detach().cpu() for k in KEYS}}
            )
        return out

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        before = grad_norm(params)
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clipping.append((before, grad_norm(params)))


def make_module(tokenizer) -> Recorded:
    return Recorded(
        tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
        tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1),
        tokenizer,
        lmbda=1.0,
        sampling={"max_new_tokens": NEW_TOKENS},
        divergence={"beta": 0.5},
        training={"optimizer": partial(torch.optim.AdamW, lr=LR), "seed": 3},
    )


def make_trainer(out: Path, max_steps: int, distributed_ckpt: bool) -> L.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed_ckpt
    )
    return small_trainer(
        out,
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        gradient_clip_val=CLIP,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)],
    )


def gather(obj):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def shard_report(model: torch.nn.Module) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    params = list(model.parameters())
    return {
        "all_dtensor": all(isinstance(p, DTensor) for p in params),
        "all_shard0": all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params),
        "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
        "full_numel": sum(p.numel() for p in params),
    }


def lean_head_check(tokenizer) -> dict:
    """Root forward with logits_to_keep=1, the decoder's last hidden state from a hook, logits from
    get_output_embeddings().weight inside torch.utils.checkpoint: loss and gradients vs an unsharded copy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_gkd.models.loading import freeze
    from lightning_gkd.models.sharding import shard_causal_lm

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded, plain = (tiny_causal_lm(TINY_STUDENT, tokenizer, seed=5) for _ in range(2))
    shard_causal_lm(sharded, mesh)
    torch.manual_seed(11 + dist.get_rank())  # different data on each rank, as in training
    ids = torch.randint(0, len(tokenizer), (2, 9))
    labels = torch.randint(0, len(tokenizer), (2, 9))

    def lean_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, str]:
        captured = {}
        hook = model.get_decoder().register_forward_hook(
            lambda module, args, output: captured.__setitem__("hidden", output.last_hidden_state)
        )
        try:
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        finally:
            hook.remove()
        weight = model.get_output_embeddings().weight
        kind = type(weight).__name__
        hidden = captured["hidden"]
        total = hidden.new_zeros(())
        for chunk, chunk_labels in zip(hidden.split(4, dim=1), labels.split(4, dim=1), strict=True):

            def piece(h, w, y=chunk_labels):
                return torch.nn.functional.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(), reduction="sum")

            total = total + torch.utils.checkpoint.checkpoint(piece, chunk, weight, use_reentrant=False)
        return total / labels.numel(), kind

    loss, head_kind = lean_loss(sharded, ids)
    loss.backward()
    # Reference: the mean over ranks of the same loss on an unsharded model (what FSDP's gradient averages).
    all_ids = gather(ids)
    all_labels = gather(labels)
    ref_losses = []
    for rank_ids, rank_labels in zip(all_ids, all_labels, strict=True):
        logits = plain(input_ids=rank_ids, use_cache=False).logits
        ref_losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), rank_labels.flatten()))
    torch.stack(ref_losses).mean().backward()
    grad_diff = max(
        (full(p.grad) - q.grad).abs().max().item()
        for p, q in zip(sharded.parameters(), plain.parameters(), strict=True)
    )
    # A frozen model (teacher): its root stays gathered after a no-grad forward (plain head weight, usable by the
    # lean loss) until reshard() (CausalLMModule.on_before_backward) frees it.
    from lightning_gkd.models.sharding import reshard

    teacher = freeze(tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1))
    shard_causal_lm(teacher, mesh)
    with torch.no_grad():
        teacher(input_ids=ids, use_cache=False)
    after_forward = type(teacher.get_output_embeddings().weight).__name__
    reshard(teacher)
    after_reshard = teacher.get_output_embeddings().weight
    return {
        "loss_diff": abs(loss.item() - ref_losses[dist.get_rank()].item()),
        "grad_max_abs_diff": grad_diff,
        "student_head_after_forward": head_kind,
        "teacher_head_after_nograd_forward": after_forward,
        "teacher_head_after_reshard_is_dtensor": isinstance(after_reshard, DTensor),
    }


def token_mean(losses: list[torch.Tensor], rows: list[dict]) -> torch.Tensor:
    """The token mean over several batches from their token-mean losses (what one optimizer step trains on)."""
    counts = [supervised_positions(row["labels"]).sum() for row in rows]
    return sum(loss * n for loss, n in zip(losses, counts, strict=True)) / sum(counts)


def replay(tokenizer, trained: list[dict], steps: int) -> tuple[list[float], torch.nn.Module]:
    """The unsharded run: per step, the token mean over both ranks' recorded batches, clipped, AdamW."""
    ref = make_module(tokenizer)
    optimizer = torch.optim.AdamW([p for p in ref.student.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(steps):
        batches = [row for row in trained if row["step"] == step]
        assert len(batches) == 2, (step, len(batches))
        loss = token_mean([ref.distillation_loss({k: row[k] for k in KEYS}).loss for row in batches], batches)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.student.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    return losses, ref.student


def main() -> None:
    out = Path(sys.argv[1])
    distributed_ckpt = len(sys.argv) > 2 and sys.argv[2] == "distributed"
    torch.set_num_threads(1)
    tokenizer = build_chatml_tokenizer()
    data = ChatDataModule(tokenizer, addition_rows("train", 16), batch_size=BATCH, max_length=64, seed=0)
    L.seed_everything(0)

    module = make_module(tokenizer)
    teacher_before = {k: v.clone() for k, v in module.teacher.state_dict().items()}
    trainer = make_trainer(out, STEPS, distributed_ckpt)
    trainer.fit(module, datamodule=data)
    rank = trainer.global_rank
    result: dict = {"world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__}
    result["student_shards"] = gather(shard_report(module.student))
    result["teacher_shards"] = gather(shard_report(module.teacher))
    teacher_after = {k: full(v) for k, v in module.teacher.state_dict().items()}
    result["teacher_max_change"] = max(
        (teacher_after[k] - teacher_before[k]).abs().max().item() for k in teacher_before
    )
    result["teacher_grads"] = sum(p.grad is not None for p in module.teacher.parameters())
    result["teacher_requires_grad"] = sum(p.requires_grad for p in module.teacher.parameters())
    result["teacher_training"] = module.teacher.training
    optimizer = trainer.optimizers[0]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    result["optimizer_params"] = len(optimized)
    result["student_params"] = len(list(module.student.parameters()))
    result["optimizer_has_teacher"] = any(id(p) in optimized for p in module.teacher.parameters())
    result["clipping"] = gather(module.clipping)
    trained = [row for part in gather(module.trained) for row in part]
    result["completion_lengths"] = [int((row["labels"] != -100).sum()) for row in trained]

    # Sampling while sharded: greedy, fixed length (eos None: every rank runs the same number of forwards).
    prompts = next(iter(data.train_dataloader()))
    timing = {}
    for name, model in (("sharded", module.student),):
        start = time.perf_counter()
        generate_completions(
            model,
            prompts["prompts"],
            prompts["prompt_attention_mask"],
            max_new_tokens=16,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,
            do_sample=False,
        )
        timing[name] = time.perf_counter() - start

    probe = torch.randint(0, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        sharded_logits = module.student(input_ids=probe, use_cache=False).logits
    if rank == 0:
        module.export(out / "student")
    dist.barrier()

    # Resume from last.ckpt for one more step.
    resumed = make_module(tokenizer)
    trainer2 = make_trainer(out / "resumed", STEPS + 1, distributed_ckpt)
    trainer2.fit(resumed, datamodule=data, ckpt_path=str(out / "checkpoints" / "last.ckpt"), weights_only=True)
    resumed_rows = [row for part in gather(resumed.trained) for row in part]
    result["resumed_global_step"] = trainer2.global_step
    with torch.no_grad():
        resumed_logits = resumed.student(input_ids=probe, use_cache=False).logits

    result["lean_head"] = gather(lean_head_check(tokenizer))

    if rank == 0:
        from transformers import AutoModelForCausalLM

        def step_loss(rows: list[dict], step: int) -> float:
            mine = [r for r in rows if r["step"] == step]
            return float(token_mean([torch.tensor(r["loss"]) for r in mine], mine))

        sharded_losses = [step_loss(trained, s) for s in range(STEPS)] + [step_loss(resumed_rows, STEPS)]
        ref_losses, ref_student = replay(tokenizer, trained + resumed_rows, STEPS + 1)
        result["sharded_losses"], result["reference_losses"] = sharded_losses, ref_losses
        ref3, ref_student3 = replay(tokenizer, trained, STEPS)
        with torch.no_grad():
            result["logits_vs_reference"] = (sharded_logits - ref_student3(input_ids=probe).logits).abs().max().item()
            result["resumed_logits_vs_reference"] = (
                (resumed_logits - ref_student(input_ids=probe).logits).abs().max().item()
            )
            exported = AutoModelForCausalLM.from_pretrained(out / "student")
            result["export_logits_vs_sharded"] = (exported(input_ids=probe).logits - sharded_logits).abs().max().item()
        result["export_files"] = sorted(p.name for p in (out / "student").iterdir())
        start = time.perf_counter()
        generate_completions(
            ref_student3.eval(),
            prompts["prompts"],
            prompts["prompt_attention_mask"],
            max_new_tokens=16,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,
            do_sample=False,
        )
        timing["unsharded"] = time.perf_counter() - start
        result["sampling_seconds_16_tokens"] = timing
        last = out / "checkpoints" / "last.ckpt"
        result["checkpoint_is_dir"] = last.is_dir()
        if last.is_dir():
            from torch.distributed.checkpoint import FileSystemReader

            keys = list(FileSystemReader(str(last)).read_metadata().state_dict_metadata)
        else:
            keys = [f"state_dict.{k}" for k in torch.load(last, weights_only=True)["state_dict"]]
        result["checkpoint_keys"] = keys
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
