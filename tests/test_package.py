"""The package's shape (lightning_gkd/__init__.py, lightning_gkd/_compat.py): a lazy public API whose pure parts
import without Lightning, one room per concern, and the module paths from before the restructure still working."""

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import hydra.utils
import pytest

import lightning_gkd
from lightning_gkd._compat import MOVED

PACKAGE = Path(lightning_gkd.__file__).parent


def fresh_modules(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "code",
    [
        "import lightning_gkd.ops.losses",
        "from lightning_gkd import generalized_jsd_loss, preference_loss",
        "import lightning_gkd.ops.chunked_jsd, lightning_gkd.ops.sampling, lightning_gkd.ops.hf",
    ],
)
def test_the_pure_ops_import_without_lightning_or_the_data_stack(code):
    loaded = fresh_modules(code)
    assert "lightning_gkd.ops.losses" in loaded or "lightning_gkd.ops.hf" in loaded
    heavy = {"lightning", "lightning.pytorch", "datasets", "hydra", "transformers"} & loaded
    assert not heavy, heavy


def test_the_public_api_resolves_lazily_to_the_defining_modules():
    from lightning_gkd.data.chat import ChatDataModule
    from lightning_gkd.methods.gkd import GKDModule
    from lightning_gkd.ops.losses import generalized_jsd_loss

    assert lightning_gkd.GKDModule is GKDModule
    assert lightning_gkd.ChatDataModule is ChatDataModule
    assert lightning_gkd.generalized_jsd_loss is generalized_jsd_loss
    assert set(lightning_gkd.__all__) <= set(dir(lightning_gkd))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        lightning_gkd.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_module_path_is_the_new_module_and_warns(old, new, monkeypatch):
    module = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}"):
        legacy = importlib.import_module(old)
    assert legacy is module


@pytest.mark.parametrize(
    "old_target, new_home",
    [
        ("lightning_gkd.signals.SignalCheckpoint", "lightning_gkd.callbacks.signal_checkpoint"),
        ("lightning_gkd.sample_table.SampleTable", "lightning_gkd.callbacks.sample_table"),
        ("lightning_gkd.held_out_eval.HeldOutEvaluation", "lightning_gkd.callbacks.held_out_eval"),
        ("lightning_gkd.export_callback.HFExportCallback", "lightning_gkd.callbacks.hf_export"),
        ("lightning_gkd.callbacks.PrintMetricsCallback", "lightning_gkd.callbacks.print_metrics"),
        ("lightning_gkd.modules.gkd.GKDModule", "lightning_gkd.methods.gkd"),
        ("lightning_gkd.modules.dpo.DPOModule", "lightning_gkd.methods.dpo"),
        ("lightning_gkd.data.datamodule.ChatDataModule", "lightning_gkd.data.chat"),
        ("lightning_gkd.data.preference_datamodule.PreferenceDataModule", "lightning_gkd.data.preference"),
        ("lightning_gkd.data.toy_preference.addition_preference_rows", "lightning_gkd.data.toy.preference"),
        ("lightning_gkd.data.toy.addition_rows", "lightning_gkd.data.toy.addition"),
        ("lightning_gkd.assets.write_tiny_models", "lightning_gkd.models.tiny"),
        ("lightning_gkd.models.load_causal_lm", "lightning_gkd.models.loading"),
        ("lightning_gkd.evaluation.exact_match", "lightning_gkd.evaluation.metrics"),
        ("lightning_gkd.train.run", "lightning_gkd.cli.train"),
    ],
)
def test_hydra_targets_written_for_the_old_layout_still_resolve(old_target, new_home):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        resolved = hydra.utils.get_object(old_target)
    assert resolved is getattr(importlib.import_module(new_home), old_target.rsplit(".", 1)[1])


def test_python_dash_m_of_the_old_entry_point_still_runs():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_gkd.train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Override anything in the config" in out.stdout


def test_no_package_file_is_over_400_lines():
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 400} == {}


def test_ops_import_nothing_from_the_training_rooms():
    for path in (PACKAGE / "ops").glob("*.py"):
        source = path.read_text()
        for room in ("methods", "training", "callbacks", "cli", "data", "models", "evaluation"):
            assert f"lightning_gkd.{room}" not in source, (path.name, room)
        assert "import lightning\n" not in source and "from lightning." not in source, path.name
