"""lightning_gkd.training.normalization: with gradient accumulation and uneven token counts, an optimizer step's
update is the gradient of the token mean over all its micro-batches (one big batch's), for GKD on dataset
completions and on its own samples, and for SFT; ``loss_normalization="micro_batch"`` keeps each micro-batch's
mean (the old, differently weighted objective). Under 16-mixed (fp16 autocast, a GradScaler; on CPU here) the
unscaled gradients are that token mean, and a step that overflows is skipped without its token counts leaking into the
next. A plain Lightning Trainer, real collation."""

import copy
import csv
from dataclasses import replace
from functools import partial
from itertools import pairwise

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins import MixedPrecision

from lightning_gkd import ChatDataModule, GKDModule, SFTModule
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path


class RecordingSGD(torch.optim.SGD):
    """SGD (lr 0 unless given) that records the gradients it is handed (after Lightning's and our scaling, after
    clipping; under 16-mixed after the GradScaler's unscaling, and only for the steps it does not skip)."""

    def __init__(self, params, record: list, lr: float = 0.0) -> None:
        super().__init__(params, lr=lr)
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
    module.training_settings = replace(module.training_settings, optimizer=partial(RecordingSGD, record=grads))
    data = ChatDataModule(
        tokenizer,
        rows,
        batch_size=batch_size,
        max_length=64,
        shuffle=False,
        steps_per_generation=steps_per_generation,
    )
    small_trainer(tmp_path, csv=True, max_steps=1, accumulate_grad_batches=accumulate).fit(module, datamodule=data)
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
        make(training={"loss_normalization": "micro_batch"}),
        tokenizer,
        rows,
        tmp_path / "old",
        batch_size=4,
        accumulate=2,
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
        student,
        teacher,
        tokenizer,
        lmbda=1.0,
        sampling={"max_new_tokens": 8, "temperature": 1.0},
        training={"frozen_dtype": "float32"},
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
    from lightning_gkd.training.settings import TrainingSettings

    with pytest.raises(ValueError, match="loss_normalization must be 'step' or 'micro_batch', got 'token'"):
        TrainingSettings(loss_normalization="token")  # type: ignore[arg-type]


class ScalerSteps(L.Callback):
    """Per optimizer step: the weights at its start and the GradScaler's scale after it. Makes step ``overflow_at``
    overflow: after its first micro-batch's backward one gradient entry is inf, as an fp16 overflow leaves it."""

    def __init__(self, overflow_at: int) -> None:
        self.overflow_at = overflow_at
        self.weights: list[dict] = []
        self.scales: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.weights.append({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()})

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.overflow_at and len(self.weights) == self.overflow_at + 1:
            next(pl_module.model.parameters()).grad.view(-1)[0] = float("inf")
            self.overflow_at = -1  # once

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.scales.append(trainer.precision_plugin.scaler.get_scale())


def test_16_mixed_unscaled_gradients_are_the_float32_token_mean_and_an_overflow_step_is_skipped(
    student, tokenizer, tmp_path
):
    """precision 16-mixed: fp16 autocast and a GradScaler (here on CPU: Lightning's MixedPrecision plugin with
    device "cpu", the path trainer.precision=16-mixed takes on a GPU with device "cuda"). Three steps of two
    micro-batches (4 rows each, a short-answer one and a long-answer one: uneven token counts); step 1 overflows.
    (a) Steps 0 and 2 hand the optimizer, after unscaling and the step normalisation, the float32 gradient of the
    token mean over the step's 8 rows, from the weights the step started with (to fp16 accuracy; the per-micro-batch
    mean, another objective, is farther off). (b) Step 1 is skipped: weights unchanged, scale halved, and its token
    counts do not leak into step 2 (whose gradient is its own rows' token mean)."""
    by_length = sorted(addition_rows("train", 64), key=lambda row: len(row["answer"]))
    short, long = by_length[:12], by_length[-12:]
    rows = [row for k in range(3) for row in short[4 * k : 4 * k + 4] + long[4 * k : 4 * k + 4]]
    grads: list = []
    module = SFTModule(
        copy.deepcopy(student), tokenizer, training={"optimizer": partial(RecordingSGD, record=grads, lr=0.5)}
    )
    steps = ScalerSteps(overflow_at=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # (Lightning's default, 2**16, overflows step 0 here)
    trainer = small_trainer(
        tmp_path,
        csv=True,
        max_steps=3,
        accumulate_grad_batches=2,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        callbacks=[steps],
    )
    datamodule = ChatDataModule(tokenizer, rows, batch_size=4, max_length=64, shuffle=False)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 3 and len(steps.weights) == 3
    with trainer.precision_plugin.forward_context():  # the steps' forwards ran in fp16
        assert module.model(**datamodule.collator(rows[:1])).logits.dtype == torch.float16

    # (b) the overflow step: skipped by the scaler (the optimizer never saw it), weights unchanged, scale halved
    assert steps.scales == [2.0**8, 2.0**7, 2.0**7]
    assert len(grads) == 2  # steps 0 and 2
    assert all(torch.equal(steps.weights[1][n], w) for n, w in steps.weights[2].items())
    assert not all(torch.equal(steps.weights[0][n], w) for n, w in steps.weights[1].items())  # step 0 did train

    # (a) steps 0 and 2: the float32 token-mean gradient over the step's rows, from its starting weights
    with open(tmp_path / "metrics.csv") as handle:
        logged = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(handle) if r.get("train/loss")}
    for recorded, step in zip(grads, (0, 2), strict=True):
        micro = [datamodule.collator(rows[8 * step + 4 * m : 8 * step + 4 * m + 4]) for m in (0, 1)]
        counts = [int((batch["labels"] != IGNORE_INDEX).sum()) for batch in micro]
        assert counts[0] != counts[1]
        reference = SFTModule(copy.deepcopy(student), tokenizer)
        reference.model.load_state_dict(steps.weights[step])
        names, params = zip(*reference.model.named_parameters(), strict=True)
        losses = [reference.completion_loss(batch).loss for batch in micro]
        token_mean = (losses[0] * counts[0] + losses[1] * counts[1]) / sum(counts)
        want = dict(zip(names, torch.autograd.grad(token_mean, params, retain_graph=True), strict=True))
        other = dict(zip(names, torch.autograd.grad((losses[0] + losses[1]) / 2, params), strict=True))
        got = {name: recorded[id(p)] for name, p in module.model.named_parameters()}
        assert relative_difference(got, want) < 2e-3  # measured 3e-4 and 5e-4: fp16 rounding
        assert relative_difference(other, want) > 2e-2  # measured 7e-2 and 8e-2
        assert logged[step] == pytest.approx(float(token_mean), rel=1e-3)


def test_16_mixed_with_the_fused_adamw_skips_an_overflow_step(student, tokenizer, tmp_path):
    """The default optimizer (AdamW, fused) unscales and checks for inf inside its own step, so under 16-mixed
    Lightning hands it still-scaled gradients, which the step normalisation scales first (a linear factor: the
    same update). An overflowing step is skipped there too: weights unchanged, scale halved."""
    module = SFTModule(copy.deepcopy(student), tokenizer)
    steps = ScalerSteps(overflow_at=1)
    trainer = small_trainer(
        tmp_path,
        max_steps=3,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))],
        callbacks=[steps],
    )
    trainer.fit(module, datamodule=ChatDataModule(tokenizer, uneven_rows(12), batch_size=4, max_length=64))
    assert _optimizer_handles_unscaling(trainer.optimizers[0])  # the fused kernel's own unscaling path
    assert steps.scales == [2.0**8, 2.0**7, 2.0**7]
    unchanged = [all(torch.equal(a[k], b[k]) for k in a) for a, b in pairwise(steps.weights)]
    assert unchanged == [False, True]  # step 0 trained, step 1 (the overflow) did not
    final = module.model.state_dict()
    assert not all(torch.equal(steps.weights[2][k], final[k]) for k in final)  # step 2 trained again
