"""The offline teacher cache: built by a Lightning predict loop (lightning_gkd/teachers/cache_build.py), read back by
CacheTeacher (top-k) or HiddenCacheTeacher (final hidden states and the head: an exact dense teacher;
lightning_gkd/teachers/cache.py), and the `lightning-gkd-cache` Hydra entry point.

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
from helpers.cache_build_worker import BATCH_SIZE, MAX_LENGTH, ROWS, TOP_K, settings
from helpers.launch import clean_env
from helpers.paths import TESTS
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

import lightning_gkd.teachers.cache_build as cache_build
from lightning_gkd import ChatDataModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.models.loading import load_frozen_causal_lm
from lightning_gkd.teachers import LocalTeacher, SparseTeacher, Teacher, supervised_positions
from lightning_gkd.teachers.cache import (
    CacheMiss,
    CacheTeacher,
    HiddenCacheTeacher,
    open_teacher_cache,
    read_manifest,
    shard_name,
)
from lightning_gkd.teachers.cache_build import build_teacher_cache, build_teacher_cache_report, check_cache_folder
from lightning_gkd.teachers.spec import teacher_plan
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

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
    with pytest.raises(ValueError, match=r"top-k over token ids \[0, 259\), but this run compares the ids \[0, 200\)"):
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


@pytest.mark.parametrize("signal", ["topk", "hidden"])
def test_training_from_the_cache_equals_training_with_the_live_teacher(tmp_path, tokenizer, rows, signal):
    """GKD supervised KD (lmbda=0, beta=0.5) from a k=V cache or a hidden-state cache (the dense loss, no teacher
    model) and from the in-process teacher's full distributions: the same losses step by step (up to the cache's
    float16 numbers), training and validation rows both found."""
    import csv
    from functools import partial

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gkd import GKDModule
    from lightning_gkd.models.loading import load_causal_lm

    train, val = rows[:48], addition_rows("val", 8)
    path = tmp_path / "cache"
    width = {"top_k": 259} if signal == "topk" else {"signal": "hidden"}
    build_teacher_cache(TEACHER, tokenizer, [*train, *val], path, max_length=MAX_LENGTH, trainer=TRAINER, **width)

    def losses(teacher, root):
        module = GKDModule(
            load_causal_lm(asset_path("toy/student_init")),
            teacher,
            tokenizer,
            lmbda=0.0,
            divergence={"beta": 0.5},
            training={"optimizer": partial(torch.optim.AdamW, lr=1e-3), "frozen_dtype": "float32"},
            validation={"metrics": {}},
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
    assert teacher_plan({"kind": "cache", "path": str(path)}).all_dense == (signal == "hidden")
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


# -- the hidden-state signal (cache.signal=hidden): the teacher's final hidden states and its head ---------------------
HIDDEN_SIZE, VOCAB = 128, 259  # the toy teacher's


@pytest.fixture(scope="module")
def hidden_built(tmp_path_factory, tokenizer, rows) -> Path:
    """The hidden-state build (float16) over the rows and shards of ``built``."""
    path = tmp_path_factory.mktemp("hidden") / "cache"
    report = build_teacher_cache_report(TEACHER, tokenizer, rows, path, trainer=TRAINER, signal="hidden", **settings())
    assert report.built_shards == 6 and report.built_tokens == report.manifest["total_tokens"] > 0
    return path


def scaled_teacher(teacher, factor: float):
    """The toy teacher with its final norm scaled by ``factor``: hidden states ``factor`` times larger, its head
    still exactly the projection of them."""
    scaled = copy.deepcopy(teacher)
    with torch.no_grad():
        scaled.model.norm.weight.mul_(factor)
    return scaled


def test_hidden_cache_gives_the_live_teachers_hidden_states_and_head(hidden_built, tokenizer, rows, teacher):
    manifest = read_manifest(hidden_built)
    assert manifest["status"] == "complete" and manifest["signal"] == "hidden"
    assert manifest["hidden_dtype"] == "float16" and manifest["k"] is None and manifest["max_token_id"] is None
    head = {"scale": 1.0, "softcap": None, "hidden_size": HIDDEN_SIZE, "vocab_size": VOCAB, "dtype": "float32"}
    assert {key: manifest["head"][key] for key in head} == head
    assert manifest["head"]["bytes"] == (hidden_built / "head.safetensors").stat().st_size
    files = sorted(p.name for p in hidden_built.iterdir())
    assert files == ["head.safetensors", "manifest.json", *[shard_name(s) for s in range(6)]]
    from datasets import Dataset

    features = Dataset.from_file(str(hidden_built / shard_name(0))).features
    assert set(features) == {"key", "row_index", "hidden"} and features["hidden"].feature.feature.dtype == "float16"

    cache, live = HiddenCacheTeacher(hidden_built), LocalTeacher(teacher)
    assert isinstance(cache, Teacher) and not isinstance(cache, SparseTeacher)
    assert (cache.hidden_size, cache.vocab_size) == (HIDDEN_SIZE, VOCAB)
    collator = ChatMLCollator(tokenizer, max_length=MAX_LENGTH)
    largest, difference = 0.0, 0.0
    for group in batches(rows, [7, 1, 13, 32, 20, 23], seed=1):  # any order, uneven rows and batches
        batch = collator(group)
        positions = supervised_positions(batch["labels"])
        (got, got_head), (want, want_head) = cache.hidden_states(batch, positions), live.hidden_states(batch, positions)
        assert got.dtype == torch.float32 and got.shape == (int(positions.sum()), HIDDEN_SIZE)
        assert torch.equal(got, want.half().float())  # exactly the float16 rounding of the live states
        largest, difference = max(largest, float(want.abs().max())), max(difference, float((got - want).abs().max()))
        assert torch.equal(got_head.weight, want_head.weight) and got_head.bias is None and want_head.bias is None
        assert (got_head.scale, got_head.softcap) == (want_head.scale, want_head.softcap)
        logits, exact = cache.logits(batch), live.logits(batch)  # the full-logits path: (B, L, V) where supervised
        torch.testing.assert_close(logits[positions], exact[positions].float(), rtol=0, atol=2e-3)
    print(f"hidden states: max |h| {largest:.3g}, max |cached - live| {difference:.3g} (float16: 2^-11 relative)")
    assert 0 < difference <= largest * 2**-11
    cache.check(tokenizer, vocab_size=VOCAB)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_dense_loss_from_the_hidden_cache_equals_the_live_teachers(hidden_built, tokenizer, rows, teacher, beta):
    """The generalized JSD (lean and full-logits paths) and the student's gradients from the cache equal those from
    the in-process teacher up to the float16 storage."""
    from lightning_gkd.losses.base import LeanPath
    from lightning_gkd.losses.dense import DenseDistillation
    from lightning_gkd.losses.settings import DivergenceSettings
    from lightning_gkd.toy.tiny import TOY_STUDENT, tiny_causal_lm

    student = tiny_causal_lm(TOY_STUDENT, tokenizer, seed=0)
    batch = ChatMLCollator(tokenizer, max_length=MAX_LENGTH)(rows[8:40])
    cache, live = HiddenCacheTeacher(hidden_built), LocalTeacher(teacher)

    def loss_and_grads(source, lean: bool):
        student.zero_grad(set_to_none=True)
        out = DenseDistillation(source, DivergenceSettings(beta=beta), lean=LeanPath(lean))(student, batch)
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in student.parameters() if p.grad is not None]

    for lean in (True, False):
        (got, got_grads), (want, want_grads) = loss_and_grads(cache, lean), loss_and_grads(live, lean)
        assert float(want) > 0 and len(got_grads) == len(want_grads) > 0
        relative = abs(float(got) - float(want)) / float(want)
        worst = max(float((g - w).norm() / w.norm()) for g, w in zip(got_grads, want_grads, strict=True))
        print(
            f"beta={beta} lean={lean}: loss {float(want):.6f}; relative error: loss {relative:.2e}, "
            f"gradients {worst:.2e}"
        )
        assert relative < 1e-3 and worst < 1e-3


def test_hidden_cache_costs_2h_bytes_per_token(hidden_built, built):
    """Per supervised token: H float16 numbers (2H bytes) and one int32 list offset; per row its key, index and
    offset; per shard the Arrow schema. Top-k (k=20): k int32 ids + k float16 log-probs + the next log-prob."""
    hidden, topk = read_manifest(hidden_built), read_manifest(built)
    tokens, rows, shards = hidden["total_tokens"], hidden["num_rows"], hidden["num_shards"]
    assert tokens == topk["total_tokens"]
    per_token = {name: manifest["total_bytes"] / tokens for name, manifest in (("hidden", hidden), ("topk", topk))}
    print(
        f"bytes per supervised token ({tokens} tokens, {rows} rows): hidden float16 {per_token['hidden']:.1f} "
        f"(2H = {2 * HIDDEN_SIZE}), top-{TOP_K} {per_token['topk']:.1f} (6k + 2 = {6 * TOP_K + 2}); head "
        f"{hidden['head']['bytes']} bytes once"
    )
    overhead = (48 * rows + 2048 * shards) / tokens  # key (32 + 4) + row_index 8 + offset 4 a row; schema a shard
    assert 2 * HIDDEN_SIZE + 4 <= per_token["hidden"] <= 2 * HIDDEN_SIZE + 4 + overhead
    assert 6 * TOP_K + 2 + 8 <= per_token["topk"] <= 6 * TOP_K + 2 + 8 + overhead
    assert hidden["bytes_per_million_tokens"] == round(per_token["hidden"] * 1e6, 1)
    assert hidden["head"]["bytes"] > VOCAB * HIDDEN_SIZE * 4  # float32 weight (the toy teacher's dtype)


def test_bfloat16_hidden_cache_holds_states_beyond_float16(tmp_path, tokenizer, rows, teacher):
    """A teacher whose hidden states exceed float16's range is refused as float16 (naming hidden_dtype=bfloat16) and
    cached as bfloat16 bits: exactly the bfloat16 rounding of its states."""
    from datasets import Dataset

    scaled = scaled_teacher(teacher, 1e5)
    few = {**settings(), "shard_size": 16}
    with pytest.raises(
        ValueError,
        match=r"state \(in the batch of rows 0\.\.7\) is .* beyond float16's range .*cache.hidden_dtype=bfloat16",
    ):
        build_teacher_cache(scaled, tokenizer, rows[:32], tmp_path / "fp16", trainer=TRAINER, signal="hidden", **few)
    path = tmp_path / "bf16"
    manifest = build_teacher_cache(
        scaled, tokenizer, rows[:32], path, trainer=TRAINER, signal="hidden", hidden_dtype="bfloat16", **few
    )
    assert manifest["hidden_dtype"] == "bfloat16" and manifest["num_shards"] == 2
    assert Dataset.from_file(str(path / shard_name(0))).features["hidden"].feature.feature.dtype == "uint16"
    cache, live = open_teacher_cache(path), LocalTeacher(scaled)
    assert isinstance(cache, HiddenCacheTeacher)
    batch = ChatMLCollator(tokenizer, max_length=MAX_LENGTH)(rows[3:29])
    positions = supervised_positions(batch["labels"])
    (got, _), (want, _) = cache.hidden_states(batch, positions), live.hidden_states(batch, positions)
    assert float(want.abs().max()) > 65504
    assert torch.equal(got, want.bfloat16().float())


def test_a_stopped_hidden_build_resumes_to_the_same_bytes(tmp_path, hidden_built, tokenizer, rows):
    """What a killed build leaves (a "building" manifest, some shards, maybe no head yet), rerun: only the missing
    shards are written and every file equals the one-shot build's, head.safetensors included."""
    folder = tmp_path / "cache"
    folder.mkdir()
    for path in hidden_built.iterdir():
        if path.name not in ("head.safetensors", shard_name(2), shard_name(5)):
            (folder / path.name).write_bytes(path.read_bytes())
    stats = ("shards", "total_tokens", "total_bytes", "max_token_id", "head", "bytes_per_million_tokens")
    building = {key: value for key, value in read_manifest(folder).items() if key not in stats}
    (folder / "manifest.json").write_text(json.dumps({**building, "status": "building"}))
    with pytest.raises(RuntimeError, match=r"incomplete.*cache.signal=hidden cache.hidden_dtype=float16` with"):
        HiddenCacheTeacher(folder)
    report = build_teacher_cache_report(
        TEACHER, tokenizer, rows, folder, trainer=TRAINER, signal="hidden", **settings()
    )
    assert report.built_shards == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in hidden_built.iterdir())
    for path in hidden_built.iterdir():
        assert (folder / path.name).read_bytes() == path.read_bytes(), path.name


def test_hidden_cache_refusals(tmp_path, hidden_built, built, tokenizer, rows, teacher, monkeypatch):
    from lightning_gkd.teachers.spec import build_remote_teacher, teacher_plan

    # the reader by the manifest; top_k has no meaning for full distributions
    assert isinstance(open_teacher_cache(hidden_built), HiddenCacheTeacher)
    assert isinstance(open_teacher_cache(built), CacheTeacher) and open_teacher_cache(built, top_k=5).top_k == 5
    with pytest.raises(ValueError, match="a hidden-state cache gives full distributions; set teacher.top_k=null"):
        open_teacher_cache(hidden_built, top_k=20)
    spec = {"kind": "cache", "path": str(hidden_built), "top_k": None}
    assert isinstance(build_remote_teacher(teacher_plan(spec).entries[""]), HiddenCacheTeacher)
    with pytest.raises(ValueError, match="set teacher.top_k=null"):
        build_remote_teacher(teacher_plan({**spec, "top_k": 20}).entries[""])
    with pytest.raises(ValueError, match="holds signal=hidden, not topk: read it with HiddenCacheTeacher"):
        CacheTeacher(hidden_built)
    with pytest.raises(ValueError, match="holds signal=topk, not hidden: read it with CacheTeacher"):
        HiddenCacheTeacher(built)

    # the student: the tokenizer (shared with CacheTeacher), the head's vocabulary; the data (shared)
    cache = HiddenCacheTeacher(hidden_built)
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template + " "
    with pytest.raises(ValueError, match=rf"{hidden_built} was built with a tokenizer of fingerprint"):
        cache.check(other, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="head over 259 tokens, but the run compares 260 token ids"):
        cache.check(tokenizer, vocab_size=260)
    cache.check_datamodule(ChatDataModule(tokenizer, rows, max_length=MAX_LENGTH))
    with pytest.raises(ValueError, match=r"max_length=64, the data has max_length=48.*cache.signal=hidden"):
        cache.check_datamodule(ChatDataModule(tokenizer, rows, max_length=48))
    with pytest.raises(ValueError, match="the data has 95 rows"):
        cache.check_datamodule(ChatDataModule(tokenizer, rows[1:], max_length=MAX_LENGTH))
    edited = {"messages": [*rows[-1]["messages"][:-1], {"role": "assistant", "content": "0"}]}
    batch = ChatMLCollator(tokenizer, max_length=MAX_LENGTH)([rows[3], edited])
    with pytest.raises(CacheMiss, match=rf"row 1 is not in the teacher cache at {hidden_built}"):
        cache.hidden_states(batch, supervised_positions(batch["labels"]))

    # a rerun with another signal or dtype, before any model loads
    def no_model(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(cache_build, "load_frozen_causal_lm", no_model)
    hidden = {**settings(), "signal": "hidden"}
    assert build_teacher_cache(TEACHER, tokenizer, rows, hidden_built, trainer=TRAINER, **hidden) == read_manifest(
        hidden_built
    )  # complete: nothing to do
    for path, change, message in (
        (hidden_built, {"signal": "topk"}, "signal: 'hidden' there, 'topk' now"),
        (hidden_built, {"hidden_dtype": "bfloat16"}, "hidden_dtype: 'float16' there, 'bfloat16' now"),
        (built, {"signal": "hidden"}, "signal: 'topk' there, 'hidden' now"),
    ):
        with pytest.raises(ValueError, match=rf"{path} was started with other settings \(.*{message}"):
            build_teacher_cache(TEACHER, tokenizer, rows, path, trainer=TRAINER, **{**hidden, **change})
    with pytest.raises(ValueError, match="cache.signal must be one of topk, hidden, got 'logits'"):
        build_teacher_cache(TEACHER, tokenizer, rows, tmp_path / "x", trainer=TRAINER, signal="logits")
    with pytest.raises(ValueError, match="cache.hidden_dtype must be one of float16, bfloat16, got 'float32'"):
        build_teacher_cache(TEACHER, tokenizer, rows, tmp_path / "x", signal="hidden", hidden_dtype="float32")
    monkeypatch.undo()

    # a top-k cache from before signal= (no signal, hidden_dtype or head in its manifest) still opens and resumes
    old = tmp_path / "old"
    old.mkdir()
    for path in built.iterdir():
        (old / path.name).write_bytes(path.read_bytes())
    manifest = {k: v for k, v in read_manifest(built).items() if k not in ("signal", "hidden_dtype", "head")}
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert isinstance(open_teacher_cache(old), CacheTeacher)
    assert build_teacher_cache(TEACHER, tokenizer, rows, old, trainer=TRAINER, **settings()) == manifest

    # a teacher whose logits are not its head applied to its final hidden states: refused, nothing written
    doubled = copy.deepcopy(teacher)
    doubled.lm_head.register_forward_hook(lambda module, args, output: output * 2)
    folder = tmp_path / "doubled"
    with pytest.raises(
        ValueError, match=r"Qwen2ForCausalLM's head cannot be described so \(.*\)\. .*: cache\.signal=topk\."
    ):
        build_teacher_cache(doubled, tokenizer, rows, folder, trainer=TRAINER, **hidden)
    assert not any(folder.iterdir())


def test_the_hydra_entry_point_caches_hidden_states(tmp_path, capsys):
    from lightning_gkd.cli.cache_teacher import run

    overrides = [
        f"cache.path={tmp_path / 'hidden_cache'}",
        "cache.signal=hidden",
        "+data.train_data.num_rows=40",
        "+data.val_data.num_rows=8",
        "cache.shard_size=16",
        f"cache.batch_size={BATCH_SIZE}",
        "+trainer.enable_progress_bar=false",
    ]
    cfg = compose_cache(tmp_path, overrides)
    assert cfg.cache.hidden_dtype == "float16" and compose_cache(tmp_path, []).cache.signal == "topk"
    report = run(cfg)
    out = capsys.readouterr().out
    manifest = report.manifest
    assert manifest["signal"] == "hidden" and manifest["num_rows"] == 48 and manifest["num_shards"] == 3
    assert f"shards: 3  hidden states: float16 x {HIDDEN_SIZE}  head: V={VOCAB}" in out
    assert "built this run: 3 shards" in out
    assert HiddenCacheTeacher(tmp_path / "hidden_cache").manifest == manifest
    run(cfg)  # again: complete, nothing to do
    assert "built this run: nothing (the cache was complete)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="signal: 'hidden' there, 'topk' now"):
        run(compose_cache(tmp_path, [o for o in overrides if o != "cache.signal=hidden"]))
    with pytest.raises(ValueError, match="cache.hidden_dtype must be one of float16, bfloat16, got 'float32'"):
        run(compose_cache(tmp_path, [*overrides, "cache.hidden_dtype=float32"]))


def test_the_weights_fingerprint_reads_samples_and_tells_other_weights_apart(
    tmp_path, monkeypatch, built, tokenizer, rows
):
    import shutil

    from lightning_gkd.teachers import cache as cache_module

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
    from lightning_gkd.teachers.cache import FINGERPRINT_ROWS, data_fingerprint

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


def test_a_cache_of_a_teacher_padded_further_covers_the_students_rows(tmp_path, tokenizer, rows):
    """Qwen2.5-7B (152,064 rows) cached for 0.5B (151,936) over one tokenizer: with ``vocab_rows`` the top-k is taken
    over the ids both have and renormalised there (the truncated teacher's, exactly); a cache over all the teacher's
    rows is refused for that student, naming the option; the CLI takes the student's rows by default."""
    from helpers.padded_vocab import pad_vocabulary, truncated_copy
    from omegaconf import OmegaConf

    from lightning_gkd.cli.cache_teacher import cache_vocab_rows

    padded = pad_vocabulary(load_frozen_causal_lm(TEACHER, role="teacher"), 272, seed=3, scale=3.0)
    shared = 264
    with one_thread():
        manifest = build_teacher_cache(
            copy.deepcopy(padded),
            tokenizer,
            rows[:8],
            tmp_path / "cut",
            top_k=TOP_K,
            max_length=MAX_LENGTH,
            vocab_rows=shared,
        )  # the build limits the teacher it is given in place
        build_teacher_cache(padded, tokenizer, rows[:8], tmp_path / "all", top_k=TOP_K, max_length=MAX_LENGTH)
    assert manifest["vocab_rows"] == shared and manifest["max_token_id"] < shared
    batch = ChatMLCollator(tokenizer, max_length=MAX_LENGTH)(rows[:8])
    positions = supervised_positions(batch["labels"])
    got = CacheTeacher(tmp_path / "cut").topk(batch, positions)
    want = LocalTeacher(truncated_copy(padded, shared), top_k=TOP_K).topk(batch, positions)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.logprobs, want.logprobs.half().float(), rtol=2**-10, atol=1e-6)
    CacheTeacher(tmp_path / "cut").check(tokenizer, vocab_size=shared)
    with pytest.raises(ValueError, match=r"\[0, 272\), but this run compares the ids \[0, 264\).*cache.vocab_rows=264"):
        CacheTeacher(tmp_path / "all").check(tokenizer, vocab_size=shared)

    padded.save_pretrained(tmp_path / "teacher7b")
    student = truncated_copy(padded, shared)
    student.save_pretrained(tmp_path / "student05b")
    cfg = OmegaConf.create(
        {"cache": {"vocab_rows": None}, "model": {"student": {"name_or_path": str(tmp_path / "student05b")}}}
    )
    teacher_spec = {"name_or_path": str(tmp_path / "teacher7b")}
    assert cache_vocab_rows(cfg, teacher_spec) == shared
    cfg.cache.vocab_rows = 270
    assert cache_vocab_rows(cfg, teacher_spec) == 270
    cfg.cache.vocab_rows = None
    assert cache_vocab_rows(cfg, {"name_or_path": str(tmp_path / "student05b")}) is None  # the teacher has fewer
