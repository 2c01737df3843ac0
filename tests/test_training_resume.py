"""The Hydra run end to end: model card in the export, push_to_hub (HfApi replaced), and ckpt_path=last."""

import csv
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lightning_gkd.cli.hub import HubPushError
from lightning_gkd.cli.train import run
from lightning_gkd.training.checkpoint_io import CheckpointError
from lightning_gkd.training.resume import resolve_ckpt_path

FAST = [
    "model=tiny",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.test_data=null",
    "method.max_new_tokens=4",
    "method.eval_max_new_tokens=4",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "print_config=false",
    "~scheduler",
]


def compose_run(tmp_path: Path, name: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        cfg = compose(
            "train", return_hydra_config=True, overrides=[f"paths.cache_dir={tmp_path / 'cache'}", *FAST, *overrides]
        )
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "outputs" / "runs" / name)
    return cfg


def train_losses(run_dir: Path) -> list[int]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")]


class FakeApi:
    calls: list[tuple] = []

    def __init__(self, token=None):
        FakeApi.calls.append(("token", token))

    def create_repo(self, repo_id, **kwargs):
        FakeApi.calls.append(("create_repo", repo_id, kwargs["private"]))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        FakeApi.calls.append(("upload_folder", kwargs["repo_id"], kwargs["folder_path"]))


def test_card_push_and_resume_from_last(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_for_test")
    FakeApi.calls = []
    first = run(
        compose_run(
            tmp_path,
            "2026-01-01_00-00-00",
            ["trainer.max_steps=2", "push_to_hub=true", "hub_model_id=me/tiny-student", "hub_private_repo=true"],
        )
    )
    student = Path(first["student_dir"])
    card = (student / "README.md").read_text()
    assert "## Method: GKDModule" in card and "- lmbda: `0.5`" in card and "- steps: 2" in card
    assert f"- student: `{tmp_path / 'cache' / 'tiny-v1' / 'student'}`" in card
    assert "- teacher: `" in card and "lightning_gkd.data.toy.addition_rows(split=train)" in card
    assert "| val/loss |" in card and "hf_secret_for_test" not in card
    assert FakeApi.calls == [
        ("token", "hf_secret_for_test"),
        ("create_repo", "me/tiny-student", True),
        ("upload_folder", "me/tiny-student", str(student)),
    ]
    assert first["hub_url"] == "https://huggingface.co/me/tiny-student"
    first_ckpt = tmp_path / "outputs" / "runs" / "2026-01-01_00-00-00" / "checkpoints" / "last.ckpt"
    assert first_ckpt.is_file() and (first_ckpt.parent / "step2.ckpt").is_file()  # save_steps

    second_dir = tmp_path / "outputs" / "runs" / "2026-01-01_00-05-00"
    second = run(compose_run(tmp_path, second_dir.name, ["trainer.max_steps=4", "ckpt_path=last"]))
    assert second["resumed_from"] == str(first_ckpt)
    assert second["global_step"] == 4
    assert train_losses(second_dir) == [2, 3]  # only the steps after the checkpoint were trained
    assert "- resumed from: " in (Path(second["student_dir"]) / "README.md").read_text()


def test_last_picks_the_most_recent_other_run_and_explains_when_none(tmp_path):
    runs = tmp_path / "runs"
    with pytest.raises(CheckpointError, match=r"ckpt_path=last: no earlier run under .*runs' has checkpoints/last"):
        resolve_ckpt_path("last", runs / "now")
    import os

    for index, name in enumerate(["b_old", "a_new", "now"]):
        path = runs / name / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (1000 + index, 1000 + index))
    os.utime(runs / "a_new" / "checkpoints" / "last.ckpt", (5000, 5000))
    assert resolve_ckpt_path("last", runs / "now") == str(runs / "a_new" / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path("some/file.ckpt", runs / "now") == "some/file.ckpt"
    assert resolve_ckpt_path(None, runs / "now") is None


def test_push_settings_are_checked_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cfg = compose_run(tmp_path, "x", ["trainer.max_steps=2", "push_to_hub=true", "hub_model_id=me/x"])
    with pytest.raises(HubPushError, match="HF_TOKEN"):
        run(cfg)
    assert not (tmp_path / "outputs" / "runs" / "x").exists()
