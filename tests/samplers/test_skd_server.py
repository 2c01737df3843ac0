"""Speculative KD verified by a served top-k teacher (``teachers.server.ServerBlockVerifier``) against a fake vLLM
server (``lightning_gkd.testing.fake_vllm_server``) serving the tiny teacher: its keep/replace decisions and samples
are the in-process teacher's where the served top-k holds the whole sampling support (the server's top-k = the
vocabulary, or a sampling top_k below the server's); a GKD fit with sampler=skd and teacher=server through a real
Trainer samples what the in-process teacher would; accept_top_k above the server's top_k is refused, naming both."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from helpers.fitting import fit, logged, make_module

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.ops.decoding.speculative import ModelVerifier, speculative_tokens
from lightning_gkd.samplers import SpeculativeKDSampler
from lightning_gkd.teachers import LocalTeacher
from lightning_gkd.teachers.server import ServerBlockVerifier, ServerTeacher
from lightning_gkd.teachers.spec import teacher_plan
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer
from lightning_gkd.toy import addition_rows

FAST: dict[str, Any] = {"retries": 2, "backoff": 0.01, "timeout": 20.0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def prompts(tokenizer, size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    batch = ChatMLCollator(tokenizer, max_length=40)(addition_rows(split="val")[:size])
    return batch["prompts"], batch["prompt_attention_mask"]


def decode(student, teacher, tokenizer, **settings):
    ids, mask = prompts(tokenizer)
    options = {
        "max_new_tokens": 10,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "seed": 5,
        "accept_top_k": 3,
        "draft_tokens": 3,
        "temperature": 0.9,
    }
    return speculative_tokens(student.eval(), teacher, ids, mask, **{**options, **settings})


@pytest.mark.parametrize(
    ("server_top_k", "sampling_top_k", "accept_top_k"),
    [("vocabulary", 0, 100), (20, 5, 20)],
    ids=["served top-k = vocabulary", "sampling top-k inside the served top-k"],
)
def test_the_served_verifier_decides_and_samples_as_the_in_process_teacher(
    server_top_k, sampling_top_k, accept_top_k, student, teacher, tokenizer
):
    """The served top-k (with the draft's own log-prob) holds the teacher's top-K and the whole support of its sampling
    distribution: every keep/replace decision, every token and every ``log P(x)`` is the in-process teacher's."""
    vocab = teacher.config.vocab_size
    k = vocab if server_top_k == "vocabulary" else server_top_k
    settings = {"top_k": sampling_top_k, "accept_top_k": accept_top_k}
    local = decode(student, teacher.eval(), tokenizer, **settings)
    assert 0 < local.replaced.float().mean() < 1  # both branches are exercised
    with FakeVLLMServer(teacher, tokenizer, max_logprobs=vocab, max_model_len=64) as fake:
        served_teacher = ServerTeacher(fake.url, top_k=k, **FAST)
        served_teacher.check(tokenizer, vocab)
        served = decode(student, served_teacher.block_verifier(accept_top_k), tokenizer, **settings)
        assert served.teacher_tokens > 0 and fake.count("/v1/completions") > 2  # the probes, then a row per block
        served_teacher.close()
    assert torch.equal(served.tokens, local.tokens)
    assert torch.equal(served.replaced, local.replaced)
    assert served.blocks == local.blocks and served.student_tokens == local.student_tokens
    torch.testing.assert_close(served.logprobs, local.logprobs, atol=1e-4, rtol=1e-4)


def test_the_verifiers_see_the_same_top_k_of_a_block(student, teacher, tokenizer):
    """One block through both verifiers: at every draft the served log-probs are the in-process ones at the server's
    top-k and the draft, −inf elsewhere, so the top-K membership of each draft (K <= k) is the same."""
    ids, mask = prompts(tokenizer)
    drafts = torch.randint(3, teacher.config.vocab_size, (ids.shape[0], 4), generator=torch.Generator().manual_seed(0))
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    vocab = teacher.config.vocab_size
    in_process = ModelVerifier(teacher)
    in_process.begin(ids, mask, max_new_tokens=8)
    full = in_process.verify(drafts, finished, vocab).log_softmax(-1)
    in_process.finish()
    with FakeVLLMServer(teacher, tokenizer, max_model_len=64) as fake:
        served_teacher = ServerTeacher(fake.url, top_k=10, **FAST)
        served_teacher.check(tokenizer, vocab)
        verifier = served_teacher.block_verifier(10)
        assert isinstance(verifier, ServerBlockVerifier)
        verifier.begin(ids, mask, max_new_tokens=8)
        sparse = verifier.verify(drafts, finished, vocab)
        verifier.finish()
        served_teacher.close()
    known = torch.isfinite(sparse)
    assert bool((known.sum(-1) >= 10).all()) and bool(known.gather(-1, drafts[..., None]).all())
    torch.testing.assert_close(sparse[known], full[known], atol=1e-4, rtol=0)
    for k in (1, 5, 10):
        full_top = full >= full.topk(k, dim=-1).values[..., -1:]
        sparse_top = sparse >= sparse.topk(k, dim=-1).values[..., -1:]
        assert torch.equal(full_top.gather(-1, drafts[..., None]), sparse_top.gather(-1, drafts[..., None]))


def test_a_gkd_fit_with_sampler_skd_and_a_served_teacher(student, teacher, tokenizer, toy_rows, tmp_path):
    """GKD with sampler=skd and teacher=server through a real Trainer: the sampler verifies with the server, the
    replacement rate is logged per step, and its samples are those the in-process teacher gives (sampling top_k 5 <=
    the server's 20: exact)."""
    sampler = partial(SpeculativeKDSampler, accept_top_k=4, draft_tokens=3)
    sampling = {"sampler": sampler, "top_k": 5, "max_new_tokens": 6}
    local = make_module(student, teacher, tokenizer, lmbda=1.0, sampling=sampling)
    batch = ChatMLCollator(tokenizer, max_length=64)(toy_rows["train"][:4])
    with FakeVLLMServer(teacher, tokenizer, max_model_len=64) as fake:
        spec = {"kind": "server", "url": fake.url, "top_k": 20, **FAST}
        served = make_module(student, spec, tokenizer, lmbda=1.0, sampling=sampling)
        assert isinstance(served.sampler, SpeculativeKDSampler) and served.sampler.teacher is None
        with torch.no_grad():
            want = local.sample_batch(local.student, dict(batch), seed=11)
            got = served.sample_batch(served.student, dict(batch), seed=11)
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(got[key], want[key]), key
        torch.testing.assert_close(got["sampled_logprobs"], want["sampled_logprobs"], atol=1e-4, rtol=1e-4)
        fake.reset()
        fit(served, tokenizer, toy_rows, tmp_path, max_steps=2)
        assert fake.count("/v1/completions") > 0
    rates = logged(tmp_path, "train/sampler/replacement_rate")
    assert len(rates) == 2 and all(0 <= rate <= 1 for rate in rates)
    losses = logged(tmp_path, "train/loss")
    assert len(losses) == 2 and all(loss == loss for loss in losses)


def test_accept_top_k_above_the_servers_top_k_is_refused_naming_both():
    """Before any model loads (the plan and the sampler's option), and when the teacher source is bound."""
    plan = teacher_plan({"kind": "server", "url": "http://127.0.0.1:9", "top_k": 20})
    with pytest.raises(ValueError, match=r"accept_top_k=25 is above the served teacher's top_k=20") as raised:
        SpeculativeKDSampler.check_teachers(plan, accept_top_k=25)
    message = str(raised.value)
    assert "Lower sampler.accept_top_k to 20 or less, or raise teacher.top_k to 25" in message
    SpeculativeKDSampler.check_teachers(plan, accept_top_k=20)
    SpeculativeKDSampler.check_teachers(plan)  # without the option: checked when the source is bound
    default = teacher_plan({"kind": "server", "url": "http://127.0.0.1:9"})  # ServerTeacher's top_k 20
    with pytest.raises(ValueError, match="top_k=20"):
        SpeculativeKDSampler.check_teachers(default, accept_top_k=21)
    sampler = SpeculativeKDSampler(tokenizer=None, accept_top_k=6)
    with pytest.raises(ValueError, match=r"accept_top_k=6 is above the served teacher's top_k=5"):
        sampler.bind_teachers({"": ServerTeacher("http://127.0.0.1:9", top_k=5)})  # no request is made
    sampler.bind_teachers({"": ServerTeacher("http://127.0.0.1:9", top_k=6)})
    assert sampler.verifier is not None and sampler.teacher is None


def test_teachers_that_cannot_verify_are_refused(teacher):
    for spec, kind in (
        ({"kind": "server", "signal": "hidden", "url": "http://127.0.0.1:9"}, r"server \(signal=hidden\)"),
        ({"kind": "cache", "path": "/nowhere"}, "cache"),
    ):
        with pytest.raises(ValueError, match=f"sampler=skd verifies .*got teacher: {kind}"):
            SpeculativeKDSampler.check_teachers(teacher_plan(spec), accept_top_k=5)
    SpeculativeKDSampler.check_teachers(teacher_plan(teacher), accept_top_k=500)  # in process: any K
    sampler = SpeculativeKDSampler(tokenizer=None, accept_top_k=500)
    sampler.bind_teachers({"": LocalTeacher(teacher)})
    assert sampler.teacher is teacher


def test_a_method_refuses_accept_top_k_above_the_servers_before_any_model_loads(tmp_path):
    """Through GKDModule (as Hydra builds it): the factory's accept_top_k meets the plan's top_k before the student
    (a folder that does not exist) would load."""
    from lightning_gkd import GKDModule
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer

    with pytest.raises(ValueError, match=r"accept_top_k=25 is above the served teacher's top_k=20"):
        GKDModule(
            str(tmp_path / "no-student-here"),
            {"kind": "server", "url": "http://127.0.0.1:9", "top_k": 20},
            build_chatml_tokenizer(),
            lmbda=1.0,
            sampling={"sampler": partial(SpeculativeKDSampler, accept_top_k=25)},
        )
