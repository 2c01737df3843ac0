"""Reading a teacher cache (lightning_gkd/teachers/offline/reader.py): CacheTeacher (top-k) gives what the live
teacher gives, HiddenCacheTeacher (final hidden states and the head: an exact dense teacher) its states, head, losses
and gradients, training from either equals training with the live teacher, and what does not match the run (the
tokenizer, the data, the vocabulary, an incomplete cache, another signal) is refused, naming what to do.

The caches are built once per session by tests/teachers/offline/conftest.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.cache_build_worker import MAX_LENGTH, ROWS, TOP_K
from helpers.teacher_cache import HIDDEN_SIZE, TEACHER, TRAINER, VOCAB, batches

from lightning_gkd import ChatDataModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.teachers import LocalTeacher, SparseTeacher, Teacher, supervised_positions
from lightning_gkd.teachers.offline.build import build_teacher_cache
from lightning_gkd.teachers.offline.manifest import read_manifest
from lightning_gkd.teachers.offline.reader import CacheMiss, CacheTeacher, HiddenCacheTeacher, open_teacher_cache
from lightning_gkd.teachers.offline.shards import shard_name
from lightning_gkd.teachers.spec import teacher_plan
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path


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


@pytest.mark.parametrize("signal", ["topk", "hidden"])
def test_training_from_the_cache_equals_training_with_the_live_teacher(tmp_path, tokenizer, rows, signal):
    """GKD supervised KD (lmbda=0, beta=0.5) from a k=V cache or a hidden-state cache (the dense loss, no teacher
    model) and from the in-process teacher's full distributions: the same losses step by step (up to the cache's
    float16 numbers), training and validation rows both found."""
    import csv
    from functools import partial

    from helpers.fitting import small_trainer

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
        trainer = small_trainer(
            root, csv=True, max_steps=4, val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=0
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


def test_hidden_cache_refusals(hidden_built, built, tokenizer, rows):
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
