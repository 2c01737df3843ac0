"""Fingerprints of the offline teacher (lightning_gkd/teachers/offline/fingerprints.py): the weights' reads a few
sampled blocks and still tells other weights apart (a cache built by them is refused), the data's samples large data
and counts every row."""

from __future__ import annotations

import pytest
from helpers.teacher_cache import TEACHER

from lightning_gkd.teachers.offline.build import check_cache_folder
from lightning_gkd.teachers.offline.manifest import read_manifest
from lightning_gkd.toy import addition_rows


def test_the_weights_fingerprint_reads_samples_and_tells_other_weights_apart(
    tmp_path, monkeypatch, built, tokenizer, rows
):
    import shutil

    from lightning_gkd.teachers.offline import fingerprints as cache_module

    folder = tmp_path / "teacher"
    shutil.copytree(TEACHER, folder)
    (weights,) = folder.glob("*.safetensors")
    first = cache_module.weights_fingerprint(str(folder))
    assert first == cache_module.weights_fingerprint({"name_or_path": str(folder)})  # a spec: the same files
    assert cache_module.weights_fingerprint("Qwen/Qwen2.5-0.5B") is None  # a hub id: its revision identifies it

    read: list[int] = []  # bytes read from weight files
    real_open = open

    class Counting:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def seek(self, offset):
            return self.handle.seek(offset)

        def read(self, size=-1):
            data = self.handle.read(size)
            read.append(len(data))
            return data

    monkeypatch.setattr(cache_module, "open", lambda path, mode="r": Counting(real_open(path, mode)), raising=False)
    assert cache_module.weights_fingerprint(str(folder)) == first
    size = weights.stat().st_size
    assert size > 3 * 2**20 and 0 < sum(read) <= 8 * 64 * 1024 + 64 * 1024  # samples and the header, not the file
    monkeypatch.undo()

    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor (inside the last sampled block)
    weights.write_bytes(bytes(data))
    second = cache_module.weights_fingerprint(str(folder))
    assert second != first
    # a cache built by the original weights refuses the changed ones, naming the field
    manifest = read_manifest(built)
    assert manifest["teacher"]["weights_fingerprint"] == first
    with pytest.raises(ValueError, match=rf"weights_fingerprint': '{first}'.*'{second}'"):
        check_cache_folder(
            built,
            {
                **{k: manifest[k] for k in ("signal", "k")},
                "teacher": {**manifest["teacher"], "weights_fingerprint": second},
            },
        )


def test_the_data_fingerprint_samples_large_data_and_counts_every_row():
    from lightning_gkd.teachers.offline.fingerprints import FINGERPRINT_ROWS, data_fingerprint

    base = addition_rows("train")
    rows = [base[i % len(base)] for i in range(3 * FINGERPRINT_ROWS + 7)]
    fingerprint = data_fingerprint(rows)
    assert data_fingerprint(list(rows)) == fingerprint
    assert data_fingerprint(rows[:-1]) != fingerprint  # the count
    sampled = list(rows)
    sampled[4] = base[1]  # row 4 is sampled (every 4th row at this size)
    assert data_fingerprint(sampled) != fingerprint
    small = base[:10]
    for i in range(10):  # small data: every row counts
        changed = list(small)
        changed[i] = base[20]
        assert data_fingerprint(changed) != data_fingerprint(small)
