"""The CausalLMModule contract: a method refuses a datamodule holding the other kind of rows, with a plain Trainer;
every method frees its gradients right after each optimizer step."""

import copy
import json
import subprocess
import sys

import lightning as L
import pytest
from helpers.fitting import small_trainer
from helpers.gradient_probe import GradientsAtBatchStart, StepAsLightningDoes
from helpers.launch import clean_env
from helpers.paths import HELPERS

from lightning_gkd import ChatDataModule, DPOModule, GKDModule, PreferenceDataModule
from lightning_gkd.methods.base import check_data_format
from lightning_gkd.toy.preference import addition_preference_rows


def test_gkd_refuses_preference_pairs_and_dpo_refuses_chat_rows_before_a_step(
    tmp_path, tokenizer, student, teacher, toy_rows
):
    pairs = PreferenceDataModule(tokenizer, addition_preference_rows("train", 8), batch_size=2)
    gkd = GKDModule(student, teacher, tokenizer, sampling={"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"GKDModule trains on chat rows .* holds preference pairs"):
        small_trainer(tmp_path, max_steps=1).fit(gkd, datamodule=pairs)
    assert gkd.global_step == 0
    dpo = DPOModule(student, tokenizer, reference=copy.deepcopy(student))
    with pytest.raises(ValueError, match=r"DPOModule trains on preference pairs .* holds chat rows"):
        small_trainer(tmp_path, max_steps=1).fit(
            dpo, datamodule=ChatDataModule(tokenizer, toy_rows["train"], batch_size=2)
        )


def test_datamodules_that_declare_no_format_and_matching_ones_pass(tokenizer, toy_rows):
    chat = ChatDataModule(tokenizer, toy_rows["train"])
    check_data_format(GKDModule, chat)
    check_data_format(GKDModule, L.LightningDataModule())  # a user's own datamodule: not checked
    check_data_format(DPOModule, PreferenceDataModule(tokenizer, addition_preference_rows("train", 4)))


def _method_and_data(kind, student, teacher, tokenizer, toy_rows, reference_step=False):
    from functools import partial

    import torch

    from lightning_gkd import OPDModule, SFTModule
    from lightning_gkd.samplers import KVCacheSampler

    training: dict = {"optimizer": partial(torch.optim.AdamW, lr=1e-2)}
    sampler = partial(KVCacheSampler, matmul_precision="highest")
    kwargs: dict = {}
    if kind == "dpo":
        cls, args = DPOModule, (student, tokenizer, copy.deepcopy(student))
        data = PreferenceDataModule(tokenizer, addition_preference_rows("train", 16), batch_size=4, max_length=64)
    else:
        cls = {"gkd": GKDModule, "opd": OPDModule, "sft": SFTModule}[kind]
        args = (student, tokenizer) if kind == "sft" else (student, teacher, tokenizer)
        if kind != "sft":
            kwargs["sampling"] = {"max_new_tokens": 4, "sampler": sampler}
            training["frozen_dtype"] = "float32"
        kwargs |= {"lmbda": 1.0} if kind == "gkd" else {}
        data = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64)
    if reference_step:
        cls = type(f"Reference{cls.__name__}", (StepAsLightningDoes, cls), {})
    return cls(*args, training=training, **kwargs), data


@pytest.mark.parametrize("kind", ["gkd", "opd", "sft", "dpo"])
def test_gradients_are_freed_after_each_step_and_training_is_unchanged(tmp_path, tokenizer, toy_rows, kind):
    """The previous step's gradients are gone before the next step samples and runs its forwards (they used to
    live until Lightning's zero_grad inside the next closure); losses and weights after 3 steps are those of
    Lightning's own step, bit for bit."""
    import torch

    from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

    runs = {}
    for reference in (False, True):
        student, teacher = (
            tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
            tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1),
        )
        module, data = _method_and_data(kind, student, teacher, tokenizer, toy_rows, reference_step=reference)
        probe, losses = GradientsAtBatchStart(), LossRecorder()
        small_trainer(tmp_path, max_steps=3, callbacks=[probe, losses]).fit(module, datamodule=data)
        runs[reference] = (probe.seen, losses.losses, [p.detach().clone() for p in student.parameters()])
    assert runs[False][0] == [False, False, False]
    assert runs[True][0] == [False, True, True]  # Lightning's own step: the last step's gradients linger
    assert runs[False][1] == runs[True][1] and len(runs[False][1]) == 3
    assert all(torch.equal(a, b) for a, b in zip(runs[False][2], runs[True][2], strict=True))


def test_gradients_are_kept_between_accumulated_micro_batches(tmp_path, tokenizer, student, teacher, toy_rows):
    module, data = _method_and_data("gkd", student, teacher, tokenizer, toy_rows)
    probe = GradientsAtBatchStart()
    small_trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, callbacks=[probe]).fit(module, datamodule=data)
    assert probe.seen == [False, True, False, True]  # freed at each real step, summed within the window


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


WORKER = HELPERS / "gradient_freeing_worker.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_gradients_are_freed_under_ddp_and_fsdp2(kind, tmp_path):
    """DDP and FSDP2 (ModelParallelStrategy), 2 gloo processes, lmbda 1: on every rank the gradients are gone when the
    next step starts sampling, and losses and trained weights equal Lightning's own step bit for bit."""
    out = tmp_path / "run"
    command = [sys.executable, str(WORKER), str(out), kind]
    done = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["world_size"] == 2
        assert result["strategy"] == {"ddp": "DDPStrategy", "fsdp": "ModelParallelStrategy"}[kind]
        assert result["grads_at_batch_start"] == [False, False, False]
        assert result["reference_grads_at_batch_start"] == [False, True, True]  # Lightning's step: they linger
        assert result["losses"] == result["reference_losses"] and len(result["losses"]) == 3
        if rank == 0:
            assert result["weights_compared"] > 0 and result["unequal"] == []


# -- the settings groups ------------------------------------------------------------------------------------------
def test_the_methods_defaults_are_the_values_before_the_groups():
    """GKD samples at TRL's temperature 0.9 with 128 new tokens and β 0.5; OPD samples at 1.0 with reverse KL; every
    method trains with AdamW at 5e-5 (None), seed 0, raise, step normalisation, auto frozen dtype, no dropout."""
    from lightning_gkd import OPDModule, SamplingSettings, SFTModule
    from lightning_gkd.evaluation import ValidationSettings
    from lightning_gkd.losses.settings import DivergenceSettings, PolicyGradientSettings
    from lightning_gkd.rollouts import RolloutSettings
    from lightning_gkd.training.settings import TrainingSettings

    assert GKDModule.default_sampling == SamplingSettings(temperature=0.9, top_k=0, top_p=1.0, max_new_tokens=128)
    assert GKDModule.default_divergence == DivergenceSettings(beta=0.5, loss_temperature=1.0, loss_chunk_size=64)
    assert OPDModule.default_sampling == SamplingSettings(temperature=1.0, max_new_tokens=128)
    assert OPDModule.default_divergence == DivergenceSettings(beta=1.0)
    assert OPDModule.default_policy_gradient == PolicyGradientSettings(gamma=0.0, max_is_weight=2.0, kl_coef=0.0)
    assert GKDModule.default_rollout == OPDModule.default_rollout == RolloutSettings()
    for method in (GKDModule, OPDModule, DPOModule, SFTModule):
        assert method.default_training == TrainingSettings(seed=0, nonfinite="raise", frozen_dtype="auto")
        assert method.default_validation == ValidationSettings(metrics={}, max_new_tokens=32)


def test_a_mapping_changes_the_methods_own_defaults_and_settings_are_taken_as_they_are(student, teacher, tokenizer):
    from lightning_gkd import OPDModule, SamplingSettings

    gkd = GKDModule(student, teacher, tokenizer, sampling={"max_new_tokens": 6}, training={"seed": 3})
    assert (gkd.sampling.temperature, gkd.sampling.max_new_tokens) == (0.9, 6)  # GKD's temperature kept
    assert gkd.divergence.beta == 0.5 and gkd.training_settings.seed == 3
    assert gkd.training_settings.nonfinite == "raise" and gkd.validation.max_new_tokens == 32
    opd = OPDModule(student, teacher, tokenizer, sampling={"max_new_tokens": 6}, policy_gradient={"kl_coef": 0.5})
    assert (opd.sampling.temperature, opd.sampling.max_new_tokens) == (1.0, 6)  # OPD's temperature kept
    assert opd.divergence.beta == 1.0 and opd.policy_gradient.kl_coef == 0.5 and opd.policy_gradient.gamma == 0.0
    given = SamplingSettings(temperature=0.5, max_new_tokens=4)
    assert OPDModule(student, teacher, tokenizer, sampling=given).sampling is given
    assert GKDModule(student, teacher, tokenizer).sampling == GKDModule.default_sampling  # None: the defaults


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"sampling": {"temprature": 1.0}},
            ValueError,
            r"sampling: unknown key\(s\) temprature; it takes temperature,",
        ),
        ({"training": {"lr": 1e-3}}, ValueError, r"training: unknown key\(s\) lr; it takes optimizer, scheduler"),
        ({"divergence": 0.5}, TypeError, r"divergence must be a DivergenceSettings, a mapping of its fields or None"),
        ({"validation": {"max_new_tokens": 0}}, ValueError, r"validation\.max_new_tokens must be an integer >= 1"),
        ({"training": {"nonfinite": "ignore"}}, ValueError, r"training\.nonfinite must be 'raise' or 'skip'"),
    ],
)
def test_a_group_is_checked_before_any_model_loads(tokenizer, kwargs, error, match):
    with pytest.raises(error, match=match):
        GKDModule("x", "x", tokenizer, **kwargs)  # "x" is no model: an error about it would mean loading came first


def test_dpo_refuses_a_loss_normalization_its_loss_does_not_read(tokenizer):
    with pytest.raises(ValueError, match=r"DPOModule\(training\.loss_normalization='micro_batch'\): the DPO loss is"):
        DPOModule("x", tokenizer, "x", training={"loss_normalization": "micro_batch"})


def test_the_hyperparameters_record_each_group_as_plain_values_and_load_back(student, teacher, tokenizer, tmp_path):
    """Objects (the sampler, the optimizer, the metrics) stay out; a weights-only checkpoint loads, and
    ``load_from_checkpoint`` makes the same groups from the record."""
    from functools import partial

    import torch

    from lightning_gkd.evaluation import exact_match
    from lightning_gkd.samplers import KVCacheSampler

    module = GKDModule(
        student,
        teacher,
        tokenizer,
        lmbda=0.25,
        sampling={"max_new_tokens": 6, "sampler": partial(KVCacheSampler, matmul_precision="highest")},
        divergence={"beta": 0.1},
        training={"optimizer": partial(torch.optim.SGD, lr=0.1), "seed": 7},
        validation={"metrics": {"accuracy": exact_match}},
    )
    hparams = dict(module.hparams)
    assert hparams["lmbda"] == 0.25 and hparams["seq_kd"] is False
    assert hparams["sampling"] == {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "max_new_tokens": 6}
    assert hparams["divergence"]["beta"] == 0.1 and hparams["training"]["seed"] == 7
    assert "optimizer" not in hparams["training"] and hparams["validation"] == {"max_new_tokens": 32}
    assert hparams["cross_tokenizer"]["enabled"] == "auto"
    assert {"student", "teacher", "tokenizer", "loss", "teacher_tokenizer"}.isdisjoint(hparams)
    path = tmp_path / "module.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams, "pytorch-lightning_version": "2"}, path)
    assert torch.load(path, weights_only=True)["hyper_parameters"] == hparams
    loaded = GKDModule.load_from_checkpoint(path, student=student, teacher=teacher, tokenizer=tokenizer)
    assert loaded.sampling.max_new_tokens == 6 and loaded.divergence.beta == 0.1 and loaded.lmbda == 0.25
    assert loaded.training_settings.seed == 7 and loaded.sampling.temperature == 0.9


def test_settings_group_and_plain_settings():
    from lightning_gkd.losses.settings import DivergenceSettings
    from lightning_gkd.methods.base import plain_settings, settings_group

    default = DivergenceSettings(beta=1.0)
    assert settings_group(None, default, "divergence") is default
    assert settings_group({"loss_chunk_size": 8}, default, "divergence") == DivergenceSettings(
        beta=1.0, loss_chunk_size=8
    )
    assert plain_settings(default) == {
        "beta": 1.0,
        "loss_temperature": 1.0,
        "sparse_loss": "topk",
        "lean_loss": True,
        "loss_chunk_size": 64,
    }
    assert plain_settings({"a": (1, "x"), "f": len, "nested": {"g": [len]}}) == {"a": [1, "x"]}  # objects stay out
