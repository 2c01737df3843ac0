"""lightning_gkd.ops.decoding.speculative: speculative KD's sampling (the student proposes, the teacher keeps its
top-K or replaces), checked against plain sampling, the teacher's greedy decode, token-by-token verification, and the
proposal probability recomputed from full forwards of both models."""

import pytest
import torch
from helpers.tiny_registry import build_tiny, tiny_config

from lightning_gkd.ops.decoding.sampling import generate_completions, sampling_logits
from lightning_gkd.ops.decoding.speculative import speculative_completions, speculative_tokens
from lightning_gkd.ops.hf.forward import eval_mode

VOCAB = 40
EOS, PAD = 2, 0
# student/teacher family pairs: caches of different classes and layouts (GPT-2's learned positions, GPT-
# NeoX's partial rotary, Llama's untied head)
PAIRS = [("qwen2", "qwen2"), ("llama", "gpt2"), ("gpt_neox", "phi3")]


def tiny(family: str, seed: int) -> torch.nn.Module:
    return build_tiny(tiny_config(family, VOCAB), seed).double().eval()


@pytest.fixture(scope="module")
def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = PAD, 0  # left padding of uneven prompts
    ids[2, :1], mask[2, :1] = PAD, 0
    return ids, mask


def decode(student, teacher, prompts, **settings):
    ids, mask = prompts
    options = dict(max_new_tokens=10, pad_token_id=PAD, eos_token_id=EOS, seed=5, accept_top_k=4, draft_tokens=3)
    return speculative_tokens(student, teacher, ids, mask, **{**options, **settings})


@pytest.mark.parametrize("student_family, teacher_family", PAIRS)
def test_block_verification_gives_the_tokens_of_token_by_token_verification(student_family, teacher_family, prompts):
    student, teacher = tiny(student_family, 0), tiny(teacher_family, 1)
    by_token = decode(student, teacher, prompts, draft_tokens=1)
    assert 0 < by_token.replaced.float().mean() < 1  # both branches are exercised
    for n in (2, 4, 10):
        block = decode(student, teacher, prompts, draft_tokens=n)
        assert torch.equal(block.tokens, by_token.tokens) and torch.equal(block.replaced, by_token.replaced)
        torch.testing.assert_close(block.logprobs, by_token.logprobs)
    # where the teacher accepts most drafts, longer drafts take fewer verification rounds
    lenient = decode(student, teacher, prompts, accept_top_k=36, draft_tokens=4)
    assert lenient.blocks < decode(student, teacher, prompts, accept_top_k=36, draft_tokens=1).blocks


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 1.0, 1.0), (5, 0.9, 0.7)])
def test_k_at_the_vocabulary_size_is_plain_student_sampling(prompts, top_k, top_p, temperature):
    student, teacher = tiny("qwen2", 0), tiny("llama", 1)
    ids, mask = prompts
    options = dict(max_new_tokens=10, pad_token_id=PAD, eos_token_id=EOS, seed=9, top_k=top_k, top_p=top_p)
    got = speculative_tokens(
        student, teacher, ids, mask, accept_top_k=VOCAB, draft_tokens=3, temperature=temperature, **options
    )
    want = generate_completions(student, ids, mask, temperature=temperature, **options)
    assert torch.equal(got.tokens, want["input_ids"][:, ids.shape[1] :])
    torch.testing.assert_close(got.logprobs, want["sampled_logprobs"][:, ids.shape[1] :])
    assert not got.replaced.any()


def test_k_one_keeps_only_the_teachers_top1_and_a_greedy_teacher_writes_every_token(prompts):
    student, teacher = tiny("qwen2", 1), tiny("qwen2", 1)  # the same model: its low-temperature draws are often top-1
    ids, mask = prompts
    sample = decode(student, teacher, prompts, accept_top_k=1, temperature=0.5)
    full = torch.cat([ids, sample.tokens], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(sample.tokens)], 1)
    position_ids = (full_mask.cumsum(1) - 1).clamp(min=0)
    teacher_logits = teacher(input_ids=full, attention_mask=full_mask, position_ids=position_ids).logits
    argmax = teacher_logits[:, ids.shape[1] - 1 : -1].argmax(-1)
    live = sample.logprobs != 0
    kept = live & ~sample.replaced
    assert kept.any() and sample.replaced.any()
    assert torch.equal(sample.tokens[kept], argmax[kept])
    # with greedy draws (sampling top_k=1) for both models, the sequence is the teacher's greedy decode
    greedy = decode(student, teacher, prompts, accept_top_k=1, top_k=1)
    want = generate_completions(
        teacher, ids, mask, max_new_tokens=10, pad_token_id=PAD, eos_token_id=EOS, do_sample=False
    )
    assert torch.equal(greedy.tokens, want["input_ids"][:, ids.shape[1] :])


def test_logprobs_are_the_mixture_the_tokens_were_drawn_from(prompts):
    """log P(x) = log(q_S(x)·1[x ∈ top-K] + q_S(outside top-K)·q_T(x)), recomputed position by position from full
    forwards of both models on the final sequences; kept tokens are in the teacher's top-K."""
    student, teacher = tiny("llama", 0), tiny("qwen2", 1)
    ids, mask = prompts
    k, options = 3, dict(temperature=0.8, top_k=0, top_p=0.95)
    sample = decode(student, teacher, prompts, accept_top_k=k, **options)
    full = torch.cat([ids, sample.tokens], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(sample.tokens)], 1)
    position_ids = (full_mask.cumsum(1) - 1).clamp(min=0)
    s_logits = student(input_ids=full, attention_mask=full_mask, position_ids=position_ids).logits.double()
    t_logits = teacher(input_ids=full, attention_mask=full_mask, position_ids=position_ids).logits.double()
    prompt_len = ids.shape[1]
    checked = 0
    for row in range(full.shape[0]):
        for col in range(sample.tokens.shape[1]):
            if col > 0 and sample.tokens[row, col - 1] in (EOS, PAD) and sample.logprobs[row, col] == 0:
                break
            token = int(sample.tokens[row, col])
            s = sampling_logits(s_logits[row, prompt_len + col - 1][None], **options).softmax(-1)[0]
            t = sampling_logits(t_logits[row, prompt_len + col - 1][None], **options).softmax(-1)[0]
            raw = t_logits[row, prompt_len + col - 1]
            top = raw >= raw.topk(k).values[-1]
            expected = s[token] * top[token] + s[~top].sum() * t[token]
            assert sample.logprobs[row, col].item() == pytest.approx(expected.log().item(), abs=1e-5)
            if not sample.replaced[row, col]:
                assert top[token]
            checked += 1
            if token == EOS:
                break
    assert checked > 20


def test_samples_are_deterministic_per_seed_and_padded_after_eos(prompts):
    student, teacher = tiny("qwen2", 0), tiny("llama", 1)
    ids, mask = prompts
    settings = dict(max_new_tokens=12, pad_token_id=PAD, eos_token_id=EOS, accept_top_k=5, draft_tokens=3)
    first, _ = speculative_completions(student, teacher, ids, mask, seed=1, **settings)
    again, sample = speculative_completions(student, teacher, ids, mask, seed=1, **settings)
    other, _ = speculative_completions(student, teacher, ids, mask, seed=2, **settings)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["input_ids"], other["input_ids"])
    labels = first["labels"][:, ids.shape[1] :]
    for row in range(ids.shape[0]):
        tokens = sample.tokens[row].tolist()
        if EOS in tokens:
            end = tokens.index(EOS)
            assert (labels[row, end + 1 :] == -100).all() and labels[row, end] == EOS
            assert (sample.logprobs[row, end + 1 :] == 0).all() and not sample.replaced[row, end + 1 :].any()
    assert ((first["sampled_logprobs"] != 0) == (first["labels"] != -100)).all()


def test_models_are_restored_to_their_mode_and_options_are_checked(prompts):
    student, teacher = tiny("qwen2", 0).train(), tiny("qwen2", 1)
    ids, mask = prompts
    settings = dict(max_new_tokens=4, pad_token_id=PAD, eos_token_id=EOS, accept_top_k=5, draft_tokens=2)
    with eval_mode(teacher):
        speculative_completions(student, teacher, ids, mask, **settings)
    assert student.training
    with pytest.raises(ValueError, match="accept_top_k must be an integer >= 1.*got 0"):
        speculative_tokens(student, teacher, ids, mask, **{**settings, "accept_top_k": 0})
    with pytest.raises(ValueError, match="draft_tokens must be an integer >= 1.*got 0"):
        speculative_tokens(student, teacher, ids, mask, **{**settings, "draft_tokens": 0})
    wider = build_tiny(tiny_config("qwen2", VOCAB + 8), 1).double()
    with pytest.raises(ValueError, match=r"vocabulary \(40\) and the teacher's \(48\) differ"):
        speculative_tokens(student, wider, ids, mask, **settings)
