"""Tests for lightning_gkd.ops.decoding.sampling (on-policy sampling)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_gkd.ops.decoding.sampling import (
    _pick_tokens,
    completion_batch,
    completion_lengths,
    generate_completions,
    position_ids_from_mask,
    resolve_eos_token_id,
    sample_tokens,
)

VOCAB = 64
PAD = 0


# --------------------------------------------------------------------------- fixtures


class _CountingCache:
    """Stands in for a KV cache: counts the tokens fed so far."""

    def __init__(self) -> None:
        self.seen = 0


class ScriptedLM(nn.Module):
    """Emits ``script[b, t]`` as the t-th generated token of row b (one-hot logits).

    Records the input length of every forward call and the cache object it got.
    """

    def __init__(self, script: torch.Tensor, vocab: int = 16) -> None:
        super().__init__()
        self.script = script
        self.vocab = vocab
        self.step = 0
        self.input_lengths: list[int] = []
        self.caches_in: list[object] = []
        self.dropout = nn.Dropout(0.5)  # a submodule, for the train/eval flag checks
        self.raise_on_call = False

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kwargs):
        if self.raise_on_call:
            raise RuntimeError("boom")
        batch, length = input_ids.shape
        self.input_lengths.append(length)
        self.caches_in.append(cache)
        if cache is None:
            cache = _CountingCache()
            self.step = 0
        cache.seen += length
        assert attention_mask.shape == (batch, cache.seen)
        assert position_ids.shape == (batch, length)
        logits = torch.full((batch, length, self.vocab), -1e9)
        logits[:, -1, :].scatter_(1, self.script[:, self.step : self.step + 1], 0.0)
        self.step += 1
        return SimpleNamespace(logits=logits, cache=cache)


def _scripted(rows: list[list[int]]) -> ScriptedLM:
    return ScriptedLM(torch.tensor(rows, dtype=torch.long))


# Left-padded prompts: row 0 has 2 real tokens, row 1 has 3.
PROMPT_IDS = torch.tensor([[PAD, 5, 6], [4, 5, 6]])
PROMPT_MASK = torch.tensor([[0, 1, 1], [1, 1, 1]])


def _tiny_qwen2(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def qwen2():
    return _tiny_qwen2()


def _left_padded_prompts():
    """Three prompts of lengths 5, 2 and 4, left-padded to 5."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, VOCAB, (3, 5), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1], [0, 1, 1, 1, 1]])
    return ids.masked_fill(mask == 0, PAD), mask


# --------------------------------------------------------------------------- positions


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    assert torch.equal(position_ids_from_mask(mask), expected)
    assert position_ids_from_mask(mask.bool()).dtype == torch.long


# --------------------------------------------------------------------------- completion_lengths


def test_completion_lengths_count_up_to_the_first_eos_with_pad_equal_to_eos():
    eos = pad = 2
    completion = torch.tensor([[3, eos, pad, pad], [3, 4, 5, eos], [eos, pad, pad, pad], [3, 4, 5, 6]])
    lengths, stopped = completion_lengths(completion, eos)
    assert lengths.tolist() == [2, 4, 1, 4]  # EOS included; a row without EOS runs to N
    assert stopped.tolist() == [True, True, True, False]
    # several EOS ids: the first of either ends the row
    lengths, stopped = completion_lengths(torch.tensor([[3, 9, 7, 4], [7, 3, 9, 4], [3, 4, 5, 6]]), [7, 9])
    assert lengths.tolist() == [2, 1, 4] and stopped.tolist() == [True, True, False]
    # no EOS id: every token counts, nothing stopped
    lengths, stopped = completion_lengths(completion, None)
    assert lengths.tolist() == [4, 4, 4, 4] and stopped.tolist() == [False] * 4
    assert lengths.dtype == torch.long and stopped.dtype == torch.bool


# --------------------------------------------------------------------------- completion_batch


def test_completion_batch_pad_equals_eos_keeps_eos_label():
    eos = pad = 2
    completion = torch.tensor([[3, eos, pad, pad], [3, 4, 5, eos]])
    batch = completion_batch(PROMPT_IDS, PROMPT_MASK, completion, eos)
    assert torch.equal(batch["input_ids"], torch.cat([PROMPT_IDS, completion], 1))
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [
        [-100, -100, -100, 3, eos, -100, -100],
        [-100, -100, -100, 3, 4, 5, eos],
    ]


def test_completion_batch_eos_none_keeps_everything():
    completion = torch.tensor([[3, 2, 2], [2, 2, 2]])
    batch = completion_batch(PROMPT_IDS, PROMPT_MASK, completion, None)
    assert batch["attention_mask"][:, 3:].tolist() == [[1, 1, 1], [1, 1, 1]]
    assert torch.equal(batch["labels"][:, 3:], completion)
    # An empty EOS list behaves like None.
    assert torch.equal(completion_batch(PROMPT_IDS, PROMPT_MASK, completion, [])["labels"], batch["labels"])


def test_completion_batch_eos_list_first_hit_wins():
    completion = torch.tensor([[3, 9, 7, 4], [7, 3, 9, 4], [3, 4, 5, 6]])
    prompt_ids = torch.tensor([[1, 2], [0, 2], [1, 2]])
    prompt_mask = torch.tensor([[1, 1], [0, 1], [1, 1]])
    batch = completion_batch(prompt_ids, prompt_mask, completion, [7, 9])
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 1, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1],
    ]
    assert batch["labels"].tolist() == [
        [-100, -100, 3, 9, -100, -100],
        [-100, -100, 7, -100, -100, -100],
        [-100, -100, 3, 4, 5, 6],
    ]
    # Same answer with a tuple and with a tensor of ids.
    assert torch.equal(completion_batch(prompt_ids, prompt_mask, completion, (7, 9))["labels"], batch["labels"])
    assert torch.equal(
        completion_batch(prompt_ids, prompt_mask, completion, torch.tensor([7, 9]))["labels"], batch["labels"]
    )


def test_completion_batch_prompt_columns():
    completion = torch.tensor([[3, 4], [5, 6]])
    batch = completion_batch(PROMPT_IDS, PROMPT_MASK, completion, 2)
    assert torch.equal(batch["attention_mask"][:, :3], PROMPT_MASK)
    assert (batch["labels"][:, :3] == -100).all()
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == batch["labels"].dtype == torch.long


# --------------------------------------------------------------------------- scripted decode loop


def test_generate_pad_equals_eos_scripted():
    eos = pad = 2
    model = _scripted([[3, eos, 5, 6], [3, 4, 5, 6]])
    batch = generate_completions(
        model, PROMPT_IDS, PROMPT_MASK, max_new_tokens=4, pad_token_id=pad, eos_token_id=eos, do_sample=False
    )
    # Row 0 stops at EOS and pads afterwards (the script's 5, 6 are replaced by pad).
    assert batch["input_ids"][:, 3:].tolist() == [[3, eos, pad, pad], [3, 4, 5, 6]]
    assert batch["labels"][:, 3:].tolist() == [[3, eos, -100, -100], [3, 4, 5, 6]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]]


def test_generate_eos_none_keeps_whole_completion():
    model = _scripted([[2, 2, 3], [4, 2, 5]])
    batch = generate_completions(
        model, PROMPT_IDS, PROMPT_MASK, max_new_tokens=3, pad_token_id=2, eos_token_id=None, do_sample=False
    )
    assert batch["labels"][:, 3:].tolist() == [[2, 2, 3], [4, 2, 5]]
    assert (batch["attention_mask"][:, 3:] == 1).all()


def test_generate_eos_list_scripted():
    model = _scripted([[3, 4, 9, 7, 4], [7, 3, 9, 4, 4]])
    batch = generate_completions(
        model, PROMPT_IDS, PROMPT_MASK, max_new_tokens=5, pad_token_id=0, eos_token_id=[7, 9], do_sample=True
    )
    # Row 0 ends on 9 at step 3, row 1 on 7 at step 1 -> early stop at N = 3.
    assert batch["input_ids"][:, 3:].tolist() == [[3, 4, 9], [7, 0, 0]]
    assert batch["labels"][:, 3:].tolist() == [[3, 4, 9], [7, -100, -100]]
    assert batch["attention_mask"][:, :3].tolist() == PROMPT_MASK.tolist()
    assert (batch["labels"][:, :3] == -100).all()


def test_early_stop_and_kv_cache_scripted():
    eos = 2
    script = torch.full((2, 10), 5)
    script[0, 1] = eos  # row 0 finishes at step 2
    script[1, 2] = eos  # row 1 finishes at step 3
    model = ScriptedLM(script)
    completion = sample_tokens(
        model, PROMPT_IDS, PROMPT_MASK, max_new_tokens=10, pad_token_id=0, eos_token_id=eos, do_sample=False
    )
    assert completion.tolist() == [[5, eos, 0], [5, 5, eos]]
    # Prefill over the prompt, then exactly one token per decode step; no forward after the last token.
    assert model.input_lengths == [3, 1, 1]
    # The cache returned by one call is fed to the next.
    assert model.caches_in[0] is None
    assert model.caches_in[1] is model.caches_in[2]
    assert model.caches_in[1].seen == 5


def test_no_eos_runs_to_max_new_tokens_scripted():
    model = ScriptedLM(torch.full((2, 6), 5))
    completion = sample_tokens(
        model, PROMPT_IDS, PROMPT_MASK, max_new_tokens=6, pad_token_id=0, eos_token_id=2, do_sample=False
    )
    assert completion.shape == (2, 6)
    assert model.input_lengths == [3, 1, 1, 1, 1, 1]


class LegacyScriptedLM(ScriptedLM):
    """Pre-5.x convention: ``past_key_values=`` in, ``.past_key_values`` out, no ``cache``."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
        out = super().forward(input_ids, attention_mask, position_ids, cache=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=out.logits, past_key_values=out.cache)


def test_legacy_past_key_values_keyword():
    model = LegacyScriptedLM(torch.tensor([[3, 4, 2, 5], [3, 2, 5, 5]]))
    completion = sample_tokens(
        model, PROMPT_IDS, PROMPT_MASK, max_new_tokens=4, pad_token_id=0, eos_token_id=2, do_sample=False
    )
    assert completion.tolist() == [[3, 4, 2], [3, 2, 0]]
    assert model.input_lengths == [3, 1, 1]
    assert model.caches_in[1] is model.caches_in[2] is not None


def test_train_flags_restored_on_exception():
    model = _scripted([[1, 2]])
    model.train()
    model.dropout.eval()  # mixed flags must come back exactly
    model.raise_on_call = True
    with pytest.raises(RuntimeError, match="boom"):
        generate_completions(model, PROMPT_IDS[:1], PROMPT_MASK[:1], max_new_tokens=2, pad_token_id=0, eos_token_id=2)
    assert model.training is True
    assert model.dropout.training is False


def test_sampling_happens_in_eval_mode():
    seen_training: list[bool] = []
    model = _scripted([[3, 4]]).train()
    model.register_forward_pre_hook(lambda module, args: seen_training.append(module.training))
    generate_completions(model, PROMPT_IDS[:1], PROMPT_MASK[:1], max_new_tokens=2, pad_token_id=0, eos_token_id=2)
    assert seen_training == [False, False]
    assert model.training is True


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_invalid_args_raise(kwargs, name):
    model = _scripted([[3, 4]])
    args = {"max_new_tokens": 2, "pad_token_id": 0, "eos_token_id": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        generate_completions(model, PROMPT_IDS[:1], PROMPT_MASK[:1], **args)
    with pytest.raises(ValueError, match=name):
        sample_tokens(model, PROMPT_IDS[:1], PROMPT_MASK[:1], **args)
    assert model.input_lengths == []  # validation happens before any forward


# --------------------------------------------------------------------------- token selection


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().expand(4000, 4)
    gen = torch.Generator().manual_seed(0)
    picked = _pick_tokens(logits, do_sample=True, temperature=1.0, top_k=0, top_p=0.7, generator=gen)[0]
    assert set(picked.tolist()) == {0, 1}
    # top_p = 0.5 -> only the top token (its mass alone reaches the threshold).
    picked = _pick_tokens(logits, do_sample=True, temperature=1.0, top_k=0, top_p=0.5, generator=gen)[0]
    assert set(picked.tolist()) == {0}
    # top_k = 3 drops the last token; no filtering reaches all four.
    picked = _pick_tokens(logits, do_sample=True, temperature=1.0, top_k=3, top_p=1.0, generator=gen)[0]
    assert set(picked.tolist()) == {0, 1, 2}
    picked = _pick_tokens(logits, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, generator=gen)[0]
    assert set(picked.tolist()) == {0, 1, 2, 3}


def test_low_temperature_is_greedy():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
    picked = _pick_tokens(logits, do_sample=True, temperature=1e-4, top_k=0, top_p=1.0, generator=None)[0]
    assert torch.equal(picked, logits.argmax(-1))


# --------------------------------------------------------------------------- tiny Qwen2


def test_greedy_matches_hf_generate(qwen2):
    ids, mask = _left_padded_prompts()
    ours = sample_tokens(qwen2, ids, mask, max_new_tokens=8, pad_token_id=PAD, eos_token_id=None, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = qwen2.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=PAD, eos_token_id=None
        )
    assert ours.shape == (3, 8)
    assert torch.equal(ours, theirs[:, ids.shape[1] :])


def test_greedy_left_padding_invariance(qwen2):
    ids, mask = _left_padded_prompts()
    batched = sample_tokens(qwen2, ids, mask, max_new_tokens=8, pad_token_id=PAD, eos_token_id=None, do_sample=False)
    for row in range(ids.shape[0]):
        real = ids[row, mask[row].bool()][None]
        alone = sample_tokens(
            qwen2, real, torch.ones_like(real), max_new_tokens=8, pad_token_id=PAD, eos_token_id=None, do_sample=False
        )
        assert torch.equal(alone[0], batched[row]), row


def test_no_cache_deprecation_warning(qwen2, caplog):
    ids, mask = _left_padded_prompts()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        sample_tokens(qwen2, ids, mask, max_new_tokens=3, pad_token_id=PAD, eos_token_id=None, do_sample=False)
    assert "deprecated" not in caplog.text


def test_top_k_one_equals_greedy(qwen2):
    ids, mask = _left_padded_prompts()
    greedy = generate_completions(
        qwen2, ids, mask, max_new_tokens=8, pad_token_id=PAD, eos_token_id=None, do_sample=False
    )
    top1 = generate_completions(
        qwen2, ids, mask, max_new_tokens=8, pad_token_id=PAD, eos_token_id=None, top_k=1, temperature=0.7, seed=0
    )
    assert torch.equal(greedy["input_ids"], top1["input_ids"])


def test_seeded_sampling_reproducible_and_isolated(qwen2):
    ids, mask = _left_padded_prompts()
    kwargs = dict(max_new_tokens=16, pad_token_id=PAD, eos_token_id=None, temperature=1.5)
    rng_before = torch.get_rng_state()
    a = generate_completions(qwen2, ids, mask, seed=3, **kwargs)
    assert torch.equal(torch.get_rng_state(), rng_before)
    b = generate_completions(qwen2, ids, mask, seed=3, **kwargs)
    c = generate_completions(qwen2, ids, mask, seed=4, **kwargs)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    assert torch.equal(torch.get_rng_state(), rng_before)
    # Unseeded sampling draws from the global RNG.
    torch.manual_seed(123)
    d = generate_completions(qwen2, ids, mask, **kwargs)
    torch.manual_seed(123)
    e = generate_completions(qwen2, ids, mask, **kwargs)
    assert torch.equal(d["input_ids"], e["input_ids"])


def test_gradient_checkpointing_train_mode_still_uses_cache_and_backward_works():
    model = _tiny_qwen2(seed=1)
    # transformers 5.24 renamed gradient_checkpointing_enable (deprecated alias kept).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    model.train()
    lengths: list[int] = []
    logits_to_keep: list[object] = []

    def hook(module, args, kwargs):
        lengths.append(kwargs["input_ids"].shape[1])
        logits_to_keep.append(kwargs.get("logits_to_keep"))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    ids, mask = _left_padded_prompts()
    try:
        batch = generate_completions(model, ids, mask, max_new_tokens=6, pad_token_id=PAD, eos_token_id=None, seed=0)
    finally:
        handle.remove()
    assert lengths == [ids.shape[1]] + [1] * 5
    assert logits_to_keep == [1] + [None] * 5  # only the prefill trims its logits
    assert model.training is True
    assert all(m.training for m in model.modules())

    # The returned tensors feed a training forward + backward (with checkpointing on).
    assert not any(t.is_inference() for t in batch.values())
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    assert model.lm_head.weight.grad is not None


# --------------------------------------------------------------------------- resolve_eos_token_id


def test_resolve_eos_token_id():
    tokenizer = SimpleNamespace(eos_token_id=5)
    with_config = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 9]))
    unset_config = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    no_config = SimpleNamespace()
    assert resolve_eos_token_id(with_config, tokenizer) == [7, 9]
    assert resolve_eos_token_id(unset_config, tokenizer) == 5
    assert resolve_eos_token_id(no_config, tokenizer) == 5
    assert resolve_eos_token_id(no_config) is None
    assert resolve_eos_token_id(unset_config) is None


def test_resolve_eos_token_id_hf_model(qwen2):
    assert qwen2.generation_config.eos_token_id is None
    assert resolve_eos_token_id(qwen2, SimpleNamespace(eos_token_id=3)) == 3
