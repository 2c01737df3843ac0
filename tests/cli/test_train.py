"""The Hydra entry point, composed in-process and run as a real command in a temp dir."""

import csv
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from helpers.hydra_compose import FAST, compose_train
from helpers.paths import ROOT
from transformers import AutoModelForCausalLM

from lightning_gkd.cli.train import run


def test_every_config_group_option_composes(tmp_path):
    conf = ROOT / "conf"
    groups = ["model", "data", "method", "teacher", "cross_tokenizer", "optimizer", "scheduler", "trainer"]
    groups += ["callbacks", "logger"]
    for group in [*groups, "experiment"]:
        for option in sorted(p.stem for p in (conf / group).glob("*.yaml")):
            cfg = compose_train(tmp_path, [f"{group}={option}"])
            assert group in cfg or group == "experiment", (group, option)
    assert compose_train(tmp_path, ["experiment=debug"]).trainer.max_steps == 4
    cfg = compose_train(tmp_path, ["model=hub", "data=hub", "data.train_data=trl-lib/tldr"])
    assert cfg.method.teacher.kind == "local"
    assert cfg.method.teacher.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert cfg.method.student.trust_remote_code is False


def test_the_readme_teacher_overrides_compose_into_specs(tmp_path):
    from omegaconf import OmegaConf

    from lightning_gkd.teachers.spec import teacher_plan

    cfg = compose_train(
        tmp_path,
        [
            "teacher=multi",
            "+teacher.teachers.math={kind: local, model: {name_or_path: /models/math}}",
            '+teacher.teachers.code={kind: server, url: "http://gpu-host:8000", top_k: 20}',
            "~teacher.teachers.default",
        ],
    )
    plan = teacher_plan(OmegaConf.to_container(cfg.method.teacher, resolve=True))
    assert plan.column == "teacher" and list(plan.entries) == ["math", "code"]
    assert plan.entries["code"].kind == "server" and plan.entries["code"].top_k == 20
    cfg = compose_train(tmp_path, ["teacher=cache", "teacher.path=/caches/k20", "method.lmbda=0"])
    assert OmegaConf.to_container(cfg.method.teacher) == {"kind": "cache", "path": "/caches/k20", "top_k": None}
    assert compose_train(tmp_path, []).method.teacher.model.name_or_path == cfg.model.teacher.name_or_path


def test_fsdp_trainer_config_composes(tmp_path):
    """trainer=fsdp (its runs: tests/models/test_sharding.py, multi-process)."""
    cfg = compose_train(tmp_path, ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"])
    strategy = cfg.trainer.strategy
    assert strategy._target_ == "lightning.pytorch.strategies.ModelParallelStrategy"
    assert strategy.data_parallel_size == 2 and strategy.tensor_parallel_size == 1
    assert strategy.save_distributed_checkpoint is False and cfg.trainer.gradient_clip_val == 1.0


def test_composed_run_with_overrides(tmp_path):
    cfg = compose_train(
        tmp_path,
        [
            *FAST,
            "method.lmbda=1.0",
            "method.divergence.beta=0.9",
            "optimizer=sgd",
            "scheduler=linear",
            "scheduler.num_warmup_steps=1",
        ],
    )
    assert cfg.method.lmbda == 1.0 and cfg.method.divergence.beta == 0.9 and cfg.data.batch_size == 4
    result = run(cfg)
    assert result["global_step"] == 3
    assert result["metrics"]["train/on_policy"] == 1.0
    assert torch.isfinite(torch.tensor(result["metrics"]["val/loss"]))
    run_dir = tmp_path / "run"
    with open(run_dir / "logs" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["train/on_policy"]) for r in rows if r.get("train/on_policy")] == [1.0, 1.0, 1.0]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    student = AutoModelForCausalLM.from_pretrained(result["student_dir"])
    assert student.config.hidden_size == 64 and result["student_dir"] == str(run_dir / "student")


@pytest.mark.parametrize("method", ["gkd", "opd"])
def test_the_method_groups_compose_into_the_settings_and_train(method, tmp_path):
    """The config mirrors the constructors: method.<group>.<key> reaches the module's settings group (the optimizer,
    the scheduler and the sampler as objects Hydra made), the method's own defaults fill the rest, and a real Trainer
    fits with them."""
    from omegaconf import OmegaConf

    from lightning_gkd.cli.train import build, fit
    from lightning_gkd.samplers import KVCacheSampler
    from lightning_gkd.training.schedulers import WarmupSchedule

    overrides = [*FAST, f"method={method}", "method.sampling.top_k=5", "method.divergence.loss_chunk_size=8"]
    overrides += ["method.training.gradient_checkpointing=true", "method.validation.max_new_tokens=5"]
    overrides += ["method.policy_gradient.kl_coef=0.5"] if method == "opd" else ["method.lmbda=1.0"]
    overrides += ["optimizer=sgd", "scheduler=linear", "scheduler.num_warmup_steps=1", "callbacks=none"]
    cfg = compose_train(tmp_path, overrides)
    groups = OmegaConf.to_container(cfg.method, resolve=True)
    assert set(groups["sampling"]) == {"sampler", "temperature", "max_new_tokens", "top_k", "top_p"}
    assert groups["training"]["optimizer"]["_target_"] == "torch.optim.SGD" and groups["training"]["seed"] == 42
    built = build(cfg)
    module = built.module
    assert (module.sampling.temperature, module.divergence.beta) == ((1.0, 1.0) if method == "opd" else (0.9, 0.5))
    assert module.sampling.max_new_tokens == 6 and module.sampling.top_k == 5 and module.divergence.loss_chunk_size == 8
    assert isinstance(module.sampler, KVCacheSampler) and module.sampler.top_k == 5
    assert isinstance(module.training_settings.scheduler, WarmupSchedule) and module.training_settings.seed == 42
    assert module.training_settings.gradient_checkpointing and module.validation.max_new_tokens == 5
    assert set(module.validation.metrics) == {"accuracy"}
    if method == "opd":
        assert module.policy_gradient.kl_coef == 0.5 and module.loss.policy_gradient is module.policy_gradient
    else:
        assert module.lmbda == 1.0 and module.loss.divergence is module.divergence
    result = fit(built)
    assert result["global_step"] == 3 and isinstance(built.trainer.optimizers[0], torch.optim.SGD)
    assert torch.isfinite(torch.tensor(result["metrics"]["train/loss"]))
    assert built.module.hparams["sampling"]["top_k"] == 5  # the checkpoint's record: plain values


def test_chat_files_data_from_the_command_line(tmp_path, toy_rows):
    import json

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"messages": r["messages"]}) for r in toy_rows["train"][:12]))
    cfg = compose_train(
        tmp_path,
        [*FAST, "data=chat_files", f"data.train_data={data}", "method.lmbda=0.0", "callbacks=none", "export=false"],
    )
    result = run(cfg)
    assert result["global_step"] == 3 and result["student_dir"] is None
    assert "val/loss" not in result["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["module", "console_script"])
def test_command_line_entry_points(tmp_path, launcher):
    if launcher == "module":
        command = [sys.executable, "-m", "lightning_gkd.cli.train"]
    else:
        (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "lightning-gkd"]
        assert script.value == "lightning_gkd.cli.train:main"
        command = [str(Path(sys.executable).parent / "lightning-gkd")]
    result = subprocess.run(
        [
            *command,
            "experiment=debug",
            "method.lmbda=1.0",
            f"paths.cache_dir={tmp_path}/c",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "== lightning_gkd summary ==" in result.stdout and "train/on_policy_fraction: 1.0000" in result.stdout
    assert "config: experiment=debug method.lmbda=1.0" in result.stdout  # the config's line: the overrides
    assert (tmp_path / "run" / "student" / "model.safetensors").is_file()
    card = (tmp_path / "run" / "student" / "README.md").read_text()  # the model card of the default run
    assert "## Method: GKDModule" in card and "- lmbda: `1.0`" in card and "- steps: 4" in card
    assert (tmp_path / "run" / "logs" / "metrics.csv").is_file()


@pytest.mark.slow
def test_the_console_script_imports_modules_from_the_folder_it_was_started_in(tmp_path):
    """A user's metric (or formatting_func, callback, any _target_) in the launch folder imports without
    PYTHONPATH=., as under ``python -m``."""
    (tmp_path / "my_metrics.py").write_text("def half(predictions, references):\n    return 0.5\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "lightning-gkd"),
            "experiment=debug",
            "+method.validation.metrics.half._target_=my_metrics.half",
            "+method.validation.metrics.half._partial_=true",
            "callbacks.held_out_eval=null",
            "callbacks.sample_table=null",
            "export=false",
            f"paths.cache_dir={tmp_path}/c",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val/half: 0.5000" in result.stdout


def test_float32_matmul_precision_holds_for_the_run_and_is_restored(tmp_path, monkeypatch):
    import lightning_gkd.cli.train as train_cli

    seen = []
    real_fit = train_cli.fit

    def recording_fit(built):
        seen.append(torch.get_float32_matmul_precision())
        return real_fit(built)

    monkeypatch.setattr(train_cli, "fit", recording_fit)
    before = torch.get_float32_matmul_precision()
    cfg = compose_train(tmp_path, [*FAST, "trainer.max_steps=1", "float32_matmul_precision=medium", "export=false"])
    assert run(cfg)["global_step"] == 1
    assert seen == ["medium"] and torch.get_float32_matmul_precision() == before
    bad = compose_train(tmp_path, [*FAST, "float32_matmul_precision=bf16"])
    with pytest.raises(ValueError, match="matmul_precision must be one of .* got 'bf16'"):
        run(bad)
    assert compose_train(tmp_path, []).float32_matmul_precision is None
