"""teachers/spec.py's share_vocabulary: a student and teachers over one tokenizer, padded to different vocabulary
rows (Qwen2.5-7B's 152,064 against 0.5B's 151,936 over 151,665 tokens), distil over the rows they share. Every loss
path (lean, full logits, an in-process top-k, OPD's policy gradient with on-policy samples, a hidden-state cache)
equals the same run with the models truncated to those rows, in both directions (the teacher padded further, or the
student); the sampler never draws a row past the range; a different row count without a known-same tokenizer, and a
model short of the tokenizer, are still refused."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from helpers.fitting import with_group_defaults
from helpers.padded_vocab import pad_vocabulary, truncated_copy

from lightning_gkd import GKDModule, OPDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.models.loading import vocab_size
from lightning_gkd.ops.hf.heads import SharedRangeHead
from lightning_gkd.samplers import KVCacheSampler
from lightning_gkd.teachers.offline.build import build_teacher_cache
from lightning_gkd.teachers.offline.reader import HiddenCacheTeacher
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

EXACT_SAMPLER = partial(KVCacheSampler, matmul_precision="highest")
SHARED = 264  # the tokenizer has 259 tokens
#: (student rows, teacher rows): the teacher padded further (the Qwen2.5 7B -> 0.5B case), or the student
PADDINGS = [(264, 272), (272, 264)]


def padded_pair(tokenizer, student_rows: int, teacher_rows: int):
    """Padded models, and the same models truncated to the shared rows (the reference)."""
    student = pad_vocabulary(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0), student_rows, seed=2, scale=3.0)
    teacher = pad_vocabulary(tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1), teacher_rows, seed=3, scale=3.0)
    return (student, teacher), (truncated_copy(student, SHARED), truncated_copy(teacher, SHARED))


def local(teacher, tokenizer, **settings):
    return {"kind": "local", "model": teacher, "tokenizer": tokenizer, **settings}


def batch(tokenizer, size=6):
    return ChatMLCollator(tokenizer, max_length=64)(addition_rows("train", 64)[:size])


def gkd(student, teacher, tokenizer, **kwargs):
    defaults = with_group_defaults(
        kwargs,
        sampling={"max_new_tokens": 8, "sampler": EXACT_SAMPLER},
        training={"frozen_dtype": "float32"},
        validation={"metrics": {}},
    )
    return GKDModule(student, teacher, tokenizer, **defaults)


def student_grads(model) -> dict[str, torch.Tensor]:
    """Each gradient over the shared rows only (a padded head's extra rows are checked to be zero elsewhere)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name] = p.grad[:SHARED] if p.shape[0] in (264, 272) and p.dim() == 2 else p.grad
    return out


@pytest.mark.parametrize(("student_rows", "teacher_rows"), PADDINGS)
@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"lmbda": 0.0, "divergence": {"beta": 0.5}}, id="lean"),
        pytest.param({"lmbda": 0.0, "divergence": {"beta": 0.5, "lean_loss": False}}, id="full-logits"),
        pytest.param({"lmbda": 1.0, "divergence": {"beta": 1.0}}, id="on-policy"),
        pytest.param({"lmbda": 0.0, "divergence": {"beta": 0.5}, "top_k": 5}, id="local-top-k"),
    ],
)
def test_gkd_over_padded_vocabularies_equals_the_models_truncated_to_the_shared_rows(
    tokenizer, student_rows, teacher_rows, settings
):
    settings = dict(settings)
    top_k = settings.pop("top_k", None)
    extra = {"top_k": top_k} if top_k else {}
    (student, teacher), (student_ref, teacher_ref) = padded_pair(tokenizer, student_rows, teacher_rows)
    ours = gkd(student, local(teacher, tokenizer, **extra), tokenizer, **settings)
    reference = gkd(student_ref, local(teacher_ref, tokenizer, **extra), tokenizer, **settings)
    assert vocab_size(ours.student) == vocab_size(ours.teacher) == SHARED
    assert {p.shape[0] for n, p in student.named_parameters() if "embed" in n} == {student_rows}  # untouched
    padded = ours.student if student_rows > SHARED else ours.teacher
    assert isinstance(padded.get_output_embeddings(), SharedRangeHead)
    rows = batch(tokenizer)
    loss = ours.training_step(rows, 0)
    expected = reference.training_step(copy.deepcopy(rows), 0)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    ours_grads, reference_grads = student_grads(student), student_grads(student_ref)
    assert ours_grads.keys() == reference_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    head = student.get_output_embeddings().weight
    assert head.grad is not None and not head.grad[SHARED:].any()  # rows past the range take no gradient


@pytest.mark.parametrize(("student_rows", "teacher_rows"), PADDINGS)
def test_opd_over_padded_vocabularies_samples_and_scores_within_the_shared_rows(tokenizer, student_rows, teacher_rows):
    (student, teacher), (student_ref, teacher_ref) = padded_pair(tokenizer, student_rows, teacher_rows)

    def opd(s, t):
        return OPDModule(
            s,
            local(t, tokenizer),
            tokenizer,
            sampling={"max_new_tokens": 8, "sampler": EXACT_SAMPLER},
            training={"frozen_dtype": "float32"},
            validation={"metrics": {}},
        )

    ours, reference = opd(student, teacher), opd(student_ref, teacher_ref)
    rows = batch(tokenizer)
    sampled = ours.sampler.sample(ours.student, rows["prompts"], rows["prompt_attention_mask"], seed=7)
    if student_rows > SHARED:  # the padded rows are 3x the others' spread: unlimited, greedy picks them
        with torch.no_grad():
            logits = student.get_output_embeddings().weight @ torch.randn(
                64, 40, generator=torch.Generator().manual_seed(0)
            )
        assert int(logits.argmax(0).max()) >= SHARED
    assert int(sampled["input_ids"].max()) < SHARED
    loss = ours.training_step(rows, 0)
    expected = reference.training_step(copy.deepcopy(rows), 0)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_a_hidden_state_cache_of_a_teacher_padded_further_gives_the_truncated_teacher(tokenizer, tmp_path):
    (student, teacher), (student_ref, teacher_ref) = padded_pair(tokenizer, 264, 272)
    rows = addition_rows("train", 64)[:6]
    build_teacher_cache(teacher, tokenizer, rows, tmp_path / "hidden", signal="hidden", max_length=64, batch_size=3)
    cached = HiddenCacheTeacher(tmp_path / "hidden")
    assert cached.vocab_size == 272
    ours = gkd(student, cached, tokenizer, lmbda=0.0, divergence={"beta": 0.5})
    reference = gkd(student_ref, local(teacher_ref, tokenizer), tokenizer, lmbda=0.0, divergence={"beta": 0.5})
    assert cached.vocab_size == SHARED  # its head cut to the student's rows
    data = batch(tokenizer)
    torch.testing.assert_close(
        ours.completion_loss(data).loss, reference.completion_loss(data).loss, rtol=2e-3, atol=1e-4
    )  # float16 storage


def test_a_different_row_count_without_a_known_tokenizer_is_refused_as_another_tokenizer(tokenizer):
    student = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)
    teacher = pad_vocabulary(tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1), 272, seed=3)
    with pytest.raises(
        ValueError, match="Student vocabulary size 259 differs from the teacher.s 272, and its tokenizer is not known"
    ):
        gkd(student, teacher, tokenizer)


def test_a_teacher_short_of_the_tokenizer_is_refused(tokenizer):
    student = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)
    teacher = truncated_copy(tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1), 250)
    with pytest.raises(ValueError, match="The teacher's vocabulary has 250 rows but the tokenizer"):
        gkd(student, local(teacher, tokenizer), tokenizer)


def test_a_teacher_folder_with_the_students_tokenizer_and_more_rows_distils_over_the_shared_rows(tokenizer, tmp_path):
    """The Hydra path (model.teacher.name_or_path=<folder>): the folder's tokenizer files confirm the tokenizer."""
    student = pad_vocabulary(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0), SHARED, seed=2)
    teacher = pad_vocabulary(tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1), 272, seed=3)
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    module = gkd(student, str(tmp_path / "teacher"), tokenizer, lmbda=0.0)
    assert vocab_size(module.teacher) == SHARED and module.teacher.get_output_embeddings().weight.shape[0] == 272
    data = batch(tokenizer)
    reference = gkd(copy.deepcopy(student), local(truncated_copy(teacher, SHARED), tokenizer), tokenizer, lmbda=0.0)
    torch.testing.assert_close(module.completion_loss(data).loss, reference.completion_loss(data).loss)


def test_a_hub_teacher_with_more_rows_is_confirmed_by_its_hub_tokenizer(tokenizer, monkeypatch):
    """Qwen/Qwen2.5-7B-Instruct as a hub id: its own tokenizer (fetched with the model's revision) confirms the
    student's; one that cannot be fetched leaves the tokenizer unknown."""
    from lightning_gkd.teachers.spec import TeacherEntry, names_same_tokenizer

    asked = []

    def fetch(name, revision=None, trust_remote_code=False):
        asked.append((name, revision))
        if name == "org/offline":
            raise OSError("We couldn't connect to 'https://huggingface.co'")
        return tokenizer

    monkeypatch.setattr("lightning_gkd.teachers.spec.load_tokenizer", fetch)
    spec = {"name_or_path": "Qwen/Qwen2.5-7B-Instruct", "init_kwargs": {"revision": "abc"}}
    assert names_same_tokenizer(TeacherEntry("local", {"model": spec}), tokenizer) is True
    assert names_same_tokenizer(TeacherEntry("local", {"model": "org/offline"}), tokenizer) is None
    assert names_same_tokenizer(TeacherEntry("local", {"model": "./no/such/folder"}), tokenizer) is None
    assert asked == [("Qwen/Qwen2.5-7B-Instruct", "abc"), ("org/offline", None)]


def test_a_teacher_object_must_subclass_the_teacher_base(teacher):
    """A built teacher's check, check_datamodule and close are called unprobed: TeacherBase gives each a default
    that does nothing, and a sparse teacher object of another class is refused naming it."""
    from lightning_gkd.teachers import LocalTeacher, TeacherBase
    from lightning_gkd.teachers.spec import teacher_plan

    class Bare:
        top_k = 4

        def topk(self, batch, positions):
            raise AssertionError("not called")

    with pytest.raises(TypeError, match=r"must subclass lightning_gkd\.teachers\.base\.TeacherBase .*got Bare"):
        teacher_plan(Bare())
    source = LocalTeacher(teacher, top_k=4)
    assert isinstance(source, TeacherBase) and teacher_plan(source).entries[""].built is source
    source.check(None, 0)
    source.check_datamodule(None)
    source.close()
