"""Offline SeqKD completions (lightning_gkd/teachers/offline/completions.py): the sharded predict-loop build equals
the one-process rows, resumes writing only its missing parts (one process, and two gloo processes killed after their
first part), and refuses another run's settings before the teacher loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.completions_build_worker import ROWS, arguments
from helpers.launch import clean_env
from helpers.paths import TESTS
from helpers.teacher_cache import TEACHER, predict_trainer
from transformers import AutoModelForCausalLM

from lightning_gkd.teachers.offline.completions import (
    PARTS_DIR,
    TeacherCompletionModule,
    build_teacher_completions,
    part_name,
    teacher_completion_rows,
)
from lightning_gkd.toy import addition_rows


@pytest.fixture(scope="module")
def rows():
    return addition_rows("train")[:ROWS]


@pytest.fixture(scope="module")
def reference(tokenizer, rows) -> list[dict]:
    """The one-process rows: batches of BATCH_SIZE from row 0, each seeded by its first row's index."""
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32).eval()
    settings = {k: v for k, v in arguments().items() if k != "shard_size"}
    return json.loads(json.dumps(teacher_completion_rows(teacher, tokenizer, rows, **settings), sort_keys=True))


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class StopAfterParts(L.Callback):
    """Raise once ``count`` parts are on disk: an interrupted build."""

    def __init__(self, folder: Path, count: int) -> None:
        self.parts, self.count = folder / PARTS_DIR, count

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if len(list(self.parts.glob("part-*.jsonl"))) >= self.count:
            raise RuntimeError("stopped after parts")


def test_an_interrupted_build_resumes_with_the_missing_parts_and_equals_the_one_process_rows(
    tmp_path, tokenizer, rows, reference, monkeypatch
):
    folder = tmp_path / "cache"
    build = {"folder": folder, "settings": {"teacher": "toy"}, **arguments()}
    with pytest.raises(RuntimeError, match="stopped after parts"):
        build_teacher_completions(
            str(TEACHER), tokenizer, rows, trainer=predict_trainer([StopAfterParts(folder, 2)]), **build
        )
    assert sorted(p.name for p in (folder / PARTS_DIR).glob("*.jsonl")) == [part_name(0), part_name(1)]
    assert not (folder / "completions.jsonl").exists()
    kept = {p: (folder / PARTS_DIR / p).stat().st_mtime_ns for p in (part_name(0), part_name(1))}

    answered: list[int] = []  # the first row of every batch the resumed run answers
    original = TeacherCompletionModule.predict_step
    monkeypatch.setattr(
        TeacherCompletionModule,
        "predict_step",
        lambda self, batch, idx: answered.append(batch["first_row"]) or original(self, batch, idx),
    )
    path = build_teacher_completions(str(TEACHER), tokenizer, rows, trainer=predict_trainer(), **build)
    assert answered == list(range(16, ROWS, 4))  # parts 2..4 only (rows 16..39), 4 rows a batch
    assert {p: (folder / PARTS_DIR / p).stat().st_mtime_ns for p in kept} == kept  # not rewritten
    assert read(path) == reference
    # a rerun reuses the file; other settings are refused before the teacher loads
    answered.clear()
    assert build_teacher_completions(str(TEACHER), tokenizer, rows, trainer=predict_trainer(), **build) == path
    assert answered == []
    with pytest.raises(ValueError, match=r"other settings .*max_new_tokens.*\(6, 5\)"):
        build_teacher_completions(
            "no/such/teacher", tokenizer, rows, trainer=predict_trainer(), **{**build, "max_new_tokens": 5}
        )


@pytest.mark.multiprocess
def test_two_processes_killed_and_resumed_equal_the_one_process_rows(tmp_path, reference):
    folder = tmp_path / "cache"

    def worker(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(TESTS / "helpers" / "completions_build_worker.py"), str(folder), *flags]
        return subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240)

    killed = worker("--kill-after-first-part")
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-4000:]
    assert sorted(p.name for p in (folder / PARTS_DIR).glob("*.jsonl")) == [part_name(0), part_name(1)]
    resumed = worker()
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    result = json.loads((tmp_path / "cache.result.json").read_text())
    assert result["world_size"] == 2 and result["written"] == [part_name(p) for p in (2, 3, 4)]
    assert read(Path(result["path"])) == reference
