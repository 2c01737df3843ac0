"""lightning_gkd.training.normalization: with gradient accumulation and uneven token counts, an optimizer step's
update is the gradient of the token mean over all its micro-batches (one big batch's), for GKD on dataset
completions and on its own samples, and for SFT; ``loss_normalization="micro_batch"`` keeps each micro-batch's
mean (the old, differently weighted objective). A plain Lightning Trainer, real collation."""

import copy
import csv
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_gkd import ChatDataModule, GKDModule, SFTModule
from lightning_gkd.data.toy import addition_rows
from lightning_gkd.models.tiny import asset_path


class RecordingSGD(torch.optim.SGD):
    """SGD with lr 0 that records the gradients it is handed (after Lightning's and our scaling, after clipping)."""

    def __init__(self, params, record: list) -> None:
        super().__init__(params, lr=0.0)
        self.record = record

    def step(self, closure=None):
        loss = super().step(closure)
        self.record.append(
            {
                id(p): p.grad.detach().clone()
                for group in self.param_groups
                for p in group["params"]
                if p.grad is not None
            }
        )
        return loss


def uneven_rows(count: int) -> list[dict]:
    """Toy rows whose completions have different token counts (answers of 1 to 4 digits), short ones first."""
    rows = sorted(addition_rows("train", 64), key=lambda row: len(row["answer"]))
    picked = rows[: count // 2] + rows[-(count - count // 2) :]
    assert len({len(row["answer"]) for row in picked}) > 1
    return picked


def one_step(module, tokenizer, rows, tmp_path, *, batch_size, accumulate, steps_per_generation=1):
    grads: list = []
    module.optimizer_factory = partial(RecordingSGD, record=grads)
    data = ChatDataModule(
        tokenizer,
        rows,
        batch_size=batch_size,
        max_length=64,
        shuffle=False,
        steps_per_generation=steps_per_generation,
    )
    L.Trainer(
        accelerator="cpu",
        max_steps=1,
        accumulate_grad_batches=accumulate,
        logger=CSVLogger(tmp_path, name="", version=""),
        log_every_n_steps=1,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, datamodule=data)
    assert len(grads) == 1
    by_id = grads[0]
    gradients = {name: by_id[id(p)] for name, p in module.model.named_parameters() if id(p) in by_id}
    with open(tmp_path / "metrics.csv") as handle:
        logged = [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]
    return gradients, logged


def relative_difference(got: dict, want: dict) -> float:
    scale = max(float(g.abs().max()) for g in want.values())
    return max(float((got[name] - grad).abs().max()) for name, grad in want.items()) / scale


@pytest.mark.parametrize("method", ["gkd", "sft"])
def test_accumulated_micro_batches_equal_one_big_batch_with_uneven_token_counts(
    method, student, teacher, tokenizer, tmp_path
):
    rows = uneven_rows(8)

    def make(**kwargs):
        if method == "gkd":
            return GKDModule(copy.deepcopy(student), copy.deepcopy(teacher), tokenizer, lmbda=0.0, **kwargs)
        return SFTModule(copy.deepcopy(student), tokenizer, **kwargs)

    big, big_loss = one_step(make(), tokenizer, rows, tmp_path / "big", batch_size=8, accumulate=1)
    accumulated, accumulated_loss = one_step(make(), tokenizer, rows, tmp_path / "acc", batch_size=4, accumulate=2)
    per_micro, _ = one_step(
        make(loss_normalization="micro_batch"), tokenizer, rows, tmp_path / "old", batch_size=4, accumulate=2
    )
    assert relative_difference(accumulated, big) < 1e-6
    assert accumulated_loss == pytest.approx(big_loss, rel=1e-6)  # train/loss: the step's token mean
    assert relative_difference(per_micro, big) > 1e-3  # the per-micro-batch mean is another objective


def test_on_policy_samples_of_different_lengths_are_one_token_mean(tokenizer, tmp_path):
    """λ = 1, a group of 8 prompts sampled once and cut into 2 micro-batches accumulated into one step: the update
    is the gradient of the token mean over all 8 samples, whatever their lengths (the shipped toy student ends its
    answers with EOS after 1 to 4 digits)."""
    rows = uneven_rows(8)
    student, teacher = asset_path("toy/student_init"), asset_path("toy/teacher")
    # float32 teacher: the reference below runs it outside a fit, where "auto" would not cast it
    module = GKDModule(
        student, teacher, tokenizer, lmbda=1.0, max_new_tokens=8, temperature=1.0, frozen_dtype="float32"
    )
    samples: list = []
    sample_batch = module.sample_batch

    def recording(model, batch, seed):
        sampled = sample_batch(model, batch, seed)
        samples.append(
            {k: v.detach().clone() for k, v in sampled.items() if k in ("input_ids", "attention_mask", "labels")}
        )
        return sampled

    module.sample_batch = recording
    reference = copy.deepcopy(module.student)
    grads, logged = one_step(module, tokenizer, rows, tmp_path, batch_size=4, accumulate=2, steps_per_generation=2)
    (group,) = samples
    lengths = (group["labels"] != -100).sum(dim=1)
    assert len(set(lengths.tolist())) > 1  # the samples end at different places

    plain = GKDModule(reference, teacher, tokenizer, lmbda=1.0)
    loss = plain.distillation_loss(group).loss  # the token mean over the whole group
    loss.backward()
    want = {name: p.grad for name, p in plain.model.named_parameters() if p.grad is not None}
    assert relative_difference(grads, want) < 1e-6
    assert logged == pytest.approx([float(loss)], rel=1e-6)


def test_the_option_is_checked():
    from lightning_gkd.training.normalization import StepTokenNormalizer

    with pytest.raises(ValueError, match="loss_normalization must be 'step' or 'micro_batch', got 'token'"):
        StepTokenNormalizer("token")  # type: ignore[arg-type]
