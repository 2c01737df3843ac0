"""DPOModule with a real Lightning Trainer: the reference options, the logged statistics, checkpoints."""

from __future__ import annotations

import copy
import functools
import math
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import logged, small_trainer, with_group_defaults

from lightning_gkd import ChatDataModule, DPOModule, PreferenceDataModule, preference_loss
from lightning_gkd.data.preference import PreferenceCollator
from lightning_gkd.methods import dpo as dpo_module
from lightning_gkd.ops.divergence.preference import sequence_logps
from lightning_gkd.toy.preference import addition_preference_rows

STATS = [
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]


@pytest.fixture(scope="module")
def pairs() -> dict[str, list[dict]]:
    return {"train": addition_preference_rows("train", 24), "val": addition_preference_rows("val", 8)}


def make_module(student, tokenizer, reference="copy", **kwargs) -> DPOModule:
    # frozen_dtype float32: the reference in the policy's arithmetic, so step 0's loss is ln 2
    defaults = with_group_defaults(
        kwargs, training={"optimizer": partial(torch.optim.AdamW, lr=1e-2), "frozen_dtype": "float32"}
    )
    reference = copy.deepcopy(student) if reference == "copy" else reference
    return DPOModule(student, tokenizer, reference, **defaults)


def fit(module, tokenizer, pairs, tmp_path, max_steps=3, ckpt_path=None, **trainer_kwargs) -> L.Trainer:
    data = PreferenceDataModule(tokenizer, pairs["train"], pairs["val"], batch_size=4, max_length=64)
    trainer = small_trainer(
        tmp_path,
        csv=True,
        max_steps=max_steps,
        limit_val_batches=1,
        val_check_interval=max_steps,
        num_sanity_val_steps=0,
        enable_checkpointing=True,  # a resume test reads the checkpoint
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batch_of(tokenizer, rows) -> dict[str, torch.Tensor]:
    return PreferenceCollator(tokenizer, max_length=64)([{**row, "row_index": i} for i, row in enumerate(rows)])


def test_fit_trains_policy_only_and_logs_reward_statistics(student, tokenizer, pairs, tmp_path):
    module = make_module(student, tokenizer)
    assert module.frozen_names == ("reference",) and module.policy is module.model
    policy_before, reference_before = snapshot(module.policy), snapshot(module.reference)

    fit(module, tokenizer, pairs, tmp_path)

    assert any(not torch.equal(v, policy_before[k]) for k, v in module.policy.state_dict().items())
    assert all(torch.equal(v, reference_before[k].to(v.dtype)) for k, v in module.reference.state_dict().items())
    assert not module.reference.training and module.policy.training
    for name in STATS:
        assert len(logged(tmp_path, f"train/{name}")) == 3 and len(logged(tmp_path, f"val/{name}")) == 1
    # Step 0: the policy equals the reference, so rewards are 0 and the sigmoid loss is ln 2.
    assert logged(tmp_path, "train/loss")[0] == pytest.approx(math.log(2), abs=1e-6)
    assert logged(tmp_path, "train/rewards/chosen")[0] == pytest.approx(0.0, abs=1e-6)
    for chosen, rejected, margin in zip(
        logged(tmp_path, "train/rewards/chosen"),
        logged(tmp_path, "train/rewards/rejected"),
        logged(tmp_path, "train/rewards/margins"),
        strict=True,
    ):
        assert margin == pytest.approx(chosen - rejected, abs=1e-5)
    assert logged(tmp_path, "train/loss")[-1] < math.log(2)  # the policy learned to prefer the chosen sums
    assert all(0 <= a <= 1 for a in logged(tmp_path, "val/rewards/accuracies"))

    (checkpoint_path,) = (tmp_path / "checkpoints").glob("*.ckpt")
    state = torch.load(checkpoint_path, weights_only=False)["state_dict"]
    assert state and all(k.startswith("model.") for k in state)  # the reference is never saved
    fresh = make_module(copy.deepcopy(student), tokenizer)
    fresh.load_state_dict({**state, **{f"reference.{k}": v for k, v in fresh.reference.state_dict().items()}})


def test_statistics_match_the_formulas(student, tokenizer, pairs):
    reference = copy.deepcopy(student)
    with torch.no_grad():  # make policy and reference differ
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    module = make_module(student, tokenizer, reference=reference, beta=0.2)
    batch = batch_of(tokenizer, pairs["train"][:4])
    with torch.no_grad():
        stats = module.preference_step(batch)

    def naive(model):
        logits = module.causal_lm_logits(model, batch)
        return sequence_logps(logits[:, :-1], batch["labels"][:, 1:]).double()

    policy, ref = naive(module.policy), naive(module.reference)
    chosen, rejected = (policy[:4] - ref[:4]) * 0.2, (policy[4:] - ref[4:]) * 0.2
    expected_loss = preference_loss(policy[:4], policy[4:], ref[:4], ref[4:], beta=0.2).mean()
    assert stats["loss"].item() == pytest.approx(expected_loss.item(), abs=1e-5)
    assert stats["rewards/chosen"].item() == pytest.approx(chosen.mean().item(), abs=1e-5)
    assert stats["rewards/rejected"].item() == pytest.approx(rejected.mean().item(), abs=1e-5)
    assert stats["rewards/margins"].item() == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)
    assert stats["rewards/accuracies"].item() == (chosen > rejected).double().mean().item()
    assert stats["logps/chosen"].item() == pytest.approx(policy[:4].mean().item(), abs=1e-4)
    assert stats["logps/rejected"].item() == pytest.approx(policy[4:].mean().item(), abs=1e-4)


def test_logits_only_for_completion_positions_give_the_same_logps(student, tokenizer, pairs, monkeypatch):
    module = make_module(student, tokenizer)
    batch = batch_of(tokenizer, pairs["train"][:3])
    seen = []
    original_forward = type(student).forward

    @functools.wraps(original_forward)  # keeps the signature the logits_to_keep check reads
    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("logits_to_keep"))
        return original_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(student), "forward", spy)
    trimmed, lengths = module.completion_logps(student, batch)
    monkeypatch.setattr(dpo_module, "accepts_logits_to_keep", lambda model: False)
    full, _ = module.completion_logps(student, batch)
    width = batch["labels"].shape[1]
    first = min(row.tolist().index(next(t for t in row.tolist() if t != -100)) for row in batch["labels"])
    assert seen == [width - first + 1, None]
    torch.testing.assert_close(trimmed, full, atol=1e-5, rtol=0)
    assert lengths.tolist() == (batch["labels"] != -100).sum(1).tolist()


GOLDEN_PAIR_LOSSES = {  # logps c=-1, r=-2, refs -1.5/-1.5, β=0.1 (z = βΔ = 0.1), lengths 2/4, ε=0.1 where read
    "sigmoid": 0.6443966600735709,
    "hinge": 0.9,
    "ipo": 21.390625,
    "cdpo": 0.9 * 0.6443966600735709 + 0.1 * 0.7443966600735709,  # -(1-ε)logσ(z) - ε logσ(-z)
    "robust": (0.9 * 0.6443966600735709 - 0.1 * 0.7443966600735709) / 0.8,
    "exo_pair": math.exp(-0.6443966600735709) * (-0.6443966600735709 - math.log(0.9))
    + math.exp(-0.7443966600735709) * (-0.7443966600735709 - math.log(0.1)),
}


@pytest.mark.parametrize("loss_type", list(GOLDEN_PAIR_LOSSES))
def test_pair_loss_is_the_configured_preference_loss(student, tokenizer, loss_type):
    smoothing = 0.1 if loss_type in ("cdpo", "robust", "exo_pair") else 0.0
    module = make_module(student, tokenizer, beta=0.1, loss_type=loss_type, label_smoothing=smoothing)
    c, r, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in (-1.0, -2.0, -1.5, -1.5))
    loss = module.pair_loss(c, r, rc, rr, torch.tensor([2]), torch.tensor([4])).item()
    assert loss == pytest.approx(GOLDEN_PAIR_LOSSES[loss_type], abs=1e-12)


def test_label_smoothing_with_sigmoid_warns_and_trains_plain_dpo_as_trl_1_16(student, tokenizer):
    with pytest.warns(UserWarning, match=r"label_smoothing=0.1 has no effect with loss_type='sigmoid'.*loss_type=cdpo"):
        module = make_module(student, tokenizer, beta=0.1, label_smoothing=0.1)
    c, r, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in (-1.0, -2.0, -1.5, -1.5))
    lengths = torch.tensor([2])
    assert module.pair_loss(c, r, rc, rr, lengths, lengths).item() == pytest.approx(0.6443966600735709, abs=1e-12)
    with pytest.raises(ValueError, match=r"loss_type='exo_pair' needs label_smoothing > 0"):
        make_module(student, tokenizer, loss_type="exo_pair")
    with pytest.raises(ValueError, match=r"loss_type must be one of .*'cdpo'.*got 'kto'"):
        make_module(student, tokenizer, loss_type="kto")


def test_peft_policy_uses_itself_with_adapters_disabled_as_reference(student, tokenizer, pairs, tmp_path):
    peft = pytest.importorskip("peft")
    base = copy.deepcopy(student)
    policy = peft.get_peft_model(
        student, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    module = DPOModule(policy, tokenizer, training={"optimizer": partial(torch.optim.AdamW, lr=5e-2)})
    assert module.reference_source == "peft" and module.frozen_names == () and not hasattr(module, "reference")
    fit(module, tokenizer, pairs, tmp_path, max_steps=2)

    batch = batch_of(tokenizer, pairs["val"][:3])
    with torch.no_grad():
        ref_chosen, ref_rejected = module.reference_logps(batch)
        base_logps, _ = module.completion_logps(base, batch)
        policy_logps, _ = module.completion_logps(module.policy, batch)
    torch.testing.assert_close(torch.cat([ref_chosen, ref_rejected]), base_logps, atol=1e-5, rtol=0)
    assert not torch.allclose(policy_logps, base_logps, atol=1e-3)  # the adapters trained
    assert all(not p.requires_grad for n, p in module.policy.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("reference", ["copy", None])
def test_precomputed_reference_logps_are_cached_checkpointed_and_resumed(
    student, tokenizer, pairs, tmp_path, reference, monkeypatch
):
    initial = copy.deepcopy(student)
    module = make_module(student, tokenizer, reference=reference, precompute_ref_logps=True)
    trainer = fit(module, tokenizer, pairs, tmp_path, max_steps=2)

    assert not hasattr(module, "reference") and module.frozen_names == ()  # dropped after precomputing
    cache = module.reference_logps_cache
    assert cache["train"].shape == (24, 2) and cache["val"].shape == (8, 2) and not cache["train"].isnan().any()
    batch = batch_of(tokenizer, pairs["train"])
    with torch.no_grad():
        expected, _ = module.completion_logps(initial, batch)  # the starting weights are the reference
    torch.testing.assert_close(cache["train"][:, 0], expected[:24], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["train"][:, 1], expected[24:], atol=1e-5, rtol=0)
    assert logged(tmp_path, "train/loss")[0] == pytest.approx(math.log(2), abs=1e-6)

    checkpoint = torch.load(tmp_path / "checkpoints" / "epoch=0-step=2.ckpt", weights_only=False)
    assert torch.equal(checkpoint["dpo_reference_logps"]["train"], cache["train"])
    assert not any(k.startswith("reference.") for k in checkpoint["state_dict"])

    resumed = make_module(copy.deepcopy(initial), tokenizer, reference=None, precompute_ref_logps=True)
    monkeypatch.setattr(
        DPOModule,
        "precompute_reference_logps",
        lambda *a: pytest.fail("resuming must reuse the checkpointed reference log-probs"),
    )
    resumed_trainer = fit(
        resumed,
        tokenizer,
        pairs,
        tmp_path / "resumed",
        max_steps=3,
        ckpt_path=tmp_path / "checkpoints" / "epoch=0-step=2.ckpt",
    )
    assert trainer.global_step == 2 and resumed_trainer.global_step == 3
    assert torch.equal(resumed.reference_logps_cache["train"], cache["train"])


def test_reference_logps_given_in_the_rows_skip_the_reference(student, tokenizer, pairs, monkeypatch):
    module = make_module(student, tokenizer)
    rows = [{**row, "ref_chosen_logps": -1.0, "ref_rejected_logps": -50.0} for row in pairs["train"][:2]]
    monkeypatch.setattr(module.reference, "forward", lambda *a, **k: pytest.fail("reference must not run"))
    batch = batch_of(tokenizer, rows)
    with torch.no_grad():
        stats = module.preference_step(batch)
        logps, _ = module.completion_logps(module.policy, batch)
    assert stats["rewards/chosen"].item() == pytest.approx(0.1 * (logps[:2] + 1.0).mean().item(), abs=1e-5)
    assert stats["rewards/rejected"].item() == pytest.approx(0.1 * (logps[2:] + 50.0).mean().item(), abs=1e-5)


def test_policy_and_reference_load_from_local_folders(student, tokenizer, tmp_path):
    student.save_pretrained(tmp_path / "policy")
    module = DPOModule(
        str(tmp_path / "policy"),
        tokenizer,
        reference={"name_or_path": str(tmp_path / "policy"), "init_kwargs": {"dtype": "bfloat16"}},
    )
    assert module.reference.dtype == torch.bfloat16 and module.policy.dtype == torch.float32
    assert not any(p.requires_grad for p in module.reference.parameters())
    expected = {k: v.to(torch.bfloat16) for k, v in student.state_dict().items()}
    assert all(torch.equal(v, expected[k]) for k, v in module.reference.state_dict().items())


def test_unusable_setups_fail_with_a_clear_message(student, tokenizer, toy_rows, pairs, tmp_path):
    with pytest.raises(ValueError, match="DPOModule needs a reference"):
        DPOModule(student, tokenizer)
    with pytest.raises(ValueError, match=r"reference is the policy object itself.*copy.deepcopy"):
        DPOModule(student, tokenizer, reference=student)
    with pytest.raises(ValueError, match="beta must be > 0"):
        DPOModule(student, tokenizer, reference=copy.deepcopy(student), beta=0)
    module = make_module(student, tokenizer)
    chat_batch = next(iter(ChatDataModule(tokenizer, toy_rows["train"], batch_size=4).train_dataloader()))
    with pytest.raises(ValueError, match="looks like a chat batch.*PreferenceDataModule"):
        module.preference_step(chat_batch)
    with pytest.raises(ValueError, match=r"has no \['labels'\]"):
        module.preference_step(
            {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
        )
    precomputing = make_module(copy.deepcopy(student), tokenizer, precompute_ref_logps=True)
    trainer = small_trainer(tmp_path, max_steps=1)
    loader = PreferenceDataModule(tokenizer, pairs["train"], batch_size=4).train_dataloader()
    with pytest.raises(ValueError, match="precompute_ref_logps=True reads the data from the datamodule"):
        trainer.fit(precomputing, train_dataloaders=loader)


def test_named_validation_sets_log_each_sets_statistics(student, tokenizer, tmp_path):
    """PreferenceDataModule(val_data={name: rows}): one loader per set; DPOModule logs val/<name>/... for each,
    equal to validating that set alone."""
    sets = {"easy": addition_preference_rows("val", 6), "hard": addition_preference_rows("test", 10)[4:]}
    train = addition_preference_rows("train", 8)
    module = make_module(student, tokenizer, validation={"metrics": {}})

    def validate(val_data) -> dict[str, float]:
        data = PreferenceDataModule(tokenizer, train, val_data, batch_size=4, val_batch_size=16, max_length=64)
        trainer = small_trainer(tmp_path, limit_val_batches=1.0)
        results = trainer.validate(module, datamodule=data, verbose=False)
        return {key: float(value) for result in results for key, value in result.items()}

    named = validate(sets)
    keys = {"loss", "rewards/accuracies", "rewards/margins", "logps/chosen"}
    for name, rows in sets.items():
        alone = validate(rows)
        for key in keys:
            assert named[f"val/{name}/{key}"] == pytest.approx(alone[f"val/{key}"], rel=1e-5), (name, key)
    assert named["val/easy/logps/chosen"] != pytest.approx(named["val/hard/logps/chosen"])
    assert not any(key.startswith("val/loss") for key in named)
    with pytest.raises(ValueError, match="val_data names must be non-empty strings without '/'"):
        PreferenceDataModule(tokenizer, train, {"a/b": sets["easy"]})


def test_a_reference_padded_to_more_rows_compares_log_probs_over_the_shared_rows(tokenizer, pairs, tmp_path):
    """A policy and a reference over one tokenizer with different vocabulary rows (the reference's folder holds the
    tokenizer): the statistics equal those of the models truncated to the rows both have; a reference whose
    tokenizer is not known is refused."""
    from helpers.padded_vocab import pad_vocabulary, truncated_copy

    from lightning_gkd.models.loading import vocab_size
    from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm

    policy = pad_vocabulary(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0), 264, seed=2, scale=3.0)
    reference = pad_vocabulary(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=5), 272, seed=3, scale=3.0)
    reference.save_pretrained(tmp_path / "reference")
    tokenizer.save_pretrained(tmp_path / "reference")
    with pytest.raises(ValueError, match="policy's vocabulary has 264 rows and the reference's 272, and the refer"):
        make_module(copy.deepcopy(policy), tokenizer, reference=copy.deepcopy(reference))
    ours = make_module(copy.deepcopy(policy), tokenizer, reference=str(tmp_path / "reference"), beta=0.2)
    assert vocab_size(ours.reference) == 264
    truncated = make_module(copy.deepcopy(policy), tokenizer, reference=truncated_copy(reference, 264), beta=0.2)
    batch = batch_of(tokenizer, pairs["train"][:4])
    with torch.no_grad():
        got, want = ours.preference_step(batch), truncated.preference_step(batch)
    for name in ("loss", "rewards/chosen", "rewards/margins", "logps/rejected"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
