"""Greedy multi-turn rollouts over rows, for evaluation and generation with tools: the transcripts a model writes
when it acts on each row's prompt, and each one's final answer (its last assistant message)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.ops.decoding.sampling import complete_prompts
from lightning_gkd.rollouts.environment import Message
from lightning_gkd.rollouts.rollout import MultiTurnRollout, RolloutStats, SampleTurn, rollout_transcripts


def greedy_turn(model: nn.Module, tokenizer: Any, max_new_tokens: int, sampler: Any = None) -> SampleTurn:
    """A ``SampleTurn`` that decodes greedily (one turn: up to EOS or ``max_new_tokens``): through ``sampler.greedy``
    (a ``lightning_gkd.samplers.Sampler``: a serving engine's) when given one that decodes, else with our KV-cache
    decoder."""

    def sample(ids: torch.Tensor, mask: torch.Tensor, seed: int) -> Mapping[str, torch.Tensor]:
        served = None if sampler is None else sampler.greedy(model, ids, mask, max_new_tokens=max_new_tokens)
        if served is not None:
            return served
        return complete_prompts(model, tokenizer, ids, mask, max_new_tokens=max_new_tokens)

    return sample


def final_answers(transcripts: Sequence[Sequence[Message]]) -> list[str]:
    """Each transcript's last assistant message ("" when it has none)."""
    return [next((m["content"] for m in reversed(t) if m["role"] == "assistant"), "") for t in transcripts]


@torch.no_grad()
def rollout_rows(
    model: nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    rollout: MultiTurnRollout,
    *,
    max_new_tokens: int,
    batch_size: int = 64,
    sample: SampleTurn | None = None,
    sampler: Any = None,
) -> tuple[list[list[Message]], RolloutStats]:
    """The transcripts ``model`` writes for ``rows`` (chat rows; their prompt is what precedes the first assistant
    turn) with ``rollout``'s environment, ``sample``'s turns if given, else greedy ones (``greedy_turn``, through
    ``sampler.greedy`` where it decodes), and the stats over all of them."""
    collator = ChatMLCollator(
        tokenizer,
        max_length=10**9,
        columns=rollout.state_columns,
        carry_prompt_messages=True,
        tools=rollout.tools,
        first_turn_prompts=True,
    )
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    turn = sample or greedy_turn(model, tokenizer, max_new_tokens, sampler)
    transcripts: list[list[Message]] = []
    total = RolloutStats()
    try:
        for start in range(0, len(rows), batch_size):
            batch = collator(list(rows[start : start + batch_size]))
            batch["prompts"] = batch["prompts"].to(device)
            batch["prompt_attention_mask"] = batch["prompt_attention_mask"].to(device)
            out, stats = rollout.run(turn, batch, seed=start)
            transcripts += rollout_transcripts(out)
            total.add(stats)
    finally:
        model.train(was_training)
    return transcripts, total


def evaluate_rollouts(
    model: nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    rollout: MultiTurnRollout,
    *,
    metrics: Mapping[str, Any],
    batch_size: int = 64,
    max_new_tokens: int = 32,
    sampler: Any = None,
) -> dict[str, float]:
    """``evaluate_generations`` for an agent: greedy rollouts of ``rows``' prompts with ``rollout``'s environment
    (through ``sampler.greedy`` where it has one), each transcript's final answer scored against the row's last
    assistant message by ``metrics``; also ``tool_calls`` and ``tool_failures`` per transcript."""
    transcripts, stats = rollout_rows(
        model,
        tokenizer,
        rows,
        rollout,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        sampler=sampler,
    )
    references = [str(row["messages"][-1]["content"]) for row in rows]
    predictions = final_answers(transcripts)
    scores = {name: float(metric(predictions, references)) for name, metric in metrics.items()}
    summary = stats.metrics()
    return {**scores, "tool_calls": summary["calls"], "tool_failures": summary["failures"]}
