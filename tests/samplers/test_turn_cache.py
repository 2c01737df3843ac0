"""KVCacheSampler(reuse_turn_cache=True): each row's KV cache carried across the turns of a multi-turn rollout.

Greedy and sampled (temperature 1, one seed) transcripts through a real MultiTurnRollout equal those of a sampler that
re-prefills every turn, token for token, across families (fp32); the second turn's prefill feeds only each row's
suffix after what the model consumed; the kept cache is dropped when the weights change (announced or not), for
another model, at end_rollout; and the decoders and models that cannot reuse prefill in full.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.chat_tokens import left_pad
from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_tokenizer, load_tokenizer
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.rollouts import MultiTurnRollout, build_environment
from lightning_gkd.samplers import KVCacheSampler, Sampler
from lightning_gkd.toy.tiny import asset_path, tiny_causal_lm
from lightning_gkd.toy.tools import task_rollout, tool_rows

KEYS = ("input_ids", "attention_mask", "labels")
BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,  # the EOS output row is moved alone (stopping_model)
}
#: Families with different attention and position code: biases (Qwen2), none (Llama), a sliding window wider than
#: the transcripts (Mistral, Gemma 2: sliding cache layers), a soft-capped head (Gemma 2), fused qkv (Phi-3,
#: GPT-NeoX), partial rotary (GPT-NeoX).
FAMILIES = {
    "qwen2": {"model_type": "qwen2", **BASE},
    "llama": {"model_type": "llama", **BASE},
    "mistral": {"model_type": "mistral", **BASE, "sliding_window": 256},
    "gemma2": {
        "model_type": "gemma2",
        **BASE,
        "head_dim": 16,
        "sliding_window": 256,
        "final_logit_softcapping": 30.0,
    },
    "phi3": {"model_type": "phi3", **BASE},
    "gpt_neox": {
        "model_type": "gpt_neox",
        **{k: v for k, v in BASE.items() if k != "num_key_value_heads"},
    },
}


@pytest.fixture(scope="module")
def tool_tokenizer():
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = TOOLS_CHATML_TEMPLATE
    return tokenizer


def stop_tokens(tokenizer, share: float = 0.3, seed: int = 0) -> list[int]:
    """EOS and a random ``share`` of the vocabulary: stop tokens that end a random model's turns after a few tokens,
    greedy or sampled (a random model's greedy turns loop on one token, which EOS alone rarely interrupts)."""
    generator = torch.Generator().manual_seed(seed)
    others = torch.randperm(len(tokenizer) - 3, generator=generator)[: int(share * len(tokenizer))] + 3
    return [tokenizer.eos_token_id, *sorted(set(others.tolist()) - {tokenizer.eos_token_id})]


@torch.no_grad()
def stopping_model(family: str, tokenizer, *, seed: int = 0) -> torch.nn.Module:
    """A random tiny ``family`` model with peaked logits (weights larger than the init) whose generation config
    stops at ``stop_tokens``: multi-turn transcripts of uneven turns."""
    model = tiny_causal_lm(FAMILIES[family], tokenizer, seed=seed).eval()
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        if parameter.ndim == 2:
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.generation_config.eos_token_id = stop_tokens(tokenizer)
    return model


def stop_after(row) -> int:
    """How many assistant turns the forcing user asks of a row: 1 to 4, from the row's facts."""
    return 1 + sum(json.loads(row["facts"]).values()) % 4


def forcing_user(messages, row):
    """Asks for another turn until the row has had ``stop_after(row)`` turns, whatever the student wrote."""
    turns = sum(message["role"] == "assistant" for message in messages)
    return None if turns >= stop_after(row) else [{"role": "user", "content": "go on" + " again" * (turns % 3)}]


def uneven_rows(count: int) -> list[dict[str, Any]]:
    """Toy tool rows whose prompts have uneven lengths (a longer question on some rows)."""
    rows = tool_rows("test", count)
    for i, row in enumerate(rows):
        question = row["messages"][0]["content"]
        row["messages"] = [{"role": "user", "content": question + " please" * (i % 4)}]
    return rows


def forcing_rollout(tokenizer) -> MultiTurnRollout:
    """The forcing user's rollout, whose turns end at ``stop_tokens``."""
    built, schemas = build_environment(None, forcing_user, tokenizer, timeout=5.0)
    assert built is not None
    return MultiTurnRollout(
        tokenizer, built, eos_token_ids=stop_tokens(tokenizer), max_iterations=4, tools=schemas, state_columns=["facts"]
    )


def run_rollout(
    tokenizer, rows, rollout: MultiTurnRollout, sampler: Sampler, model: torch.nn.Module, seed: int = 0
) -> tuple[dict[str, Any], Any, list[dict[str, Any]]]:
    """``rollout.run`` on ``rows`` collated in one batch, every turn sampled by ``sampler`` with ``model``: the
    rollout batch, its stats, and each call's context, output and ``last_stats``."""
    collator = ChatMLCollator(
        tokenizer,
        max_length=10**9,
        columns=rollout.state_columns,
        carry_prompt_messages=True,
        tools=rollout.tools,
        first_turn_prompts=True,
    )
    calls: list[dict[str, Any]] = []

    def turn(ids: torch.Tensor, mask: torch.Tensor, turn_seed: int):
        out = sampler.sample(model, ids, mask, seed=turn_seed)
        calls.append({"ids": ids.clone(), "mask": mask.clone(), "out": out, "stats": sampler.last_stats()})
        return out

    out, stats = rollout.run(turn, collator(list(rows)), seed=seed)
    sampler.end_rollout()
    return out, stats, calls


def assert_same_rollouts(a, b) -> None:
    """Two rollouts' every turn (context, tokens, labels, log-probs), transcripts and stats are the same."""
    (out_a, stats_a, calls_a), (out_b, stats_b, calls_b) = a, b
    assert len(calls_a) == len(calls_b)
    for turn, (x, y) in enumerate(zip(calls_a, calls_b, strict=True)):
        assert torch.equal(x["ids"], y["ids"]), turn
        for key in KEYS:
            assert torch.equal(x["out"][key], y["out"][key]), (turn, key)
        torch.testing.assert_close(x["out"]["sampled_logprobs"], y["out"]["sampled_logprobs"], atol=1e-4, rtol=0)
    assert out_a["transcripts"] == out_b["transcripts"]
    for key in KEYS:
        assert torch.equal(out_a[key], out_b[key]), key
    assert stats_a == stats_b


def assert_prefills_only_the_suffix(calls: list[dict[str, Any]]) -> None:
    """From the second call on, each row reuses exactly its previous context and the sampled tokens the previous
    decode fed (up to and including its EOS; the last token sampled by the decode was never fed), and prefills the
    rest: ``reused_tokens`` and ``prefill_tokens`` as counted here from the calls' tensors."""
    assert calls[0]["stats"]["reused_tokens"] == 0
    for previous, call in zip(calls, calls[1:], strict=False):
        before = [row[m.bool()].tolist() for row, m in zip(previous["ids"], previous["mask"], strict=True)]
        width = previous["ids"].shape[1]
        decoded = previous["out"]["input_ids"].shape[1] - width  # the previous decode's steps; it fed all but one
        kept = {}
        for row, ids, labels in zip(before, previous["out"]["input_ids"], previous["out"]["labels"], strict=True):
            sampled = ids[width:][labels[width:] != IGNORE_INDEX].tolist()
            consumed = sampled[: decoded - 1]
            kept[tuple(row + consumed)] = len(row) + len(consumed)
        reused = 0
        now = [row[m.bool()].tolist() for row, m in zip(call["ids"], call["mask"], strict=True)]
        for row in now:
            reused += max((n for k, n in kept.items() if tuple(row[: len(k)]) == k), default=0)
        total = int(call["mask"].sum())
        assert call["stats"] == {"prefill_tokens": total - reused, "reused_tokens": reused}
        assert reused > 0


# -- exactness through real rollouts ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("who", "greedy"), [("teacher", True), ("student_init", False), ("student_init", True)])
def test_tool_rollouts_of_the_toy_task_with_reuse_equal_those_that_re_prefill(who, greedy):
    """The shipped toy agentic task (``task_rollout``: lookup/add run on each row's facts, its caps): greedily
    (top_k=1) its trained teacher makes three calls and answers (4 turns a row); sampled at temperature 1 its
    student start stops at different turns. Rollouts of 12 rows are the same with and without reuse, and every
    turn after the first prefills only the suffix."""
    path = asset_path(f"toy_tools/{who}")
    tokenizer, model = load_tokenizer(path), load_causal_lm(path).eval()
    rollout, rows = task_rollout(tokenizer), tool_rows("test", 12)
    options: dict[str, Any] = {"max_new_tokens": 24, "top_k": 1 if greedy else 0, "matmul_precision": "highest"}
    full = run_rollout(tokenizer, rows, rollout, KVCacheSampler(tokenizer, reuse_turn_cache=False, **options), model)
    reused = run_rollout(tokenizer, rows, rollout, KVCacheSampler(tokenizer, **options), model)
    assert_same_rollouts(full, reused)
    assert_prefills_only_the_suffix(reused[2])
    assert all(call["stats"]["reused_tokens"] == 0 for call in full[2])
    turns = reused[1].turns
    if who == "teacher":
        assert turns == [4] * len(rows) and sum(reused[1].calls) == 3 * len(rows)
    elif not greedy:
        assert len(set(turns)) >= 2, turns  # rows finishing at different turns


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_rollouts_with_reuse_equal_those_that_re_prefill_across_families(family, greedy, tool_tokenizer):
    """Random tiny models of six families whose turns stop after a few tokens, a forcing user asking each row for 1 to 4
    turns (replies of uneven length), prompts of uneven length: greedy (top_k=1) and sampled (temperature 1, one
    seed) rollouts are the same with and without reuse, token for token, and reuse prefills only the suffixes."""
    model = stopping_model(family, tool_tokenizer)
    rows, rollout = uneven_rows(8), forcing_rollout(tool_tokenizer)
    options: dict[str, Any] = {"max_new_tokens": 10, "top_k": 1 if greedy else 0, "matmul_precision": "highest"}
    full = run_rollout(
        tool_tokenizer, rows, rollout, KVCacheSampler(tool_tokenizer, reuse_turn_cache=False, **options), model, 3
    )
    reused = run_rollout(tool_tokenizer, rows, rollout, KVCacheSampler(tool_tokenizer, **options), model, 3)
    assert_same_rollouts(full, reused)
    assert_prefills_only_the_suffix(reused[2])
    turns = reused[1].turns
    assert max(turns) >= 3 and len(set(turns)) >= 2, turns  # several turns, rows finishing at different turns


# -- what is never reused ---------------------------------------------------------------------------------------------
def contexts(tokenizer, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad(rows, tokenizer.pad_token_id), left_pad([[1] * len(r) for r in rows], 0)


def two_turns(
    sampler: KVCacheSampler, model: torch.nn.Module, tokenizer, between: Callable[[], None] = lambda: None
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """A first call on three uneven rows, ``between()``, and a second call on each row's transcript plus a reply:
    the second call's stats and output."""
    first = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    out = sampler.sample(model, *contexts(tokenizer, first), seed=0)
    width = len(first[2])
    following = []
    for row, ids, labels in zip(first, out["input_ids"], out["labels"], strict=True):
        following.append(row + ids[width:][labels[width:] != IGNORE_INDEX].tolist() + [20, 21, 22])
    between()
    second = sampler.sample(model, *contexts(tokenizer, following), seed=1)
    return sampler.last_stats(), second


def test_weights_changed_in_place_or_announced_drop_the_kept_cache(tokenizer):
    """An in-place update the sampler is not told of (an optimizer step's ``add_``), ``weights_updated`` and
    ``end_rollout`` each drop the kept cache: the next call prefills in full, and samples what a sampler that never
    reuses samples from the changed model."""
    model = stopping_model("qwen2", tokenizer)
    twin = copy.deepcopy(model)
    options: dict[str, Any] = {"max_new_tokens": 6, "top_k": 1, "matmul_precision": "highest"}
    sampler = KVCacheSampler(tokenizer, **options)
    fresh = KVCacheSampler(tokenizer, reuse_turn_cache=False, **options)
    assert two_turns(sampler, model, tokenizer)[0]["reused_tokens"] > 0

    def nudge(module: torch.nn.Module) -> Callable[[], None]:
        def update() -> None:
            with torch.no_grad():
                for parameter in module.parameters():
                    parameter.mul_(1.2)

        return update

    stats, second = two_turns(sampler, model, tokenizer, nudge(model))
    assert stats["reused_tokens"] == 0
    _, want = two_turns(fresh, twin, tokenizer, nudge(twin))
    assert all(torch.equal(second[k], want[k]) for k in KEYS)
    assert two_turns(sampler, model, tokenizer, sampler.weights_updated)[0]["reused_tokens"] == 0
    assert two_turns(sampler, model, tokenizer, sampler.end_rollout)[0]["reused_tokens"] == 0
    assert sampler.kept_bytes() > 0
    sampler.end_rollout()
    assert sampler.kept_bytes() == 0


def test_another_model_never_reads_the_kept_cache(tokenizer):
    student, teacher = stopping_model("qwen2", tokenizer), stopping_model("qwen2", tokenizer)  # the same weights
    sampler = KVCacheSampler(tokenizer, max_new_tokens=6, top_k=1, matmul_precision="highest")
    sampler.sample(student, *contexts(tokenizer, [[5, 6, 7]]), seed=0)
    sampler.sample(teacher, *contexts(tokenizer, [[5, 6, 7, 8, 9]]), seed=0)
    assert sampler.last_stats()["reused_tokens"] == 0


def test_without_reuse_or_with_a_static_decoder_every_turn_prefills_in_full(tokenizer):
    model = stopping_model("qwen2", tokenizer)
    for sampler in (
        KVCacheSampler(tokenizer, max_new_tokens=6, top_k=1, reuse_turn_cache=False),
        KVCacheSampler(tokenizer, max_new_tokens=6, top_k=1, decode="static"),
    ):
        stats, _ = two_turns(sampler, model, tokenizer)
        assert stats["reused_tokens"] == 0 and sampler.kept_bytes() == 0


def test_a_sliding_window_the_decode_would_reach_prefills_in_full(tool_tokenizer):
    """Mistral with a 12-token window: the kept layers are sliding ones, and a decode as wide as the window
    prefills in full (a window counts columns, so a re-padded cache would change what it sees)."""
    config = {**FAMILIES["mistral"], "sliding_window": 12}
    model = tiny_causal_lm(config, tool_tokenizer, seed=0).eval()
    options: dict[str, Any] = {"max_new_tokens": 6, "top_k": 1, "matmul_precision": "highest"}
    stats, second = two_turns(KVCacheSampler(tool_tokenizer, **options), model, tool_tokenizer)
    _, want = two_turns(KVCacheSampler(tool_tokenizer, reuse_turn_cache=False, **options), model, tool_tokenizer)
    assert stats["reused_tokens"] == 0
    assert all(torch.equal(second[k], want[k]) for k in KEYS)


def test_reuse_turn_cache_is_checked_and_the_base_hook_does_nothing(tokenizer):
    with pytest.raises(ValueError, match="reuse_turn_cache must be true or false"):
        KVCacheSampler(tokenizer, reuse_turn_cache="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reuse_turn_cache"):
        KVCacheSampler.check_settings(reuse_turn_cache=1)  # type: ignore[arg-type]

    class Echo(Sampler):
        def sample(self, model, prompts, prompt_attention_mask, *, seed, vision=None):
            return {}

    Echo().end_rollout()  # nothing kept, nothing to release
