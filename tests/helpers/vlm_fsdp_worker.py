"""Two-process FSDP2 run on CPU (gloo) with a vision-language student, for tests/methods/test_gkd_vision.py; rank 0
writes the measurements to <out>/result.json.

    python tests/helpers/vlm_fsdp_worker.py <out_dir>

Lightning's ModelParallelStrategy starts rank 1 by re-running this script; everything below runs on both ranks. GKD
with a tiny llava student (seed 0) and teacher (seed 1), both sharded by ``CausalLMModule.configure_model`` (one FSDP
unit per decoder layer, the vision tower and projector in the root unit), on toy shape rows, SGD, float32 teacher,
``STEPS`` steps of ``BATCH`` rows per rank, for λ = 0 (``dataset``) and λ = 1 (``on_policy``: the sharded student
samples with the images). Each rank records the batches it trained on (their images included) and its losses; rank 0
replays them in one unsharded process (per step, the token mean over both ranks' batches) and compares the losses and
the trained weights (gathered with ``full_state_dict``).
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.models.sharding import full_state_dict
from lightning_gkd.teachers.base import supervised_positions
from lightning_gkd.toy.shapes import shape_rows
from lightning_gkd.toy.tiny_vlm import tiny_vlm
from tests.helpers.fitting import small_trainer  # the repository is on PYTHONPATH (helpers.launch.clean_env)

LR, STEPS, BATCH, SEED = 1.0, 2, 2, 0
KEYS = ("input_ids", "attention_mask", "labels")


def detached(batch: dict) -> dict:
    return {
        **{k: batch[k].detach().cpu() for k in KEYS},
        "vision": [{k: v.detach().cpu() for k, v in row.items()} for row in batch["vision"]],
    }


class Recorded(GKDModule):
    """GKDModule recording every batch it trains on (with its images) and its loss."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[dict] = []

    def distillation_loss(self, batch):
        out = super().distillation_loss(batch)
        if self._trainer is not None and self.trainer.training:
            self.trained.append({"step": self.global_step, "loss": out.loss.item(), **detached(batch)})
        return out


def make_module(lmbda: float) -> Recorded:
    student, processor = tiny_vlm("llava", seed=0)
    teacher, _ = tiny_vlm("llava", seed=1)
    return Recorded(
        student,
        teacher,
        processor.tokenizer,
        lmbda=lmbda,
        sampling={"max_new_tokens": 4},
        divergence={"beta": 0.5},
        training={"optimizer": partial(torch.optim.SGD, lr=LR), "seed": SEED, "frozen_dtype": "float32"},
    )


def gather(obj):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def is_dtensor_model(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def token_mean(losses: list[torch.Tensor], rows: list[dict]) -> torch.Tensor:
    counts = [supervised_positions(row["labels"]).sum() for row in rows]
    return sum(loss * n for loss, n in zip(losses, counts, strict=True)) / sum(counts)


def run(out: Path, lmbda: float) -> dict | None:
    _, processor = tiny_vlm("llava", seed=0)
    rows = shape_rows("train", num_rows=16)
    data = ChatDataModule(processor.tokenizer, rows, processor=processor, batch_size=BATCH, max_length=64, seed=SEED)
    module = make_module(lmbda)
    initial = {k: v.clone() for k, v in module.student.state_dict().items()}
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = small_trainer(out, devices=2, strategy=strategy, max_steps=STEPS)
    trainer.fit(module, datamodule=data)
    sharded = {"student": is_dtensor_model(module.student), "teacher": is_dtensor_model(module.teacher)}
    final = full_state_dict(module.student)  # a collective: every rank calls it, rank 0 gets the tensors
    trained = [row for part in gather(module.trained) for row in part]
    if dist.get_rank() != 0:
        return None

    ref = make_module(lmbda)
    optimizer = torch.optim.SGD([p for p in ref.student.parameters() if p.requires_grad], lr=LR)
    sharded_losses, reference_losses = [], []
    for step in range(STEPS):
        batches = [row for row in trained if row["step"] == step]
        assert len(batches) == 2, (step, len(batches))
        sharded_losses.append(float(token_mean([torch.tensor(row["loss"]) for row in batches], batches)))
        loss = token_mean(
            [ref.distillation_loss({k: row[k] for k in (*KEYS, "vision")}).loss for row in batches], batches
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        reference_losses.append(loss.item())
    reference = ref.student.state_dict()
    assert final is not None and final.keys() == reference.keys()
    return {
        "student_sharded": sharded["student"],
        "teacher_sharded": sharded["teacher"],
        "completion_tokens": [int((row["labels"] != -100).sum()) for row in trained],
        "vision_rows": [sum(1 for v in row["vision"] if v) for row in trained],
        "sharded_losses": sharded_losses,
        "reference_losses": reference_losses,
        "weights_vs_reference": max((final[k] - reference[k]).abs().max().item() for k in final),
        "weights_changed": max((final[k] - initial[k]).abs().max().item() for k in final),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    L.seed_everything(0)
    result: dict = {"dataset": run(out / "dataset", 0.0), "on_policy": run(out / "on_policy", 1.0)}
    result["world_size"] = dist.get_world_size()
    result["strategy"] = "ModelParallelStrategy"
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
