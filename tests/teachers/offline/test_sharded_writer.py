"""The offline teacher's one resumable sharded writer (lightning_gkd/teachers/offline/sharded_writer.py), with a toy
use and no model: shards of consecutive rows written whole in row order, batches that never cross a shard, a stopped
run resumed by writing only the missing shards (the result equal to a one-shot run's), the missing shards dealt to
the ranks round-robin, and a shard short of rows refused. The teacher cache's and the completions' uses are tested
through their builds (test_build.py, test_completions.py: one process and two killed gloo processes)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from helpers.teacher_cache import predict_trainer

from lightning_gkd.teachers.offline.sharded_writer import ShardedWriter, shard_batches, shard_rows

ROWS, SHARD_SIZE, BATCH_SIZE = 11, 4, 3


class Squares(ShardedWriter):
    """Rows 0..10, batched as a tensor; each row's record is the row squared; a shard is a JSON list of its records."""

    what = "Square shards"

    def __init__(self, folder: Path, *, fail_on_shard: int | None = None) -> None:
        collate = lambda rows: {"rows": torch.tensor(rows)}  # noqa: E731
        super().__init__(folder, list(range(ROWS)), collate, shard_size=SHARD_SIZE, batch_size=BATCH_SIZE)
        self.fail_on_shard = fail_on_shard
        self.dealt: list[list[int]] = []  # before_writing's calls

    def shard_name(self, shard: int) -> str:
        return f"squares-{shard}.json"

    def predicted_rows(self, prediction: Any) -> list[tuple[int, int]]:
        return [(int(row), int(square)) for row, square in zip(prediction["rows"], prediction["squares"], strict=True)]

    def write_records(self, path: Path, records: list[Any]) -> None:
        path.write_text(json.dumps(records))
        if self.fail_on_shard is not None and path.name.startswith(self.shard_name(self.fail_on_shard)):
            raise OSError("disk full")

    def before_writing(self, pending: list[int]) -> None:
        self.dealt.append(pending)


class Squarer(L.LightningModule):
    """Squares each batch's rows; ``batches``: the rows of every batch it was given."""

    def __init__(self, drop_last_row: bool = False) -> None:
        super().__init__()
        self.batches: list[list[int]] = []
        self.drop_last_row = drop_last_row

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        rows = batch["rows"][:-1] if self.drop_last_row and batch_idx == 0 else batch["rows"]
        self.batches.append(batch["rows"].tolist())
        return {"rows": rows, "squares": rows**2}


class StopAfterShards(L.Callback):
    def __init__(self, folder: Path, count: int) -> None:
        self.folder, self.count = folder, count

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if len(list(self.folder.glob("squares-*.json"))) >= self.count:
            raise RuntimeError("stopped after shards")


def files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_batches_never_cross_a_shard():
    assert [shard_rows(s, ROWS, SHARD_SIZE) for s in range(3)] == [range(0, 4), range(4, 8), range(8, 11)]
    assert shard_batches([2, 0], ROWS, SHARD_SIZE, BATCH_SIZE) == [range(8, 11), range(0, 3), range(3, 4)]


def test_a_stopped_run_resumes_with_the_missing_shards_and_equals_the_one_shot_run(tmp_path):
    one_shot = Squares(tmp_path / "one_shot")
    one_shot.folder.mkdir()
    assert one_shot.predict(predict_trainer(), Squarer()) == [0, 1, 2] and one_shot.dealt == [[0, 1, 2]]
    expected = {f"squares-{s}.json": json.dumps([r * r for r in shard_rows(s, ROWS, SHARD_SIZE)]) for s in range(3)}
    assert files(one_shot.folder) == {name: text.encode() for name, text in expected.items()}

    folder = tmp_path / "stopped"
    folder.mkdir()
    with pytest.raises(RuntimeError, match="stopped after shards"):
        Squares(folder).predict(predict_trainer([StopAfterShards(folder, 1)]), Squarer())
    assert sorted(files(folder)) == ["squares-0.json"]  # whole files only
    resumed, module = Squares(folder), Squarer()
    assert resumed.predict(predict_trainer(), module) == [1, 2] and resumed.dealt == [[1, 2]]
    assert module.batches == [[4, 5, 6], [7], [8, 9, 10]]  # the missing shards' rows only
    assert files(folder) == files(one_shot.folder)

    again = Squares(folder)
    assert again.predict(predict_trainer(), Squarer()) == [] and again.dealt == []  # complete: nothing to write


def test_a_shard_is_renamed_into_place_only_once_written(tmp_path):
    with pytest.raises(OSError, match="disk full"):
        Squares(tmp_path, fail_on_shard=1).predict(predict_trainer(), Squarer())
    assert sorted(files(tmp_path)) == ["squares-0.json", "squares-1.json.tmp"]
    Squares(tmp_path).predict(predict_trainer(), Squarer())
    assert sorted(files(tmp_path)) == ["squares-0.json", "squares-1.json", "squares-2.json"]  # the .tmp renamed


def test_the_missing_shards_are_dealt_to_the_ranks_round_robin(tmp_path):
    (tmp_path / "squares-1.json").write_text("[]")
    for rank in range(2):
        fake = SimpleNamespace(
            is_global_zero=rank == 0,
            global_rank=rank,
            world_size=2,
            strategy=SimpleNamespace(broadcast=lambda value, src: [0, 2] if src == 0 else value),
        )
        writer = Squares(tmp_path)
        writer.deal(fake)  # type: ignore[arg-type]
        assert writer.pending == [0, 2] and writer.shards == [[0], [2]][rank]
        assert writer.dealt == ([[0, 2]] if rank == 0 else [])  # rank 0 alone, before any shard is written
        assert writer.batches() == [[range(0, 3), range(3, 4)], [range(8, 11)]][rank]


def test_a_shard_short_of_rows_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match=r"Square shards \[0\] did not receive all their rows"):
        Squares(tmp_path).predict(predict_trainer(), Squarer(drop_last_row=True))
