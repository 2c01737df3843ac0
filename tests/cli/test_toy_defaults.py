"""Toy-tuned values meeting a real model are named before anything loads; the real-use presets clear them all."""

import inspect
import json

import pytest
from helpers.hydra_compose import FAST, compose_train
from hydra.utils import get_object

from lightning_gkd.cli.toy_defaults import is_toy_model, toy_defaults_for_real_model
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, asset_path, tiny_causal_lm


@pytest.fixture()
def own_models(tmp_path, tokenizer):
    """A user's own model folders (outside the package and paths.cache_dir), with their tokenizer."""
    folders = {}
    for role, config in (("student", TINY_STUDENT), ("teacher", TINY_TEACHER)):
        folder = tmp_path / "models" / role
        tiny_causal_lm(config, tokenizer, seed=0).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[role] = str(folder)
    return folders


def _real(folders):
    return [
        "model=hub",
        f"model.student.name_or_path={folders['student']}",
        f"model.teacher.name_or_path={folders['teacher']}",
    ]


def test_toy_models_are_recognised(tmp_path):
    assert is_toy_model({"name_or_path": asset_path("toy/student_init")}, None)
    assert is_toy_model({"name_or_path": str(tmp_path / "cache" / "tiny-v1" / "student")}, str(tmp_path / "cache"))
    assert is_toy_model({"config": {"model_type": "qwen2"}}, None)
    assert not is_toy_model({"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}, str(tmp_path / "cache"))
    assert toy_defaults_for_real_model(compose_train(tmp_path, [])) == []  # the default job
    assert toy_defaults_for_real_model(compose_train(tmp_path, ["model=tiny"])) == []


def test_each_toy_value_is_named_for_a_real_student(tmp_path, own_models):
    rows = tmp_path / "train.jsonl"
    rows.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    )
    cfg = compose_train(
        tmp_path, [*_real(own_models), "data=chat_files", f"data.train_data={rows}", "trainer.max_steps=5000"]
    )
    found = "\n".join(toy_defaults_for_real_model(cfg))
    assert "optimizer.lr=0.001 is the toy models' rate" in found
    assert "method.sampling.max_new_tokens=8: every on-policy or teacher sample is cut after 8 tokens" in found
    assert "method.validation.max_new_tokens=8" in found
    assert "method.validation.metrics.accuracy is exact match" in found
    assert "scheduler.num_warmup_steps=20 is 0.4% of trainer.max_steps=5000" in found
    assert "trainer=cpu in float32" in found
    # toy data keeps its exact-match metric; off-policy GKD (lmbda 0) samples nothing during training
    found = "\n".join(toy_defaults_for_real_model(compose_train(tmp_path, [*_real(own_models), "method.lmbda=0"])))
    assert "exact match" not in found and "method.sampling.max_new_tokens=8" not in found and "optimizer.lr" in found


@pytest.mark.parametrize(
    ("overrides", "method"),
    [
        (["experiment=hub_gpu"], "GKDModule"),
        (["experiment=hub_gpu", "method=opd"], "OPDModule"),
        (["experiment=hub_gpu_sft"], "SFTModule"),
        (["experiment=hub_gpu_dpo"], "DPOModule"),
    ],
)
def test_the_real_use_presets_leave_no_toy_value_and_fit_their_method(tmp_path, own_models, overrides, method):
    cfg = compose_train(tmp_path, [*_real(own_models), *overrides, "data.train_data=train.jsonl"])
    assert toy_defaults_for_real_model(cfg) == []
    assert cfg.method._target_ == f"lightning_gkd.{method}"
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.accelerator == "gpu"
    assert cfg.scheduler.warmup_ratio == 0.05 and cfg.scheduler.num_warmup_steps is None
    assert cfg.model.student.init_kwargs.dtype == "float32" and cfg.method.validation.metrics is None
    # every method key is an argument of the method: no toy key the class would reject
    accepted: set[str] = set()
    for cls in get_object(cfg.method._target_).__mro__:  # **kwargs pass on to the parent's arguments
        params = inspect.signature(cls.__init__).parameters if "__init__" in vars(cls) else {}
        accepted |= set(params)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    assert set(cfg.method) - {"_target_"} <= accepted
    expected_lr = {"GKDModule": 1e-5, "OPDModule": 1e-5, "SFTModule": 2e-5, "DPOModule": 1e-6}[method]
    assert cfg.optimizer.lr == expected_lr


def test_a_run_with_a_real_student_warns_before_training(tmp_path, own_models):
    from lightning_gkd.cli.train import run

    with pytest.warns(UserWarning, match=r"is not one of the toy models, but these values are tuned for the toy task"):
        run(compose_train(tmp_path, [*_real(own_models), *FAST, "callbacks=none", "export=false"]))


@pytest.mark.parametrize(
    ("overrides", "precision"),
    [
        ([], "32-true"),
        (["trainer=gpu"], "bf16-mixed"),
        (["trainer=ddp"], "32-true"),
        (["experiment=hub_gpu", "trainer=ddp"], "bf16-mixed"),  # the preset's precision holds under another trainer
        (["experiment=hub_gpu", "trainer=fsdp"], "bf16-mixed"),
        (["experiment=hub_gpu_dpo", "trainer=cpu"], "bf16-mixed"),
        (["experiment=hub_gpu", "precision=32-true"], "32-true"),
        (["trainer=ddp", "precision=bf16-true"], "bf16-true"),
        (["experiment=hub_gpu", "trainer=ddp", "trainer.precision=16-mixed"], "16-mixed"),  # the trainer's key wins
    ],
)
def test_precision_is_its_own_choice_apart_from_the_trainer(tmp_path, overrides, precision):
    cfg = compose_train(tmp_path, overrides)
    assert cfg.trainer.precision == precision
