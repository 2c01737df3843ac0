"""Command-line entry points: ``lightning-gkd`` (Hydra: build -> fit -> finish) and the hub push."""

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

_T = TypeVar("_T")


def put_launch_folder_on_path() -> None:
    """Make modules in the folder a command was started from importable, as ``python -m`` does: a console script
    (``lightning-gkd``) puts only its own bin folder on ``sys.path``, so a user's ``formatting_func``, ``_target_`` or
    callback module next to their data would not import without ``PYTHONPATH=.``."""
    import os
    import sys

    folder = os.getcwd()
    if folder not in sys.path and "" not in sys.path:
        sys.path.insert(0, folder)


def tokenizer_source(model: Mapping[str, Any]) -> str:
    """The tokenizer of a ``model:`` config: ``model.tokenizer``, or when it is null the student's own folder or hub id
    (so overriding ``model.student.name_or_path`` alone never pairs the new student with the old model's tokenizer)."""
    if model.get("tokenizer"):
        return str(model["tokenizer"])
    student = model.get("student")
    if isinstance(student, Mapping) and student.get("name_or_path"):
        return str(student["name_or_path"])
    raise ValueError(
        "model.tokenizer is null and the student has no name_or_path to take its tokenizer from (it is built from a "
        "config): set model.tokenizer=<tokenizer folder or hub id>."
    )


def run_reporting_errors(run: Callable[[], _T], *, multirun: bool) -> _T:
    """``run()``; when it raises, print the error's message alone (``Error: <type>: <message>``) and exit with status
    1, as a command-line user needs it: every check of ours names what was wrong and what to do, and a traceback
    above it buries that. ``HYDRA_FULL_ERROR=1`` re-raises (Hydra then prints the whole traceback), as does a
    ``multirun`` job, whose error the sweep records."""
    import os
    import sys

    try:
        return run()
    except Exception as error:
        if multirun or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(
            f"Error: {type(error).__name__}: {error}\n(the traceback: run the command again with HYDRA_FULL_ERROR=1)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None
