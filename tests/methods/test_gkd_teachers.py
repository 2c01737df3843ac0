"""GKDModule against teachers other than one full in-process model: a local teacher's top-k (the sparse loss end
to end), several teachers routed by a data column, the settings each kind refuses before any model loads, and a
teacher that stays down (checkpoint, resume, no step trained twice; under DDP for one rank only: every rank stops
together). Plain Lightning Trainer, real collation."""

import json
import subprocess
import sys
import time

import pytest
import torch
from helpers import fitting
from helpers.fitting import logged, small_trainer, with_group_defaults
from helpers.launch import clean_env
from helpers.paths import HELPERS

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss
from lightning_gkd.teachers import LocalTeacher, TeacherUnavailable, next_tokens, supervised_positions
from lightning_gkd.teachers.base import TeacherBase
from lightning_gkd.teachers.spec import teacher_plan
from lightning_gkd.toy.tiny import TINY_TEACHER, tiny_causal_lm


def make_module(student, teacher, tokenizer, **kwargs):
    return fitting.make_module(student, teacher, tokenizer, **with_group_defaults(kwargs, validation={"metrics": {}}))


def fit(module, tokenizer, rows, root, max_steps=3, ckpt_path=None):
    datamodule = ChatDataModule(tokenizer, rows["train"], rows["val"], batch_size=4, max_length=64)
    # a ModelCheckpoint, as in a run: a teacher outage saves last.ckpt into its folder
    trainer = small_trainer(root, csv=True, max_steps=max_steps, enable_checkpointing=True)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    return trainer


def batch_of(tokenizer, rows, start=0, size=5):
    return ChatMLCollator(tokenizer, max_length=64)(rows["train"][start : start + size])


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_local_top_k_at_full_vocabulary_trains_like_the_dense_loss(
    student, teacher, tokenizer, toy_rows, tmp_path, beta
):
    vocab = teacher.config.vocab_size
    dense_student = type(student)(student.config)
    dense_student.load_state_dict(student.state_dict())
    dense = make_module(dense_student, teacher, tokenizer, lmbda=0.5, divergence={"beta": beta})
    fit(dense, tokenizer, toy_rows, tmp_path / "dense")
    sparse_spec = {"kind": "local", "model": teacher, "top_k": vocab}
    sparse = make_module(student, sparse_spec, tokenizer, lmbda=0.5, divergence={"beta": beta})
    assert sparse.teacher is teacher and sparse.teacher_source.top_k == vocab
    fit(sparse, tokenizer, toy_rows, tmp_path / "sparse")
    dense_losses, sparse_losses = (
        logged(tmp_path / "dense", "train/loss"),
        logged(tmp_path / "sparse", "train/loss"),
    )
    assert len(sparse_losses) == 3 and logged(tmp_path / "sparse", "train/on_policy") == logged(
        tmp_path / "dense", "train/on_policy"
    )
    assert sparse_losses == pytest.approx(dense_losses, rel=1e-5, abs=3e-6)  # a bfloat16 teacher


def test_sampled_token_estimators_are_the_mean_log_ratio(student, teacher, tokenizer, toy_rows):
    batch = batch_of(tokenizer, toy_rows)
    positions = supervised_positions(batch["labels"])
    student_lp = torch.log_softmax(student(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits, -1)
    teacher_lp = torch.log_softmax(LocalTeacher(teacher).logits(batch).float(), -1)
    tokens = next_tokens(batch["input_ids"], positions).unsqueeze(-1)
    s, t = student_lp[positions].gather(-1, tokens).squeeze(-1), teacher_lp[positions].gather(-1, tokens).squeeze(-1)
    expected = {"k1": (s - t).mean(), "k3": (torch.exp(t - s) - 1 - (t - s)).mean()}
    spec = {"kind": "local", "model": teacher, "top_k": 1}
    for estimator, value in expected.items():
        module = make_module(student, spec, tokenizer, lmbda=1.0, divergence={"beta": 1.0, "sparse_loss": estimator})
        assert module.distillation_loss(batch).loss.item() == pytest.approx(value.item(), rel=1e-4, abs=1e-5)


def two_teachers(tokenizer, teacher):
    other = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=7)
    return other, {
        "kind": "multi",
        "column": "teacher",
        "teachers": {"a": {"kind": "local", "model": teacher}, "b": {"kind": "local", "model": other}},
    }


def routed_rows(rows, names=("a", "b", "b")):
    return {
        split: [{**row, "teacher": names[i % len(names)]} for i, row in enumerate(part)] for split, part in rows.items()
    }


def test_multi_teacher_routes_each_row_to_its_teacher(student, teacher, tokenizer, toy_rows, tmp_path):
    other, spec = two_teachers(tokenizer, teacher)
    module = make_module(student, spec, tokenizer, lmbda=0.0, divergence={"beta": 0.0})
    assert set(module.teacher.keys()) == {"a", "b"}
    rows = routed_rows(toy_rows)
    # the routed loss is each teacher's loss on its own rows, token-weighted
    datamodule = ChatDataModule(tokenizer, rows["train"], rows["val"], batch_size=4, max_length=64)
    module.check_datamodule(datamodule)
    batch = datamodule.collator(rows["train"][:6])
    assert batch["teacher"] == ["a", "b", "b", "a", "b", "b"]
    with torch.no_grad():
        routed = module.distillation_loss(batch).loss
        parts = []
        for name, model in (("a", teacher), ("b", other)):
            keep = [i for i, value in enumerate(batch["teacher"]) if value == name]
            sub = {k: v[keep] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            labels = sub["labels"][:, 1:]
            student_logits = student(input_ids=sub["input_ids"], attention_mask=sub["attention_mask"]).logits
            loss = generalized_jsd_loss(
                student_logits[:, :-1], LocalTeacher(model).logits(sub)[:, :-1], labels=labels, beta=0.0
            )
            parts.append((loss, int((labels != -100).sum())))
    expected = sum(loss * n for loss, n in parts) / sum(n for _, n in parts)
    assert routed.item() == pytest.approx(expected.item(), rel=1e-5)
    # trained: per-teacher token counts logged, the two teachers' models never change
    fit(module, tokenizer, rows, tmp_path, max_steps=2)
    seen = {name: sum(logged(tmp_path, f"train/teacher/{name}/tokens")) for name in ("a", "b")}
    assert seen["a"] > 0 and seen["b"] > seen["a"]  # two rows in three are b's


def test_multi_teacher_names_rows_it_cannot_route(student, teacher, tokenizer, toy_rows):
    _, spec = two_teachers(tokenizer, teacher)
    module = make_module(student, spec, tokenizer, lmbda=0.0)
    rows = routed_rows(toy_rows, names=("a", "c"))
    datamodule = ChatDataModule(tokenizer, rows["train"], rows["val"], batch_size=4, max_length=64)
    module.check_datamodule(datamodule)
    with pytest.raises(ValueError, match=r"'c'.*'a', 'b'"):
        module.distillation_loss(datamodule.collator(rows["train"][:4]))
    unlabelled = ChatDataModule(tokenizer, toy_rows["train"], toy_rows["val"], batch_size=4, max_length=64)
    with pytest.raises(ValueError, match=r"train_data row 0 has no string 'teacher' column"):
        module.check_datamodule(unlabelled)


@pytest.mark.parametrize(
    "teacher_spec, kwargs, match",
    [
        ({"kind": "cache", "path": "x"}, {"lmbda": 0.5}, "lmbda=0.0"),
        (
            {"kind": "local", "model": "x", "top_k": 5},
            {"divergence": {"loss_temperature": 2.0}},
            "loss_temperature=1.0",
        ),
        ({"kind": "local", "model": "x", "top_k": 5}, {"divergence": {"sparse_loss": "k1"}, "lmbda": 1.0}, "beta=1.0"),
        ({"kind": "local", "model": "x"}, {"divergence": {"sparse_loss": "k2"}}, "sparse_loss must be one of"),
        ({"kind": "server", "url": "http://127.0.0.1:9", "tokens": 3}, {}, "unknown key.*tokens"),
        ({"kind": "remote", "url": "x"}, {}, "kind must be one of"),
        ({"kind": "local", "model": "x", "top_k": 0}, {}, "top_k must be a positive integer"),
        ({"kind": "cache"}, {}, "needs teacher.path"),
        ({"kind": "multi", "teachers": {}}, {}, "at least one teacher"),
        ({"kind": "multi", "teachers": {"a": {"kind": "local", "model": "x", "top_k": 3}}}, {"seq_kd": True}, "seq_kd"),
    ],
)
def test_teacher_settings_refused_before_models_load(tokenizer, teacher_spec, kwargs, match):
    # "x" is no model: an error about it would mean loading was attempted first
    with pytest.raises(ValueError, match=match):
        GKDModule("x", teacher_spec, tokenizer, **kwargs)


def test_plain_model_sources_stay_local_dense(teacher):
    plan = teacher_plan({"name_or_path": "some/folder"})
    assert plan.all_dense and plan.entries[""].settings["model"] == {"name_or_path": "some/folder"}
    assert teacher_plan(teacher).entries[""].kind == "local"


class FlakyTeacher(TeacherBase):
    """A sparse teacher over a real model that is down for the calls in ``down``."""

    def __init__(self, model, down=()):
        self.inner, self.top_k, self.down, self.calls = LocalTeacher(model, top_k=64), 64, set(down), 0

    def topk(self, batch, positions):
        self.calls += 1
        if self.calls in self.down:
            raise TeacherUnavailable("http://127.0.0.1:1: stayed down after 4 attempts")
        return self.inner.topk(batch, positions)


def test_a_teacher_outage_saves_a_checkpoint_and_the_resumed_run_trains_no_step_twice(
    student, teacher, tokenizer, toy_rows, tmp_path
):
    initial = {k: v.clone() for k, v in student.state_dict().items()}

    def fresh_student():
        model = type(student)(student.config)
        model.load_state_dict(initial)
        return model

    whole = make_module(fresh_student(), FlakyTeacher(teacher), tokenizer, lmbda=0.0, divergence={"beta": 0.0})
    fit(whole, tokenizer, toy_rows, tmp_path / "whole", max_steps=5)
    broken = make_module(
        fresh_student(), FlakyTeacher(teacher, down={3}), tokenizer, lmbda=0.0, divergence={"beta": 0.0}
    )
    with pytest.raises(TeacherUnavailable):
        fit(broken, tokenizer, toy_rows, tmp_path / "broken", max_steps=5)
    saved = next((tmp_path / "broken").glob("**/checkpoints/last.ckpt"))
    assert torch.load(saved, weights_only=True)["global_step"] == 2  # the two steps before the outage
    before = logged(tmp_path / "broken", "train/loss")
    resumed = make_module(fresh_student(), FlakyTeacher(teacher), tokenizer, lmbda=0.0, divergence={"beta": 0.0})
    fit(resumed, tokenizer, toy_rows, tmp_path / "resumed", max_steps=5, ckpt_path=saved)
    after = logged(tmp_path / "resumed", "train/loss")
    assert len(before) == 2 and len(after) == 3
    assert before + after == pytest.approx(logged(tmp_path / "whole", "train/loss"), rel=1e-5)
    final = dict(whole.student.named_parameters())
    assert all(torch.allclose(p, final[n], atol=1e-6) for n, p in resumed.student.named_parameters())


@pytest.mark.multiprocess
def test_a_teacher_server_down_for_one_ddp_rank_stops_every_rank_together(tmp_path):
    """Two CPU ranks (tests/helpers/teacher_outage_ddp_worker.py), each with its own teacher server; rank 1's stops
    after step 2. Rank 1 alone cannot stop: rank 0 would wait in backward's gradient all-reduce until the process
    group's timeout (30 s there, 30 minutes by default). The ranks agree after each step's teacher calls: both raise
    TeacherUnavailable naming rank 1, the checkpoint is written once at step 2, and the resume hint printed once."""
    out = tmp_path / "run"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(HELPERS / "teacher_outage_ddp_worker.py"), str(out)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert rank["world_size"] == 2
        assert rank["error"] == "TeacherUnavailable", rank  # not the gloo timeout of a rank left waiting
        assert rank["message"].startswith("rank 1 of 2: The teacher server at http://127.0.0.1:")
        assert "rank 0 of 2" not in rank["message"]  # rank 0's server answered
        assert "all 2 ranks stopped together" in rank["message"]
        assert rank["global_step"] == 2 and rank["seconds"] < 30  # stopped at once, not after the timeout
    saved = out / "checkpoints" / "last.ckpt"
    assert ranks[0]["saved"] == ranks[1]["saved"] == str(saved)
    assert torch.load(saved, weights_only=True)["global_step"] == 2
    assert list(out.rglob("*.ckpt")) == [saved]
    logs = done.stdout + done.stderr
    assert logs.count("The teacher server is unavailable (rank 1 of 2:") == 1, logs[-4000:]
    assert logs.count(f"resume with ckpt_path={saved}") == 1
    assert seconds < 200
