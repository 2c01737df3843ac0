"""The `lightning-gkd-cache` Hydra entry point (lightning_gkd/cli/cache_teacher.py): it caches the toy teacher's
top-k or hidden states over data='s training then validation rows, does nothing when the cache is complete, refuses
other settings, and with cache.completions=teacher (offline SeqKD) caches the teacher's own completions, which a
training run then reads with teacher=cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cache_build_worker import BATCH_SIZE, settings
from helpers.paths import TESTS
from helpers.teacher_cache import HIDDEN_SIZE, TEACHER, TRAINER, VOCAB
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lightning_gkd.teachers.offline.build import build_teacher_cache
from lightning_gkd.teachers.offline.reader import CacheTeacher, HiddenCacheTeacher
from lightning_gkd.toy import addition_rows


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
    built = build_teacher_cache(TEACHER, TEACHER, rows, tmp_path / "teacher_cache", trainer=TRAINER, **same)
    assert built.manifest == manifest
    with pytest.raises(ValueError, match="k: 20 there, 5 now"):
        run(compose_cache(tmp_path, [*overrides, "cache.top_k=5"]))
    with pytest.raises(ValueError, match="cache.top_k must be an integer >= 1, got 0"):
        run(compose_cache(tmp_path, [*overrides, "cache.top_k=0"]))


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


def test_offline_seq_kd_caches_the_teachers_own_completions_and_trains_from_them(tmp_path, capsys):
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
