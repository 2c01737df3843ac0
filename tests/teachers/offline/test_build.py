"""Building a teacher cache (lightning_gkd/teachers/offline/build.py): the Lightning predict loop writes the shards
(top-k, or hidden states as float16 or bfloat16 and the head), a killed build rerun with the same command writes
only the missing shards and ends byte for byte equal to the one-shot build (one process, or two gloo processes:
tests/helpers/cache_build_worker.py), other settings are refused before the teacher loads, and a teacher padded past
the student's vocabulary is cached over the rows they share.

The one-shot builds are tests/teachers/offline/conftest.py's.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from helpers.cache_build_worker import MAX_LENGTH, TOP_K, settings
from helpers.launch import clean_env
from helpers.paths import TESTS
from helpers.teacher_cache import HIDDEN_SIZE, TEACHER, TRAINER, VOCAB, one_thread, scaled_teacher

import lightning_gkd.teachers.offline.build as cache_build
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.models.loading import load_frozen_causal_lm
from lightning_gkd.teachers import LocalTeacher, supervised_positions
from lightning_gkd.teachers.offline.build import build_teacher_cache
from lightning_gkd.teachers.offline.manifest import read_manifest
from lightning_gkd.teachers.offline.reader import CacheTeacher, HiddenCacheTeacher, open_teacher_cache
from lightning_gkd.teachers.offline.shards import shard_name


def test_cache_size_per_million_tokens_grows_with_k(tmp_path, built, tokenizer, rows):
    k1 = {**settings(), "top_k": 1}
    small = build_teacher_cache(TEACHER, tokenizer, rows, tmp_path / "k1", trainer=TRAINER, **k1).manifest
    large = read_manifest(built)
    assert small["total_tokens"] == large["total_tokens"]
    # per supervised token: k ids (4 B) + k log-probs (2 B) + the next log-prob (2 B), plus offsets and keys
    assert 8 * 1e6 < small["bytes_per_million_tokens"] < large["bytes_per_million_tokens"]
    assert large["bytes_per_million_tokens"] > 20 * 6 * 1e6


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


def test_a_build_with_other_settings_is_refused_before_the_teacher_loads(tmp_path, built, tokenizer, rows, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(cache_build, "load_frozen_causal_lm", no_model)
    same = build_teacher_cache(TEACHER, tokenizer, rows, built, trainer=TRAINER, **settings()).manifest  # a no-op
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
    ).manifest
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
    report = build_teacher_cache(TEACHER, tokenizer, rows, folder, trainer=TRAINER, signal="hidden", **settings())
    assert report.built_shards == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in hidden_built.iterdir())
    for path in hidden_built.iterdir():
        assert (folder / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_hidden_build_refuses_other_settings_and_a_head_it_cannot_describe(
    tmp_path, hidden_built, built, tokenizer, rows, teacher, monkeypatch
):
    # a rerun with another signal or dtype, before any model loads
    def no_model(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(cache_build, "load_frozen_causal_lm", no_model)
    hidden = {**settings(), "signal": "hidden"}
    assert build_teacher_cache(
        TEACHER, tokenizer, rows, hidden_built, trainer=TRAINER, **hidden
    ).manifest == read_manifest(hidden_built)  # complete: nothing to do
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

    # a teacher whose logits are not its head applied to its final hidden states: refused, nothing written
    doubled = copy.deepcopy(teacher)
    doubled.lm_head.register_forward_hook(lambda module, args, output: output * 2)
    folder = tmp_path / "doubled"
    with pytest.raises(
        ValueError, match=r"Qwen2ForCausalLM's head cannot be described so \(.*\)\. .*: cache\.signal=topk\."
    ):
        build_teacher_cache(doubled, tokenizer, rows, folder, trainer=TRAINER, **hidden)
    assert not any(folder.iterdir())


def test_a_top_k_cache_from_before_signal_opens_and_resumes(tmp_path, built, tokenizer, rows):
    # a top-k cache from before signal= (no signal, hidden_dtype or head in its manifest) still opens and resumes
    old = tmp_path / "old"
    old.mkdir()
    for path in built.iterdir():
        (old / path.name).write_bytes(path.read_bytes())
    manifest = {k: v for k, v in read_manifest(built).items() if k not in ("signal", "hidden_dtype", "head")}
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert isinstance(open_teacher_cache(old), CacheTeacher)
    assert build_teacher_cache(TEACHER, tokenizer, rows, old, trainer=TRAINER, **settings()).manifest == manifest


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
        ).manifest  # the build limits the teacher it is given in place
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
