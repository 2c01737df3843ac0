"""OPDModule (lightning_gkd/methods/opd.py): the module hands ops.opd the right tensors. On fresh samples with γ = 0
one training step's gradient is the k1 sampled reverse-KL gradient, across model families and uneven completion
lengths; a student equal to its teacher gets no reward and no update; importance weights read from the batch's
sampler log-probs; γ > 0 as the ops function computes it, and so the stabilisers (length_normalize, baseline,
clip_ratio) and their logs; a real fit with grouped generation (stale second
micro-batches); a served teacher gives the local teacher's rewards; several teachers; the settings refused before any
model loads. Plain Lightning Trainer, real collation, tiny models."""

from __future__ import annotations

import copy
import csv
import math
from dataclasses import replace
from functools import partial

import pytest
import torch
from helpers.fitting import LossOf, small_trainer, with_group_defaults
from helpers.opd_metrics import OPD_METRICS
from helpers.tiny_registry import build_tiny, tiny_config
from transformers import AutoModelForCausalLM

from lightning_gkd import ChatDataModule, OPDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.loader import select_rows, shuffled_micro_batches
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.losses.opd import eos_rate
from lightning_gkd.ops.divergence.opd import policy_gradient_distillation_loss
from lightning_gkd.ops.divergence.sparse_kd import sampled_kl_loss
from lightning_gkd.ops.hf.heads import final_hidden_states, output_head
from lightning_gkd.samplers import KVCacheSampler, Sampler
from lightning_gkd.teachers import CacheTeacher, LocalTeacher, supervised_positions
from lightning_gkd.teachers.server import ServerSampler, ServerTeacher
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, asset_path, tiny_causal_lm

#: exact float32 sampling: the sampler's log-probs then match the training forward's to ~1e-6 (w = 1 on fresh samples)
EXACT_SAMPLER = partial(KVCacheSampler, matmul_precision="highest")
STOPS = list(range(3, 25))  # many "EOS" ids: random tiny models then end their samples at uneven lengths


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class Recording(Sampler):
    """A sampler that remembers its last batch."""

    def __init__(self, inner):
        self.inner, self.last, self.widths = inner, None, []

    def sample(self, model, prompts, prompt_attention_mask, *, seed, vision=None):
        self.last = self.inner.sample(model, prompts, prompt_attention_mask, seed=seed)
        self.widths.append(self.last["input_ids"].shape[1])
        return self.last


def make_module(student, teacher, tokenizer, **kwargs) -> OPDModule:
    defaults = with_group_defaults(
        kwargs,
        sampling={"max_new_tokens": 8, "sampler": EXACT_SAMPLER},
        training={"optimizer": partial(torch.optim.AdamW, lr=1e-2), "frozen_dtype": "float32"},
        validation={"metrics": {}},
    )
    return OPDModule(student, teacher, tokenizer, **defaults)


def capture_logs(module: OPDModule) -> dict[str, float]:
    logs: dict[str, float] = {}
    module.log = lambda name, value, **kwargs: logs.__setitem__(name, float(value))
    return logs


def train_logs(out) -> dict[str, float]:
    """A loss output's logs as ``training_step`` logs them (``train/<name>``)."""
    return {f"train/{name}": float(logged.value) for name, logged in out.logs.items()}


def collated(tokenizer, size=6, start=0):
    return ChatMLCollator(tokenizer, max_length=64)(addition_rows("train", 64)[start : start + size])


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_k1(student, teacher, sampled):
    """The ops-level k1 loss on ``sampled``, its inputs computed without the module: the teacher's full logits,
    the sampled tokens read from the labels."""
    positions = supervised_positions(sampled["labels"])
    labels = sampled["labels"][:, 1:]
    tokens = labels[labels != -100]
    with torch.no_grad():
        teacher_lp = torch.log_softmax(LocalTeacher(teacher).logits(sampled).float(), -1)[positions]
    teacher_at = teacher_lp.gather(1, tokens[:, None]).squeeze(1)
    hidden = final_hidden_states(student, sampled["input_ids"], sampled["attention_mask"], positions)
    return sampled_kl_loss(hidden, output_head(student), tokens, teacher_at, estimator="k1"), int(positions.sum())


def family_pair(model_type, tokenizer):
    config = tiny_config(model_type, len(tokenizer))
    student, teacher = build_tiny(config, seed=0), build_tiny(config, seed=1)
    for model in (student, teacher):
        model.generation_config.eos_token_id = STOPS
    return student, teacher


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_gamma_zero_on_fresh_samples_is_the_k1_gradient(family, tokenizer):
    student, teacher = family_pair(family, tokenizer)
    module = make_module(student, teacher, tokenizer)
    module.sampler = recorder = Recording(module.sampler)
    logs = capture_logs(module)
    step_loss = module.training_step(collated(tokenizer), 0)
    step_loss.backward()
    sampled = recorder.last
    lengths = (sampled["labels"] != -100).sum(1)
    assert lengths.unique().numel() > 1  # uneven completion lengths
    ours = grads_of(student)
    student.zero_grad()
    k1, n = reference_k1(student, teacher, sampled)
    k1.backward()
    expected = grads_of(student)
    assert ours.keys() == expected.keys() and len(ours) > 0
    for name, grad in ours.items():  # the step returns the token sum; the optimizer step divides by the count
        torch.testing.assert_close(grad / n, expected[name], rtol=1e-4, atol=1e-5, msg=name)
    assert step_loss.item() / n == pytest.approx(k1.item(), rel=1e-4)
    assert logs["train/opd/kl"] == pytest.approx(k1.item(), rel=1e-4) and logs["train/opd/reward"] < 0
    assert logs["train/opd/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert logs["train/opd/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert logs["train/opd/is_truncated_fraction"] == 0.0
    assert logs["train/opd/advantage_mean"] == pytest.approx(logs["train/opd/reward"], rel=1e-6)  # γ = 0: A = r
    assert "train/opd/clipped_fraction" not in logs
    last = [int(row[row != -100][-1]) for row in sampled["labels"]]
    assert logs["train/opd/eos_rate"] == pytest.approx(sum(token in STOPS for token in last) / len(last))
    assert 0 < logs["train/opd/eos_rate"] < 1


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_a_student_equal_to_its_teacher_gets_no_reward_and_no_update(gamma, tokenizer):
    student = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)
    teacher = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)
    module = make_module(student, teacher, tokenizer, policy_gradient={"gamma": gamma})
    module.sampler = recorder = Recording(module.sampler)
    logs = capture_logs(module)
    loss = module.training_step(collated(tokenizer), 0)
    loss.backward()
    n = int(supervised_positions(recorder.last["labels"]).sum())  # the step's token sum -> its token mean
    assert abs(loss.item() / n) < 1e-6 and abs(logs["train/opd/reward"]) < 1e-6
    assert all(g.abs().max() / n < 1e-6 for g in grads_of(student).values())


def sampled_batch(module, tokenizer, size=6):
    with torch.no_grad():
        return module.sample_batch(module.student, collated(tokenizer, size), seed=3)


def loss_and_grads(module, batch):
    module.student.zero_grad()
    out = module.training_loss(batch)
    out.loss.backward()
    return out.loss.detach(), grads_of(module.student), train_logs(out)


@pytest.mark.parametrize("shift, weight", [(0.5, math.exp(0.5)), (1.0, 2.0)])
def test_importance_weights_come_from_the_batchs_sampler_logprobs(shift, weight, student, teacher, tokenizer):
    """Sampler log-probs lowered by ``shift`` make every weight exp(shift), truncated at max_is_weight = 2."""
    module = make_module(student, teacher, tokenizer, policy_gradient={"max_is_weight": 2.0})
    batch = sampled_batch(module, tokenizer)
    fresh_loss, fresh_grads, fresh_logs = loss_and_grads(module, batch)
    assert fresh_logs["train/opd/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    stale = {**batch, "sampled_logprobs": batch["sampled_logprobs"] - shift * (batch["labels"] != -100)}
    loss, grads, logs = loss_and_grads(module, stale)
    assert logs["train/opd/is_weight_mean"] == pytest.approx(weight, rel=1e-4)
    assert logs["train/opd/is_weight_max"] == pytest.approx(weight, rel=1e-4)
    assert logs["train/opd/is_truncated_fraction"] == (1.0 if weight == 2.0 else 0.0)
    assert logs["train/opd/reward"] == pytest.approx(fresh_logs["train/opd/reward"], rel=1e-6)  # rewards unchanged
    assert loss.item() == pytest.approx(weight * fresh_loss.item(), rel=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, weight * fresh_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    # without importance weights (or without sampler log-probs in the batch) every weight is 1
    module.loss.policy_gradient = replace(module.loss.policy_gradient, importance_weights=False)
    unweighted, _, logs = loss_and_grads(module, stale)
    assert logs["train/opd/is_weight_mean"] == 1.0 and unweighted.item() == pytest.approx(fresh_loss.item(), rel=1e-4)


def test_sampler_logprobs_line_up_in_the_micro_batches_grouped_generation_cuts(student, teacher, tokenizer):
    """shuffled_micro_batches trims each micro-batch to its own columns; the sampler's log-probs still meet their
    tokens there: fresh samples give w = 1 in every micro-batch."""
    student.generation_config.eos_token_id = list(range(3, 150))  # short, uneven samples
    module = make_module(student, teacher, tokenizer)
    group = sampled_batch(module, tokenizer, size=12)
    parts = shuffled_micro_batches(group, 3, seed=0)
    assert any(part["input_ids"].shape[1] < group["input_ids"].shape[1] for part in parts)
    for part in parts:
        _, _, logs = loss_and_grads(module, part)
        assert logs["train/opd/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert logs["train/opd/is_weight_max"] == pytest.approx(1.0, abs=1e-4)


def ops_reference(student, teacher, batch, **options):
    """The ops function's loss, gradients and statistics on ``batch``, its inputs built here: rows from the labels,
    teacher log-probs from full logits, the sampler's log-probs read at each token's column."""
    positions = supervised_positions(batch["labels"])
    labels = batch["labels"][:, 1:]
    tokens = labels[labels != -100]
    rows = torch.nonzero(labels != -100)[:, 0]
    with torch.no_grad():
        teacher_lp = torch.log_softmax(teacher(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits, -1)
    teacher_at = teacher_lp[positions].gather(1, tokens[:, None]).squeeze(1)
    sampler_at = batch["sampled_logprobs"][:, 1:][labels != -100]
    student.zero_grad()
    hidden = final_hidden_states(student, batch["input_ids"], batch["attention_mask"], positions)
    value, stats = policy_gradient_distillation_loss(
        hidden, output_head(student), tokens, teacher_at, rows=rows, sampler_logprobs=sampler_at, **options
    )
    value.backward()
    return value.detach(), grads_of(student), stats


def test_gamma_discounts_as_the_ops_function_does_per_row(student, teacher, tokenizer):
    for model in (student, teacher):
        model.generation_config.eos_token_id = STOPS
    module = make_module(student, teacher, tokenizer, policy_gradient={"gamma": 0.7})
    batch = sampled_batch(module, tokenizer)
    assert (batch["labels"] != -100).sum(1).unique().numel() > 1
    loss, grads, logs = loss_and_grads(module, batch)
    expected, expected_grads, _ = ops_reference(student, teacher, batch, gamma=0.7)
    undiscounted, _, _ = ops_reference(student, teacher, batch, gamma=0.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    module.loss.policy_gradient = replace(module.loss.policy_gradient, gamma=0.0)
    at_zero, _, _ = loss_and_grads(module, batch)
    assert at_zero.item() == pytest.approx(undiscounted.item(), rel=1e-5)
    assert abs(loss.item() - at_zero.item()) > 1e-3  # γ changes the loss, as the ops function says
    assert logs["train/opd/reward"] == pytest.approx(-at_zero.item(), rel=1e-4)  # the reward does not depend on γ
    assert "train/opd/clipped_fraction" not in logs  # clip_ratio is off by default


def test_the_stabilisers_reach_the_ops_function_with_their_logs(student, teacher, tokenizer):
    """γ = 1 with length_normalize, baseline=row and clip_ratio on a stale batch (sampler log-probs moved ±0.4 per
    token, so ratios fall on both sides of 1 ± 0.2): the module's loss, gradients and logs are the ops function's."""
    for model in (student, teacher):
        model.generation_config.eos_token_id = STOPS
    options = {"gamma": 1.0, "length_normalize": True, "baseline": "row", "clip_ratio": 0.2}
    module = make_module(student, teacher, tokenizer, policy_gradient=options)
    batch = sampled_batch(module, tokenizer)
    supervised = batch["labels"] != -100
    shift = 0.4 * torch.where(torch.rand(supervised.shape, generator=torch.Generator().manual_seed(5)) < 0.5, 1, -1)
    stale = {**batch, "sampled_logprobs": batch["sampled_logprobs"] + shift * supervised}
    loss, grads, logs = loss_and_grads(module, stale)
    expected, expected_grads, stats = ops_reference(student, teacher, stale, **options)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert 0 < stats.clipped_fraction.item() < 1
    assert logs["train/opd/clipped_fraction"] == pytest.approx(stats.clipped_fraction.item())
    assert abs(logs["train/opd/advantage_mean"]) < 1e-5  # the row baseline centres every row
    assert logs["train/opd/advantage_abs_mean"] == pytest.approx(stats.mean_abs_advantage.item(), rel=1e-5)
    assert logs["train/opd/advantage_abs_mean"] > 1e-3
    # each option changes the gradient: turning it off on the loss object gives the ops function without it
    for name, off in (("length_normalize", False), ("baseline", "none"), ("clip_ratio", None)):
        module.loss.policy_gradient = replace(module.loss.policy_gradient, **{name: off})
        changed, _, _ = loss_and_grads(module, stale)
        reference, _, _ = ops_reference(student, teacher, stale, **{**options, name: off})
        assert changed.item() == pytest.approx(reference.item(), rel=1e-5), name
        assert changed.item() != pytest.approx(loss.item(), rel=1e-3), name
        module.loss.policy_gradient = replace(module.loss.policy_gradient, **{name: options[name]})


def read_metrics(root) -> list[dict[str, str]]:
    with open(root / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def by_step(rows, key) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


OPD_KEYS = [
    *OPD_METRICS,
    "train/completion_length",
    "train/loss",
]


def fit(module, tokenizer, root, max_steps=3, **data_kwargs):
    data = ChatDataModule(
        tokenizer, addition_rows("train", 32), addition_rows("val", 8), batch_size=4, max_length=64, **data_kwargs
    )
    trainer = small_trainer(root, csv=True, max_steps=max_steps, limit_val_batches=1, val_check_interval=max_steps)
    trainer.fit(module, datamodule=data)
    return read_metrics(root)


def test_a_fit_with_grouped_generation_weights_the_stale_micro_batch(student, teacher, tokenizer, tmp_path):
    student.generation_config.eos_token_id = list(range(3, 150))  # short, uneven samples: trimmed micro-batches
    module = make_module(student, teacher, tokenizer, policy_gradient={"kl_coef": 0.5})
    module.sampler = recorder = Recording(module.sampler)
    trained_widths = []
    opd_loss = module.loss
    module.loss = LossOf(
        lambda student, batch: trained_widths.append(batch["input_ids"].shape[1]) or opd_loss(student, batch)
    )
    rows = fit(module, tokenizer, tmp_path, steps_per_generation=2)
    assert module.sampling_calls == 2  # steps 0-1 share one call, step 2 starts the next group
    group_widths = [recorder.widths[0], recorder.widths[0], recorder.widths[1]]
    assert any(a < b for a, b in zip(trained_widths, group_widths, strict=True))  # a micro-batch cut to its columns
    figures = ["train/teacher_top1_agreement", "train/teacher_mass_on_student_top5", "train/student_entropy"]
    for key in [*OPD_KEYS, "train/opd/divergence", *figures]:  # every OPD batch is the student's samples
        values = by_step(rows, key)
        assert sorted(values) == [0, 1, 2] and all(math.isfinite(v) for v in values.values()), key
    assert all(0.0 <= v <= 1.0 for v in by_step(rows, "train/opd/eos_rate").values())
    means, largest = by_step(rows, "train/opd/is_weight_mean"), by_step(rows, "train/opd/is_weight_max")
    for step in (0, 2):  # a group's first micro-batch: sampled by the weights it trains
        assert means[step] == pytest.approx(1.0, abs=1e-4) and largest[step] == pytest.approx(1.0, abs=1e-4)
    assert abs(means[1] - 1.0) > 1e-3 and largest[1] != pytest.approx(1.0, abs=1e-4)  # one step later: stale
    # the logged loss is the surrogate plus kl_coef times the full reverse KL, at fresh samples mean(−r) + 0.5·KL
    kl, divergence, loss = (
        by_step(rows, "train/opd/kl"),
        by_step(rows, "train/opd/divergence"),
        by_step(rows, "train/loss"),
    )
    assert loss[0] == pytest.approx(kl[0] + 0.5 * divergence[0], rel=1e-3)
    assert len(by_step(rows, "val/loss")) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy_gradient": {"gamma": 1.5}}, r"gamma .* must be in \[0, 1\], got 1\.5"),
        ({"policy_gradient": {"max_is_weight": 0}}, r"max_is_weight .* must be > 0, got 0"),
        ({"policy_gradient": {"kl_coef": -1.0}}, r"kl_coef .* must be >= 0, got -1\.0"),
        ({"divergence": {"sparse_loss": "k1"}}, r"sparse_loss=k1.*topk"),
        ({"teacher": {"kind": "cache", "path": "x"}}, r"teacher\.kind=cache.*teacher=server"),
        ({"sampling": {"temperature": 0.0}}, r"temperature must be > 0, got 0\.0"),
        ({"teacher": CacheTeacher.__new__(CacheTeacher)}, r"teacher\.kind=cache"),  # a built cache, unread
        ({"policy_gradient": {"baseline": "mean"}}, r"baseline must be 'none' .* or 'row' .*got 'mean'"),
        ({"policy_gradient": {"clip_ratio": 1.5}}, r"clip_ratio .* must be in \(0, 1\), e\.g\. 0\.2.*got 1\.5"),
        ({"policy_gradient": {"length_normalize": "true"}}, r"length_normalize must be true or false, got 'true'"),
        (
            {"policy_gradient": {"clip_ratio": 0.2, "importance_weights": False}},
            r"clip_ratio=0\.2 .*importance_weights=False.*",
        ),
    ],
)
def test_settings_refused_before_models_load(tokenizer, kwargs, match):
    teacher = kwargs.pop("teacher", "x")  # "x" is no model: an error about it would mean loading was attempted first
    with pytest.raises(ValueError, match=match):
        OPDModule("x", teacher, tokenizer, **kwargs)


@pytest.mark.parametrize("setting", ["lmbda", "seq_kd", "teacher_tokenizer", "cross_tokenizer"])
def test_opd_has_no_gkd_only_arguments(tokenizer, setting):
    """OPD trains on the student's own samples with the teacher's tokenizer: GKD's coin (lmbda), seq_kd and the
    cross-tokenizer settings are not OPD's arguments at all (Hydra: method=opd has no such keys)."""
    with pytest.raises(TypeError, match=setting):
        OPDModule("x", "x", tokenizer, **{setting: None})


def test_eos_rate_counts_rows_whose_last_supervised_token_is_an_eos():
    labels = torch.tensor([[-100, 5, 2, -100], [-100, 5, 6, 7], [-100, -100, 9, 2], [-100, -100, -100, -100]])
    assert eos_rate(labels, 2).item() == pytest.approx(2 / 3)
    assert eos_rate(labels, [7, 2]).item() == 1.0 and eos_rate(labels, None) is None


def test_several_teachers_each_score_their_own_rows(student, teacher, tokenizer):
    other = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=5)
    spec = {"kind": "multi", "column": "teacher", "teachers": {"a": {"kind": "local", "model": teacher}}}
    spec["teachers"]["b"] = {"kind": "local", "model": other}
    module = make_module(student, spec, tokenizer)
    names = ["a", "b", "b", "a", "b", "b"]
    batch = {**sampled_batch(module, tokenizer), "teacher": names}
    loss, _, logs = loss_and_grads(module, batch)
    parts = []
    for name, model in (("a", teacher), ("b", other)):
        single = make_module(student, model, tokenizer)
        rows = select_rows(batch, [i for i, value in enumerate(names) if value == name])
        part, _, part_logs = loss_and_grads(single, rows)
        parts.append((part.item(), part_logs["train/opd/reward"], int(supervised_positions(rows["labels"]).sum())))
    total = sum(n for *_, n in parts)
    assert loss.item() == pytest.approx(sum(v * n for v, _, n in parts) / total, rel=1e-5)
    assert logs["train/opd/reward"] == pytest.approx(sum(r * n for _, r, n in parts) / total, rel=1e-5)
    assert logs["train/teacher/b/tokens"] == parts[1][2]


@pytest.fixture(scope="module")
def toy():
    path = asset_path("toy/teacher")
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(asset_path("toy/student_init"), dtype=torch.float32)
    return student, teacher, load_tokenizer(path)


def test_a_served_teacher_gives_the_local_teachers_rewards_and_trains(toy, tmp_path):
    student, teacher, tokenizer = toy
    with FakeVLLMServer(teacher, tokenizer) as fake:
        spec = {"kind": "server", "url": fake.url, "top_k": 1, "retries": 2, "backoff": 0.01}
        served = make_module(student, spec, tokenizer, sampling={"max_new_tokens": 6})
        local = make_module(student, teacher, tokenizer, sampling={"max_new_tokens": 6})
        batch = sampled_batch(local, tokenizer)
        local_loss, local_grads, local_logs = loss_and_grads(local, batch)
        served_loss, served_grads, served_logs = loss_and_grads(served, batch)
        assert served_loss.item() == pytest.approx(local_loss.item(), rel=1e-4, abs=1e-5)
        assert served_logs["train/opd/reward"] == pytest.approx(local_logs["train/opd/reward"], rel=1e-4, abs=1e-5)
        for name, grad in served_grads.items():
            torch.testing.assert_close(grad, local_grads[name], rtol=1e-3, atol=1e-5, msg=name)
        rows = fit(served, tokenizer, tmp_path, max_steps=2)
    rewards = by_step(rows, "train/opd/reward")
    assert sorted(rewards) == [0, 1] and all(math.isfinite(v) and v < 0 for v in rewards.values())
    assert fake.count("/v1/completions") > 0


def test_a_served_sampler_with_raw_log_probs_is_refused_unless_the_weights_are_off(toy, tmp_path):
    """A sampler on the teacher server (off-policy samples, so the importance weights matter): vLLM's default raw
    log-probs are not those of temperature 0.7, so OPD refuses before a step; processed ones train."""
    student, teacher, tokenizer = toy
    sampling = {"max_new_tokens": 6, "temperature": 0.7, "eos_token_id": tokenizer.eos_token_id}
    for mode in ("raw_logprobs", "processed_logprobs"):
        with FakeVLLMServer(teacher, tokenizer, logprobs_mode=mode) as fake:
            served = ServerTeacher(fake.url, top_k=1, retries=2, backoff=0.01)
            sampler = ServerSampler(served, pad_token_id=tokenizer.pad_token_id, **sampling)
            module = make_module(
                copy.deepcopy(student), teacher, tokenizer, sampling={"sampler": sampler, "max_new_tokens": 6}
            )
            if mode == "raw_logprobs":
                with pytest.raises(ValueError, match=r"returns raw log-probs.*--logprobs-mode processed_logprobs"):
                    fit(module, tokenizer, tmp_path / mode, max_steps=1)
                assert module.global_step == 0
                module = make_module(
                    copy.deepcopy(student),
                    teacher,
                    tokenizer,
                    sampling={"sampler": sampler, "max_new_tokens": 6},
                    policy_gradient={"importance_weights": False},
                )
            rows = fit(module, tokenizer, tmp_path / f"{mode}-fit", max_steps=1)
            assert module.global_step == 1 and fake.count("/v1/completions") > 1
            weights = by_step(rows, "train/opd/is_weight_mean")
            assert weights and all(math.isfinite(value) for value in weights.values())
