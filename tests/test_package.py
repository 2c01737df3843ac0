"""The package's shape (lightning_gkd/__init__.py, docs/architecture.md): a lazy public API whose pure parts import
without Lightning, and one room per concern, each importing only the rooms below it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_gkd

PACKAGE = Path(lightning_gkd.__file__).parent

#: room -> the rooms its modules may import (docs/architecture.md draws the same arrows); cli may import any room
MAY_IMPORT: dict[str, set[str]] = {
    "ops": set(),
    "data": {"ops"},
    "evaluation": {"data", "ops"},
    "models": {"ops"},
    "samplers": {"models", "ops"},
    "teachers": {"data", "evaluation", "models", "ops", "samplers"},
    "training": {"evaluation", "models", "ops", "teachers"},
    "losses": {"data", "models", "ops", "rollouts", "teachers"},  # rollouts: a teacher renders tool schemas
    "rollouts": {"data", "ops"},
    # asynchronous rollouts: the producer, its engines and the weight snapshots they load
    "asynchronous": {"models", "ops", "samplers", "teachers"},
    "methods": {
        "asynchronous",
        "data",
        "evaluation",
        "losses",
        "models",
        "ops",
        "rollouts",
        "samplers",
        "teachers",
        "training",
    },
    "callbacks": {"evaluation", "methods", "models", "ops", "rollouts", "training"},
    # the shipped toy tasks and tiny-model builders: above the library, imported only by cli/ and conf/
    "toy": {"data", "evaluation", "models", "ops", "rollouts", "training"},
    # test doubles (a stand-in vLLM server) the tests and the studies share
    "testing": {"data", "models", "ops"},
    # studies and benchmarks built on the package: tables from sweeps of runs, report pages, bench models
    # cli: a study's run builds its method as the command line does (cli.compose.build_method, inside the run)
    "studies": {"asynchronous", "cli", "data", "evaluation", "models", "ops", "rollouts", "samplers", "toy"},
}


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
        "import lightning_gkd.ops.divergence.jsd",
        "from lightning_gkd import generalized_jsd_loss, preference_loss",
        "import lightning_gkd.ops.divergence.chunked_jsd, lightning_gkd.ops.decoding.sampling",
        "import lightning_gkd.ops.hf.forward, lightning_gkd.ops.hf.heads",
    ],
)
def test_the_pure_ops_import_without_lightning_or_the_data_stack(code):
    loaded = fresh_modules(code)
    assert "lightning_gkd.ops.divergence.jsd" in loaded or "lightning_gkd.ops.hf.forward" in loaded
    heavy = {"lightning", "lightning.pytorch", "datasets", "hydra", "transformers"} & loaded
    assert not heavy, heavy


def test_the_public_api_resolves_lazily_to_the_defining_modules():
    from lightning_gkd.data.chat import ChatDataModule
    from lightning_gkd.methods.gkd import GKDModule
    from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss
    from lightning_gkd.samplers.settings import SamplingSettings

    assert lightning_gkd.GKDModule is GKDModule
    assert lightning_gkd.ChatDataModule is ChatDataModule
    assert lightning_gkd.generalized_jsd_loss is generalized_jsd_loss
    assert lightning_gkd.SamplingSettings is SamplingSettings
    assert set(lightning_gkd.__all__) <= set(dir(lightning_gkd))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        lightning_gkd.NoSuchThing  # noqa: B018


def test_dir_lists_the_public_names_and_nothing_else():
    public = [
        "AsyncSettings",
        "ChatDataModule",
        "CrossTokenizerSettings",
        "DPOModule",
        "DivergenceSettings",
        "GKDModule",
        "OPDModule",
        "PolicyGradientSettings",
        "PreferenceDataModule",
        "RolloutSettings",
        "SFTModule",
        "SamplingSettings",
        "TrainingSettings",
        "ValidationSettings",
        "generalized_jsd_loss",
        "preference_loss",
    ]
    assert lightning_gkd.__all__ == public
    assert dir(lightning_gkd) == public
    lightning_gkd.GKDModule  # noqa: B018  (a name used once is cached in the module's globals)
    assert dir(lightning_gkd) == public


def test_every_room_is_checked():
    """A new folder of the package gets its arrows in MAY_IMPORT (cli and conf may import any room)."""
    rooms = {path.parent.name for path in PACKAGE.glob("*/__init__.py")} - {"cli", "conf"}
    assert rooms == set(MAY_IMPORT)


def imported_rooms(path: Path) -> set[str]:
    """The rooms of lightning_gkd a module imports (module level or inside functions)."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        rooms |= {name.split(".")[1] for name in names if name.startswith("lightning_gkd.")}
    return rooms


@pytest.mark.parametrize("room", sorted(MAY_IMPORT))
def test_each_room_imports_only_the_rooms_below_it(room):
    wrong = {}
    for path in sorted((PACKAGE / room).rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        allowed = {room} | MAY_IMPORT[room]
        if extra := imported_rooms(path) - allowed:
            wrong[name] = sorted(extra)
    assert wrong == {}


#: the rooms inside ops/ -> the ops rooms they may import (docs/architecture.md)
OPS_MAY_IMPORT: dict[str, set[str]] = {
    "constants": set(),
    "hf": set(),
    "divergence": {"constants", "hf"},
    "decoding": {"constants", "hf"},
    "cross_tokenizer": {"constants", "divergence", "hf"},
}


def imported_ops_rooms(path: Path) -> set[str]:
    """The rooms of lightning_gkd.ops a module imports."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        rooms |= {name.split(".")[2] for name in names if name.startswith("lightning_gkd.ops.")}
    return rooms


def test_the_rooms_inside_ops_import_only_the_rooms_below_them():
    ops = PACKAGE / "ops"
    assert {path.stem if path.is_file() else path.name for path in ops.iterdir() if path.name != "__init__.py"} - {
        "__pycache__"
    } == set(OPS_MAY_IMPORT)
    wrong = {}
    for path in sorted(ops.rglob("*.py")):
        relative = path.relative_to(ops)
        room = relative.parts[0].removesuffix(".py")
        if room == "__init__":
            continue
        if extra := imported_ops_rooms(path) - {room} - OPS_MAY_IMPORT[room]:
            wrong[str(relative)] = sorted(extra)
    assert wrong == {}


def test_ops_import_no_lightning():
    for path in (PACKAGE / "ops").rglob("*.py"):
        source = path.read_text()
        assert "import lightning\n" not in source and "from lightning." not in source, path.name


def test_no_module_paths_from_before_the_layout_resolve():
    """Nothing was released: the old module paths are gone, not aliased (no import hook, no re-exporting shims)."""
    for old in ("lightning_gkd.train", "lightning_gkd.modules.gkd", "lightning_gkd.chunked_jsd"):
        with pytest.raises(ModuleNotFoundError):
            __import__(old)
    assert not any(type(finder).__module__.startswith("lightning_gkd") for finder in sys.meta_path)
