"""The manifest's commands and the offline room's pointers (lightning_gkd/teachers/offline/manifest.py): what an
error tells a user to run or import must exist."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import lightning_gkd.teachers.offline as offline
from lightning_gkd.teachers.offline.manifest import resume_hint

DOTTED = re.compile(r"lightning_gkd(?:\.\w+)+")


def resolve(dotted: str) -> object:
    """The module, or the attribute of the longest importable module prefix, that ``dotted`` names."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(dotted)


def test_the_resume_hint_names_a_build_function_that_exists(tmp_path):
    (named,) = DOTTED.findall(resume_hint(tmp_path))
    assert callable(resolve(named)) and named.endswith(".build_teacher_cache")


@pytest.mark.parametrize("module", sorted(p.name for p in Path(offline.__file__).parent.glob("*.py")))
def test_every_dotted_path_the_room_names_exists(module):
    """Every ``lightning_gkd.<room>...`` in the room's code and docstrings (not the format's own names, as
    ``lightning_gkd.teacher_cache``, which are no module paths)."""
    source = (Path(offline.__file__).parent / module).read_text()
    rooms = {path.parent.name for path in Path(offline.__file__).parents[2].glob("*/__init__.py")}
    for dotted in sorted(set(DOTTED.findall(source))):
        if dotted.split(".")[1] in rooms:
            resolve(dotted)
