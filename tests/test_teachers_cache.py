"""The offline teacher cache: built by a Lightning predict loop (lightning_gkd/teachers/cache_build.py), read back by
CacheTeacher (lightning_gkd/teachers/cache.py), and the `lightning-gkd-cache` Hydra entry point.

Everything runs on the shipped toy teacher over the first rows of the toy training split; the 2-process build is
tests/helpers/cache_build_worker.py.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers.cache_build_worker import BATCH_SIZE, MAX_LENGTH, ROWS, TOP_K, clean_env, settings
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

import lightning_gkd.teachers.cache_build as cache_build
from lightning_gkd import ChatDataModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.data.toy import addition_rows
from lightning_gkd.models.loading import load_frozen_causal_lm
from lightning_gkd.models.tiny import asset_path
from lightning_gkd.teachers import LocalTeacher, SparseTeacher, supervised_positions
from lightning_gkd.teachers.cache import CacheMiss, CacheTeacher, read_manifest, shard_name
from lightning_gkd.teachers.cache_build import build_teacher_cache, build_teacher_cache_report

TESTS = Path(__file__).parent
TEACHER = asset_path("toy/teacher")
TRAINER = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False}


@contextmanager
def one_thread():
    """The 2-process build runs one thread per process: the reference does too (same kernels, same bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TEACHER)


@pytest.fixture(scope="module")
def rows():
    return addition_rows("train")[:ROWS]


@pytest.fixture(scope="module")
def teacher():
    return load_frozen_causal_lm(TEACHER, role="teacher")


@pytest.fixture(scope="module")
def built(tmp_path_factory, tokenizer, rows) -> Path:
    """The one-shot, single-process build (k=20, 6 shards of 16 rows, batches of 8)."""
    path = tmp_path_factory.mktemp("one_shot") / "cache"
    with one_thread():
        report = build_teacher_cache_report(TEACHER, tokenizer, rows, path, trainer=TRAINER, **settings())
    assert report.built_shards == 6 and report.built_tokens == report.manifest["total_tokens"] > 0
    return path


def batches(rows, sizes, seed):
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    start = 0
    for size in sizes:
        yield [rows[i] for i in order[start : start + size]]
        start += size


def test_cache_gives_what_the_live_teacher_gives(built, tokenizer, rows, teacher):
    manifest = read_manifest(built)
    assert manifest["status"] == "complete" and manifest["num_rows"] == ROWS and manifest["k"] == TOP_K
    assert [s["name"] for s in manifest["shards"]] == [shard_name(s) for s in range(6)]
    assert sum(s["rows"] for s in manifest["shards"]) == ROWS
    assert manifest["total_tokens"] == sum(s["tokens"] for s in manifest["shards"])
    assert manifest["total_bytes"] == sum((built / s["name"]).stat().st_size for s in manifest["shards"])
    collator = ChatMLCollator(tokenizer, max_length=MAX_LENGTH)
    for top_k in (None, 5):
        cache = CacheTeacher(built, top_k=top_k)
        assert isinstance(cache, SparseTeacher) and cache.top_k == (top_k or TOP_K)
        live = LocalTeacher(teacher, top_k=top_k or TOP_K)
        for group in batches(rows, [7, 1, 13, 32, 20], seed=top_k or 0):  # any order, uneven rows and batches
            batch = collator(group)
            positions = supervised_positions(batch["labels"])
            got, want = cache.topk(batch, positions), live.topk(batch, positions)
            assert got.ids.dtype == torch.long and got.logprobs.dtype == torch.float32
            assert got.ids.shape == (int(positions.sum()), top_k or TOP_K)
            assert torch.equal(got.ids, want.ids)
            assert want.next_logprobs is not None and got.next_logprobs is not None
            for cached, exact in ((got.logprobs, want.logprobs), (got.next_logprobs, want.next_logprobs)):
                torch.testing.assert_close(cached, exact.half().float(), rtol=2**-10, atol=1e-6)  # fp16 storage
    cache.check(tokenizer, vocab_size=len(tokenizer))


def test_cache_size_per_million_tokens_grows_with_k(tmp_path, built, tokenizer, rows):
    k1 = {**settings(), "top_k": 1}
    small = build_teacher_cache(TEACHER, tokenizer, rows, tmp_path / "k1", trainer=TRAINER, **k1)
    large = read_manifest(built)
    assert small["total_tokens"] == large["total_tokens"]
    # per supervised token: k ids (4 B) + k log-probs (2 B) + the next log-prob (2 B), plus offsets and keys
    assert 8 * 1e6 < small["bytes_per_million_tokens"] < large["bytes_per_million_tokens"]
    assert large["bytes_per_million_tokens"] > 20 * 6 * 1e6


@pytest.mark.multiprocess
def test_two_process_build_killed_and_resumed_equals_the_one_shot_build(tmp_path, built):
    """Both ranks SIGKILLed after their first shard, then the same command again: the folder is byte for byte the
    single-process build's, and the shards of the killed run were not written again."""
    folder = tmp_path / "cache"

    def worker(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(TESTS / "helpers" / "cache_build_worker.py"), str(folder), *flags]
        done = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240)
        return done

    killed = worker("--kill-after-first-shard")
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-4000:]
    assert sorted(p.name for p in folder.glob("*.arrow")) == [shard_name(0), shard_name(1)]
    assert read_manifest(folder)["status"] == "building"
    with pytest.raises(RuntimeError, match=r"incomplete \(4 of 6 shards missing.*lightning-gkd-cache cache\.path="):
        CacheTeacher(folder)
    kept = {name: (folder / name).stat() for name in (shard_name(0), shard_name(1))}

    resumed = worker()
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    result = json.loads((tmp_path / "cache.result.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["built_shards"] == 4
    for name, before in kept.items():  # not rewritten
        after = (folder / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(p.name for p in built.iterdir()) == ["manifest.json", *[shard_name(s) for s in range(6)]]
    for name in files:
        assert (folder / name).read_bytes() == (built / name).read_bytes(), name


def test_the_reader_refuses_what_does_not_match(tmp_path, built, tokenizer, rows):
    cache = CacheTeacher(built)
    fingerprint = read_manifest(built)["tokenizer_fingerprint"]
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template + " "
    with pytest.raises(ValueError, match=rf"{built}.*fingerprint {fingerprint}.*has [0-9a-f]{{32}}"):
        cache.check(other, vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="token id 2[0-9]{2}, outside the student's vocabulary of 200"):
        cache.check(tokenizer, vocab_size=200)
    with pytest.raises(ValueError, match=r"top_k=21 but .* holds k=20"):
        CacheTeacher(built, top_k=21)

    cache.check_datamodule(ChatDataModule(tokenizer, rows, max_length=MAX_LENGTH))
    with pytest.raises(ValueError, match=r"max_length=64, the data has max_length=48.*lightning-gkd-cache"):
        cache.check_datamodule(ChatDataModule(tokenizer, rows, max_length=48))
    with pytest.raises(
        ValueError,
        match=r"over 96 rows \(training, then validation\) of fingerprint [0-9a-f]{32}; the data has 95 rows",
    ):
        cache.check_datamodule(ChatDataModule(tokenizer, rows[1:], max_length=MAX_LENGTH))
    with pytest.raises(ValueError, match=r"last assistant turn, but data.assistant_turns='all' trains on every"):
        cache.check_datamodule(ChatDataModule(tokenizer, rows, max_length=MAX_LENGTH, assistant_turns="all"))
    edited = [*rows[:-1], {"messages": [*rows[-1]["messages"][:-1], {"role": "assistant", "content": "0"}]}]
    with pytest.raises(ValueError, match="the data has 96 rows of fingerprint"):
        cache.check_datamodule(ChatDataModule(tokenizer, edited, max_length=MAX_LENGTH))

    batch = ChatMLCollator(tokenizer, max_length=MAX_LENGTH)([rows[3], edited[-1]])
    with pytest.raises(CacheMiss, match=rf"row 1 is not in the teacher cache at {built}.*on-policy sample"):
        cache.topk(batch, supervised_positions(batch["labels"]))

    with pytest.raises(FileNotFoundError, match=rf"No teacher cache at {tmp_path / 'none'}.*lightning-gkd-cache"):
        CacheTeacher(tmp_path / "none")


def test_a_build_with_other_settings_is_refused_before_the_teacher_loads(tmp_path, built, tokenizer, rows, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(cache_build, "load_frozen_causal_lm", no_model)
    same = build_teacher_cache(TEACHER, tokenizer, rows, built, trainer=TRAINER, **settings())  # complete: no-op
    assert same == read_manifest(built)
    for change, message in (
        ({"top_k": 5}, "k: 20 there, 5 now"),
        ({"max_length": 48}, "max_length: 64 there, 48 now"),
        ({"shard_size": 32}, "shard_size: 16 there, 32 now"),
    ):
        with pytest.raises(ValueError, match=rf"{built} was started with other settings \({message}"):
            build_teacher_cache(TEACHER, tokenizer, rows, built, trainer=TRAINER, **{**settings(), **change})
    with pytest.raises(ValueError, match="data_fingerprint: '[0-9a-f]{32}' there, '[0-9a-f]{32}' now"):
        build_teacher_cache(TEACHER, tokenizer, rows[:-1], built, trainer=TRAINER, **settings())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a cache")
    with pytest.raises(FileExistsError, match="not empty and has no manifest.json"):
        build_teacher_cache(TEACHER, tokenizer, rows, tmp_path / "other", trainer=TRAINER, **settings())
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        build_teacher_cache(TEACHER, tokenizer, rows, tmp_path / "k0", trainer=TRAINER, top_k=0)


def test_an_incomplete_cache_names_the_command_that_resumes_it(tmp_path, built):
    broken = tmp_path / "cache"
    broken.mkdir()
    for path in built.iterdir():
        if path.name != shard_name(4):
            (broken / path.name).write_bytes(path.read_bytes())
    with pytest.raises(RuntimeError, match=rf"{broken} is incomplete \(1 of 6 shards missing, first shard-00004"):
        CacheTeacher(broken)
    with pytest.raises(RuntimeError, match=rf"`lightning-gkd-cache cache.path={broken} cache.top_k=20` with the"):
        CacheTeacher(broken)


def compose_cache(tmp_path: Path, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        cfg = compose("cache_teacher", return_hydra_config=True, overrides=overrides)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "run")
    return cfg


def test_the_hydra_entry_point_caches_the_toy_teacher(tmp_path, capsys):
    from lightning_gkd.cli.cache_teacher import run

    scripts = (TESTS.parent / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n\n")[0]
    assert 'lightning-gkd-cache = "lightning_gkd.cli.cache_teacher:main"' in scripts.splitlines()
    overrides = [
        f"cache.path={tmp_path / 'teacher_cache'}",
        "+data.train_data.num_rows=40",
        "+data.val_data.num_rows=8",  # cached after the training rows: the validation loss reads them too
        "cache.shard_size=16",
        f"cache.batch_size={BATCH_SIZE}",
        "+trainer.enable_progress_bar=false",
    ]
    cfg = compose_cache(tmp_path, overrides)
    assert cfg.cache.top_k == 20 and cfg.model.teacher.name_or_path == TEACHER and cfg.trainer.accelerator == "cpu"
    report = run(cfg)
    out = capsys.readouterr().out
    manifest = report.manifest
    assert manifest["num_rows"] == 48 and manifest["num_shards"] == 3 and manifest["max_length"] == 64
    assert f"teacher cache: {tmp_path / 'teacher_cache'}" in out
    assert f"rows: 48  supervised tokens: {manifest['total_tokens']}  shards: 3  k: 20" in out
    assert f"({manifest['bytes_per_million_tokens'] / 1e6:.1f} MB per million tokens)" in out
    assert "built this run: 3 shards" in out and "tokens/s)" in out
    assert CacheTeacher(tmp_path / "teacher_cache").manifest == manifest

    run(cfg)  # again: complete, nothing to do
    assert "built this run: nothing (the cache was complete)" in capsys.readouterr().out
    # the Python API with the teacher's folder (no spec, dtype auto) has the same settings: nothing to do either
    same = {**settings(), "shard_size": 16}
    rows = [*addition_rows("train", 40), *addition_rows("val", 8)]
    assert build_teacher_cache(TEACHER, TEACHER, rows, tmp_path / "teacher_cache", trainer=TRAINER, **same) == manifest
    with pytest.raises(ValueError, match="k: 20 there, 5 now"):
        run(compose_cache(tmp_path, [*overrides, "cache.top_k=5"]))
    with pytest.raises(ValueError, match="cache.top_k must be an integer >= 1, got 0"):
        run(compose_cache(tmp_path, [*overrides, "cache.top_k=0"]))


def test_training_from_the_cache_at_full_vocabulary_equals_training_with_the_live_teacher(tmp_path, tokenizer, rows):
    """GKD supervised KD (lmbda=0) from a k=V cache and from the in-process teacher's full distributions: the same
    losses step by step (up to the cache's float16 log-probs), training and validation rows both found."""
    import csv
    from functools import partial

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gkd import GKDModule
    from lightning_gkd.models.loading import load_causal_lm

    train, val = rows[:48], addition_rows("val", 8)
    path = tmp_path / "cache_kV"
    build_teacher_cache(TEACHER, tokenizer, [*train, *val], path, top_k=259, max_length=MAX_LENGTH, trainer=TRAINER)

    def losses(teacher, root):
        module = GKDModule(
            load_causal_lm(asset_path("toy/student_init")),
            teacher,
            tokenizer,
            lmbda=0.0,
            beta=0.5,
            metrics={},
            optimizer=partial(torch.optim.AdamW, lr=1e-3),
            frozen_dtype="float32",
        )
        data = ChatDataModule(tokenizer, train, val, batch_size=8, max_length=MAX_LENGTH, shuffle=False)
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=4,
            val_check_interval=4,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            logger=CSVLogger(root, name="", version=""),
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(module, datamodule=data)
        with open(root / "metrics.csv") as handle:
            logged = list(csv.DictReader(handle))
        return [float(r["train/loss"]) for r in logged if r.get("train/loss")], [
            float(r["val/loss"]) for r in logged if r.get("val/loss")
        ]

    dense_train, dense_val = losses(str(TEACHER), tmp_path / "dense")
    cached_train, cached_val = losses({"kind": "cache", "path": str(path)}, tmp_path / "cached")
    assert len(cached_train) == 4 and len(cached_val) == 1
    assert cached_train == pytest.approx(dense_train, rel=2e-3)
    assert cached_val == pytest.approx(dense_val, rel=2e-3)


def test_offline_seq_kd_caches_the_teachers_own_completions_and_trains_from_them(tmp_path, tokenizer, capsys):
    """cache.completions=teacher: the teacher answers every training prompt (greedy), the cache scores those answers,
    and a training run reading completions.jsonl with teacher=cache finds every row (SeqKD, no teacher loaded)."""
    import re

    from helpers.hydra_compose import compose_train

    from lightning_gkd.cli.cache_teacher import run as build
    from lightning_gkd.cli.train import build as build_run
    from lightning_gkd.cli.train import fit

    path = tmp_path / "seqkd_cache"
    overrides = [
        f"cache.path={path}",
        "cache.completions=teacher",
        "cache.max_new_tokens=8",
        "+data.train_data.num_rows=24",
        "+data.val_data.num_rows=8",
        "+trainer.enable_progress_bar=false",
    ]
    report = build(compose_cache(tmp_path, overrides))
    completions = [json.loads(line) for line in (path / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 24 and report.manifest["num_rows"] == 32  # + the 8 validation rows
    right = 0
    for row in completions:  # the teacher's greedy answers (97.9% held-out), not the dataset's
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", row["messages"][0]["content"]).groups()
        right += row["messages"][-1]["content"] == str(int(a[::-1]) + int(b[::-1]))[::-1]
    assert right >= 20
    assert f"train with data.train_data={path / 'completions.jsonl'}" in capsys.readouterr().out
    build(compose_cache(tmp_path, overrides))  # a rerun reuses the completions and the complete cache
    with pytest.raises(ValueError, match=r"other settings .*max_new_tokens"):
        build(compose_cache(tmp_path, [*overrides[:2], "cache.max_new_tokens=6", *overrides[3:]]))

    train = compose_train(
        tmp_path,
        [
            "teacher=cache",
            f"teacher.path={path}",
            "method.lmbda=0",
            f"data.train_data={path / 'completions.jsonl'}",
            "+data.val_data.num_rows=8",
            "data.test_data=null",
            "data.batch_size=8",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "callbacks=none",
            "logger=csv",
            "print_config=false",
            "export=false",
        ],
    )
    run = build_run(train)
    assert run.module.teacher is None
    result = fit(run)
    assert result["global_step"] == 3 and 0 < result["metrics"]["val/loss"] < 10
