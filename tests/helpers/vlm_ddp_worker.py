"""Two-process DDP runs on CPU (gloo) with rows that hold images, for tests/methods/test_gkd_vision.py; rank 0 writes
the measurements to <out>/result.json.

    python tests/helpers/vlm_ddp_worker.py <out_dir>

Lightning's DDP launcher starts rank 1 by re-running this script; everything below runs on both ranks. Two fits of
``GKDModule`` with a tiny llava student (seed 0) and teacher (seed 1) on toy shape rows, λ = 0 (dataset completions,
no sampling), SGD, ``STEPS`` steps of ``PER_RANK`` rows per rank, float32 teacher:

1. ``frozen``: the default ``training.freeze_vision`` (vision tower and projector frozen).
2. ``vision_trained``: ``training.freeze_vision=False``, under ``DDPStrategy(find_unused_parameters=True)``: the tiny
   llava's CLIP tower has parameters no loss reaches (``post_layernorm``: llava reads the encoder's hidden states
   before it), which plain ``strategy="ddp"`` refuses at the second step.

Each rank records what it trained on (the rows' fingerprints: completion labels and the sum of their image tensors,
since every shape row's prompt text is the same) and its loss; rank 0 then replays the run in one process with the
real loader at batch_size = 2 * PER_RANK (the "doubled batch"), and compares losses (the step's token mean over both
ranks) and final weights.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.models.vision import input_side_modules
from lightning_gkd.toy.shapes import shape_rows
from lightning_gkd.toy.tiny_vlm import tiny_vlm
from tests.helpers.fitting import small_trainer  # the repository is on PYTHONPATH (helpers.launch.clean_env)

LR, MAX_LENGTH, SEED, STEPS, PER_RANK = 1.0, 64, 0, 2, 2
SGD = partial(torch.optim.SGD, lr=LR)


def fingerprints(batch: dict) -> list[list]:
    """Per row: its completion label ids and the sum of its image tensors (rounded), in batch order."""
    out = []
    for labels, vision in zip(batch["labels"].tolist(), batch["vision"], strict=True):
        pixels = sum(float(t.double().sum()) for t in vision.values() if t.is_floating_point())
        out.append([[t for t in labels if t != -100], round(pixels, 3)])
    return out


class Recorded(GKDModule):
    """GKDModule recording, on its rank, every trained batch's row fingerprints, loss, token count and image rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[dict] = []

    def distillation_loss(self, batch):
        out = super().distillation_loss(batch)
        if self._trainer is not None and self.trainer.training:
            self.trained.append(
                {
                    "loss": out.loss.item(),
                    "tokens": int((batch["labels"] != -100).sum()),
                    "rows": fingerprints(batch),
                    "vision_rows": sum(1 for v in batch["vision"] if v),
                }
            )
        return out


def make_module(training: dict) -> Recorded:
    student, processor = tiny_vlm("llava", seed=0)
    teacher, _ = tiny_vlm("llava", seed=1)
    return Recorded(
        student,
        teacher,
        processor.tokenizer,
        lmbda=0.0,
        divergence={"beta": 0.5},
        training={"optimizer": SGD, "seed": SEED, "frozen_dtype": "float32", **training},
    )


def data(rows: list[dict], batch_size: int) -> ChatDataModule:
    _, processor = tiny_vlm("llava", seed=0)
    return ChatDataModule(
        processor.tokenizer, rows, processor=processor, batch_size=batch_size, max_length=MAX_LENGTH, seed=SEED
    )


def gather(obj):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def flat_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys=None) -> float:
    assert a.keys() == b.keys()
    keys = a.keys() if keys is None else keys
    return max((a[k].float() - b[k].float()).abs().max().item() for k in keys)


def vision_keys(model: torch.nn.Module) -> list[str]:
    prefixes = tuple(f"{name}." for name in input_side_modules(model))
    return [k for k in model.state_dict() if k.startswith(prefixes)]


def run(out: Path, rows: list[dict], training: dict, strategy: Any = "ddp") -> dict | None:
    module = make_module(training)
    initial = flat_state(module.student)
    trainer = small_trainer(out, devices=2, strategy=strategy, max_steps=STEPS)
    trainer.fit(module, datamodule=data(rows, PER_RANK))
    final = flat_state(module.student)
    finals = gather(final)
    by_rank = gather(module.trained)
    if dist.get_rank() != 0:
        return None

    # one process, the real loader at the doubled batch size, SGD on the step's token mean
    ref = make_module(training)
    ref_data = data(rows, 2 * PER_RANK)
    ref.check_datamodule(ref_data)
    opt = torch.optim.SGD([p for p in ref.student.parameters() if p.requires_grad], lr=LR)
    doubled_losses, doubled_rows = [], []
    for step, batch in enumerate(itertools.islice(ref_data.train_dataloader(), STEPS)):
        _, batch = ref.training_batch(batch, step)
        loss = ref.distillation_loss(batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        doubled_losses.append(loss.item())
        doubled_rows.append(fingerprints(batch))
    doubled = flat_state(ref.student)

    vision = vision_keys(module.student)
    return {
        "losses": [  # the step's token mean over both ranks
            sum(part[s]["loss"] * part[s]["tokens"] for part in by_rank) / sum(part[s]["tokens"] for part in by_rank)
            for s in range(STEPS)
        ],
        "tokens": [[row["tokens"] for row in part] for part in by_rank],
        "vision_rows": [[row["vision_rows"] for row in part] for part in by_rank],
        "doubled_losses": doubled_losses,
        "doubled_rows_are_both_ranks": all(
            sorted(map(json.dumps, doubled_rows[s]))
            == sorted(map(json.dumps, by_rank[0][s]["rows"] + by_rank[1][s]["rows"]))
            for s in range(STEPS)
        ),
        "weights_rank0_vs_rank1": max_abs_diff(finals[0], finals[1]),
        "weights_vs_doubled": max_abs_diff(final, doubled),
        "weights_changed": max_abs_diff(final, initial),
        "vision_changed": max_abs_diff(final, initial, vision),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    L.seed_everything(0)
    rows = shape_rows("train", num_rows=16)
    result: dict = {
        "frozen": run(out / "frozen", rows, {}),
        "vision_trained": run(
            out / "vision_trained", rows, {"freeze_vision": False}, DDPStrategy(find_unused_parameters=True)
        ),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
    }
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
