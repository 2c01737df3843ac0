"""Safety: weights-only checkpoint loading, atomic checkpoint and model writes, no remote code or pickle by
default."""

from __future__ import annotations

import copy
import os
import pickle
import re
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer
from helpers.paths import ROOT
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_gkd import DPOModule, GKDModule, PreferenceDataModule
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.toy.preference import addition_preference_rows
from lightning_gkd.training.checkpoint_io import (
    CheckpointError,
    SafeCheckpointIO,
    use_safe_checkpoint_io,
    write_folder_atomically,
)

PACKAGE = ROOT / "lightning_gkd"
CONF = ROOT / "conf"


class Payload:
    """Unpickling this runs code: it touches ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("asked", [None, False])
def test_checkpoints_are_loaded_weights_only_even_when_asked_otherwise(tmp_path, asked):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "extra": Payload(marker)}, path)
    with pytest.raises(
        CheckpointError,
        match=r"Cannot load checkpoint '.*evil\.ckpt' \(UnpicklingError.*\)\. It "
        r"holds Python objects that weights-only loading refuses",
    ):
        SafeCheckpointIO().load_checkpoint(path, weights_only=asked)
    assert not marker.exists()
    torch.save({"state_dict": {"w": torch.ones(2)}, "hparams": {"lr": 0.1, "name": "x"}}, path)
    assert SafeCheckpointIO().load_checkpoint(path)["hparams"] == {"lr": 0.1, "name": "x"}


def test_checkpoint_writes_are_atomic(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    io = SafeCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.zeros(3)}, path)
    good = path.read_bytes()
    # the save dies half-way: torch.save cannot write a local lambda (PicklingError, or AttributeError from the
    # pure-Python pickler torch may use)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        io.save_checkpoint({"global_step": 2, "w": torch.ones(3), "bad": lambda: None}, path)
    assert path.read_bytes() == good
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file left behind
    assert io.load_checkpoint(path)["global_step"] == 1


def test_the_command_line_trainer_gets_the_safe_checkpoint_io(tmp_path):
    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO
    assert use_safe_checkpoint_io(trainer) and isinstance(trainer.strategy.checkpoint_io, SafeCheckpointIO)
    custom = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, plugins=[AsyncCheckpointIO()])
    assert not use_safe_checkpoint_io(custom)  # someone chose their own: left alone
    assert isinstance(custom.strategy.checkpoint_io, AsyncCheckpointIO)


def test_dpo_cached_reference_logps_resume_through_weights_only_loading(student, tokenizer, tmp_path):
    pairs = addition_preference_rows("train", 16)

    def fit(max_steps, ckpt_path=None):
        module = DPOModule(
            copy.deepcopy(student),
            tokenizer,
            precompute_ref_logps=True,
            training={"optimizer": partial(torch.optim.AdamW, lr=1e-3)},
        )
        trainer = small_trainer(tmp_path, max_steps=max_steps, enable_checkpointing=True, plugins=[SafeCheckpointIO()])
        trainer.fit(module, datamodule=PreferenceDataModule(tokenizer, pairs, batch_size=4), ckpt_path=ckpt_path)
        return module, trainer

    first, trainer = fit(2)
    checkpoint = Path(trainer.checkpoint_callback.best_model_path)
    stored = SafeCheckpointIO().load_checkpoint(checkpoint)
    assert torch.equal(stored["dpo_reference_logps"]["train"], first.reference_logps_cache["train"])
    assert stored["hyper_parameters"]["precompute_ref_logps"] is True
    resumed, trainer = fit(3, ckpt_path=checkpoint)
    assert trainer.global_step == 3
    assert torch.equal(resumed.reference_logps_cache["train"], first.reference_logps_cache["train"])


def test_remote_code_is_off_unless_asked(student, teacher, tokenizer, tmp_path, monkeypatch):
    assert GKDModule(student, teacher, tokenizer).hparams.training["trust_remote_code"] is False
    calls = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda name, **kw: calls.append(kw) or tokenizer)
    load_tokenizer("org/tokenizer")
    assert calls == [{"revision": None, "trust_remote_code": False}]
    enabled = [
        str(p.relative_to(CONF))
        for p in CONF.rglob("*.yaml")
        if re.search(r"trust_remote_code:\s*true", p.read_text(), re.IGNORECASE)
    ]
    assert enabled == []


def test_no_pickle_loading_anywhere_in_the_package():
    offending = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for pattern in (
            r"pickle\.loads?\(",
            r"weights_only\s*=\s*False",
            r"import dill",
            r"torch\.load\((?![^)]*"
            r"weights_only\s*=\s*True)",
        ):
            offending += [
                f"{path.name}: {m.group(0)}"
                for m in re.finditer(pattern, text)
                # saving the full state (Trainer.save_checkpoint(..., weights_only=False)) is not loading
                if "save_checkpoint(" not in text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
            ]
    assert offending == []


def test_an_interrupted_export_keeps_the_previous_model(student, teacher, tokenizer, tmp_path, monkeypatch):
    module = GKDModule(student, teacher, tokenizer)
    target = module.export(tmp_path / "student")
    before = (target / "model.safetensors").read_bytes()
    with torch.no_grad():
        next(module.student.parameters()).add_(1.0)

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the tokenizer")

    monkeypatch.setattr(type(tokenizer), "save_pretrained", dies)
    with pytest.raises(KeyboardInterrupt):
        module.export(tmp_path / "student")
    assert (target / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]  # no half-written folder left
    assert AutoModelForCausalLM.from_pretrained(target).config.hidden_size == 64


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_folders_written_atomically_follow_the_umask(tmp_path, umask):
    """An export folder is as readable as any folder the user makes (shared clusters: group/others can read it under
    umask 022), not mkdtemp's owner-only 0700."""
    before = os.umask(umask)
    try:
        target = write_folder_atomically(tmp_path / "export", lambda staging: (staging / "f.txt").write_text("x"))
    finally:
        os.umask(before)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (target / "f.txt").read_text() == "x"
