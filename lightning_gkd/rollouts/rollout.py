"""Multi-turn rollouts: the student writes a turn, the environment (tools, a simulated user) answers, the student
writes again, until it answers without a call, hits the iteration cap or the token cap. The finished transcript is
one training row: every token the student sampled is a label (kept as sampled, never re-tokenized from text); the
prompt and the environment's tokens are -100 (the tool mask).

A turn is sampled through any ``Sampler`` (the method's engine) for the rows still going, so rows can finish at
different turns. Each turn re-prefills the transcript so far: ``hf`` and ``vllm`` both (VLLMSampler keeps vLLM's prefix
cache off, whose blocks would outlive a weight sync)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_gkd.data.chat_tokens import left_pad
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.sampling import derive_seed
from lightning_gkd.rollouts.environment import Environment, EnvironmentReply, Message, as_reply
from lightning_gkd.rollouts.settings import RolloutSettings
from lightning_gkd.rollouts.tools import FAILURE_KINDS

#: ``sample(context_ids, context_attention_mask, seed)`` -> the sampler's batch (``Sampler.sample`` with its model).
SampleTurn = Callable[[torch.Tensor, torch.Tensor, int], Mapping[str, torch.Tensor]]


@dataclass
class RolloutStats:
    """What a batch of rollouts did: per-transcript assistant ``turns``, tool ``calls`` and ``lengths`` (tokens after
    the prompt), ``failures`` by kind, and how many transcripts were ``truncated`` at the token cap, stopped by the
    iteration ``capped`` with a call pending, or ``unfinished`` (a turn that hit ``max_new_tokens`` without EOS)."""

    turns: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    truncated: int = 0
    capped: int = 0
    unfinished: int = 0

    def metrics(self) -> dict[str, float]:
        """Per-transcript means (``turns``, ``calls``, ``failures``, ``transcript_length``), the failure rate over
        calls, each failure kind per transcript, and the shares of truncated and capped transcripts."""
        rows = max(len(self.turns), 1)
        calls, failures = sum(self.calls), sum(self.failures.values())
        out = {
            "calls": calls / rows,
            "failures": failures / rows,
            "failure_rate": failures / calls if calls else 0.0,
            "turns": sum(self.turns) / rows,
            "transcript_length": sum(self.lengths) / rows,
            "truncated": self.truncated / rows,
            "capped": self.capped / rows,
        }
        out.update({f"failures_{kind}": self.failures[kind] / rows for kind in FAILURE_KINDS})
        return out


def _render(tokenizer: Any, messages: Sequence[Message], tools: list[dict] | None, generation: bool) -> str:
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tools=tools, tokenize=False, add_generation_prompt=generation
    )
    return str(text)


def continuation_ids(
    tokenizer: Any, messages: Sequence[Message], reply: Sequence[Message], tools: list[dict] | None
) -> list[int]:
    """The tokens that follow the student's turn (``messages[-1]``, written up to its EOS) when ``reply`` answers it:
    whatever the template writes after the turn's EOS, the reply's messages and the next generation prompt.

    Found on the text: the render through the turn must prefix the render with the reply; ValueError otherwise (a
    template that rewrites earlier turns)."""
    before = _render(tokenizer, messages[:-1], tools, True)
    through = _render(tokenizer, messages, tools, False)
    after = _render(tokenizer, [*messages, *reply], tools, True)
    if not (through.startswith(before) and after.startswith(through)):
        raise ValueError(
            f"The chat template of {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} renders the "
            "conversation before a tool or user reply differently from the start of the conversation with it "
            f"(it rewrites earlier turns), so a rollout cannot continue from the tokens sampled so far. Around "
            f"{len(through)}: {through[-60:]!r}. Use a chat template whose every prefix renders as the start of the "
            "whole conversation (ChatML templates do)."
        )
    turn = through[len(before) :]
    eos_text = tokenizer.eos_token or ""
    end = turn.rfind(eos_text) if eos_text else -1
    tail = turn[end + len(eos_text) :] if end >= 0 else ""
    return list(tokenizer(tail + after[len(through) :], add_special_tokens=False)["input_ids"])


@dataclass
class _Transcript:
    prompt_length: int
    ids: list[int]
    messages: list[Message]
    row: Mapping[str, Any]
    student: list[bool] = field(default_factory=list)  # per token after the prompt: written by the student
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    calls: int = 0


class MultiTurnRollout:
    """Rolls a batch of prompts out over several turns with ``environment`` (see ``rollouts.environment``).

    ``max_iterations`` caps the environment replies (TRL's ``max_tool_calling_iterations``): after that many, the
    student's next turn is the last. ``max_transcript_tokens`` caps a transcript's length, prompt included: a turn
    or reply that would pass it is dropped and the transcript ends at the turn boundary before it (counted as
    ``truncated``). Both are checked by ``RolloutSettings`` (``build_rollout`` makes this from them). ``tools`` are the
    schemas the chat template renders; ``state_columns`` the batch columns each row's environment receives (its
    ``row``)."""

    def __init__(
        self,
        tokenizer: Any,
        environment: Environment,
        *,
        eos_token_ids: Sequence[int],
        max_iterations: int,
        max_transcript_tokens: int | None = None,
        tools: list[dict] | None = None,
        state_columns: Sequence[str] = (),
    ) -> None:
        self.tokenizer, self.environment = tokenizer, environment
        self.eos_token_ids = set(eos_token_ids)
        self.max_iterations, self.max_transcript_tokens = max_iterations, max_transcript_tokens
        self.tools, self.state_columns = tools, list(state_columns)

    def run(self, sample: SampleTurn, batch: Mapping[str, Any], seed: int) -> tuple[dict[str, Any], RolloutStats]:
        """Transcripts for ``batch``'s prompts (``prompts``, ``prompt_attention_mask``, ``prompt_messages``): the
        sampler's batch contract (``input_ids``, ``attention_mask``, ``labels``, ``sampled_logprobs``, each
        ``(B, P + N)``, the prompt columns as given) plus ``transcripts`` (each row's messages), and the stats."""
        if "prompt_messages" not in batch:
            raise ValueError(
                "A multi-turn rollout needs each row's prompt messages in the batch (ChatDataModule."
                "carry_prompt_messages(); the on-policy methods call it when tools or an environment are set)."
            )
        prompts, prompt_mask = batch["prompts"], batch["prompt_attention_mask"]
        transcripts = [
            _Transcript(
                prompt_length=int(prompt_mask[i].sum()),
                ids=prompts[i][prompt_mask[i].bool()].tolist(),
                messages=[dict(m) for m in batch["prompt_messages"][i]],
                row={column: batch[column][i] for column in self.state_columns},
            )
            for i in range(prompts.shape[0])
        ]
        stats = RolloutStats()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        active = list(range(len(transcripts)))
        for turn in range(self.max_iterations + 1):
            if not active:
                break
            contexts = [transcripts[i].ids for i in active]
            context_ids = left_pad(contexts, pad).to(prompts.device)
            context_mask = left_pad([[1] * len(ids) for ids in contexts], 0).to(prompts.device)
            out = sample(context_ids, context_mask, derive_seed(seed, turn))
            width = context_ids.shape[1]
            still_active = []
            for j, i in enumerate(active):
                if self._take_turn(transcripts[i], out, j, width, last=turn == self.max_iterations, stats=stats):
                    still_active.append(i)
            active = still_active
        return self._batch(batch, transcripts, prompts, pad), self._finish(stats, transcripts)

    def _take_turn(
        self, t: _Transcript, out: Mapping[str, torch.Tensor], j: int, width: int, *, last: bool, stats: RolloutStats
    ) -> bool:
        """Append row ``j`` of ``out`` as ``t``'s next turn and the environment's reply; True if ``t`` goes on."""
        supervised = out["labels"][j, width:] != IGNORE_INDEX
        tokens = out["input_ids"][j, width:][supervised].tolist()
        logprobs = out["sampled_logprobs"][j, width:][supervised].tolist() if "sampled_logprobs" in out else []
        if self.max_transcript_tokens is not None and len(t.ids) + len(tokens) > self.max_transcript_tokens:
            stats.truncated += 1
            return False
        t.ids += tokens
        t.student += [True] * len(tokens)
        t.logprobs += logprobs or [0.0] * len(tokens)
        t.turns += 1
        content = self.tokenizer.decode(tokens, skip_special_tokens=True)
        t.messages.append({"role": "assistant", "content": content})
        if not tokens or tokens[-1] not in self.eos_token_ids:
            stats.unfinished += 1
            return False
        if last:
            parser = getattr(self.environment, "parser", None)
            stats.capped += bool(parser is not None and parser.parse(content))
            return False
        reply = as_reply(self.environment(t.messages, t.row), "the environment")
        if reply is None:
            return False
        t.calls += reply.calls
        stats.failures.update(reply.failures)
        following = continuation_ids(self.tokenizer, t.messages, reply.messages, self.tools)
        if self.max_transcript_tokens is not None and len(t.ids) + len(following) >= self.max_transcript_tokens:
            stats.truncated += 1
            return False
        t.ids += following
        t.student += [False] * len(following)
        t.logprobs += [0.0] * len(following)
        t.messages += reply.messages
        return True

    @staticmethod
    def _finish(stats: RolloutStats, transcripts: Sequence[_Transcript]) -> RolloutStats:
        for t in transcripts:
            stats.turns.append(t.turns)
            stats.calls.append(t.calls)
            stats.lengths.append(len(t.ids) - t.prompt_length)
        return stats

    @staticmethod
    def _batch(
        batch: Mapping[str, Any], transcripts: Sequence[_Transcript], prompts: torch.Tensor, pad: int
    ) -> dict[str, Any]:
        completion = max((len(t.ids) - t.prompt_length for t in transcripts), default=0)
        rows, width = prompts.shape[0], prompts.shape[1] + completion
        input_ids = torch.full((rows, width), pad, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
        logprobs = torch.zeros((rows, width), dtype=torch.float32)
        input_ids[:, : prompts.shape[1]] = prompts.cpu()
        attention[:, : prompts.shape[1]] = batch["prompt_attention_mask"].cpu()
        start = prompts.shape[1]
        for i, t in enumerate(transcripts):
            tail = t.ids[t.prompt_length :]
            end = start + len(tail)
            input_ids[i, start:end] = torch.tensor(tail, dtype=torch.long)
            attention[i, start:end] = 1
            student = torch.tensor(t.student, dtype=torch.bool)
            labels[i, start:end] = torch.where(student, input_ids[i, start:end], IGNORE_INDEX)
            logprobs[i, start:end] = torch.tensor(t.logprobs, dtype=torch.float32) * student
        device = prompts.device
        return {
            **batch,
            "input_ids": input_ids.to(device),
            "attention_mask": attention.to(device),
            "labels": labels.to(device),
            "sampled_logprobs": logprobs.to(device),
            "transcripts": [t.messages for t in transcripts],
        }


def build_environment(
    tools: Sequence[Any] | None,
    environment: Environment | str | None,
    tokenizer: Any,
    *,
    timeout: float,
    parser: Any = None,
) -> tuple[Environment | None, list[dict] | None]:
    """The rollout's environment and the tool schemas the template renders, from a method's ``tools`` (callables
    or import paths: a ``ToolEnvironment``) or ``environment`` (a callable or its import path); (None, None) with
    neither. ValueError with both."""
    from lightning_gkd.rollouts.environment import ToolEnvironment
    from lightning_gkd.rollouts.parsers import default_parser
    from lightning_gkd.rollouts.tools import build_tools, import_callable

    if tools and environment is not None:
        raise ValueError(
            "Give tools (the student calls them; Hydra: method.rollout.tools=[...]) or an environment "
            "(method.rollout.environment), "
            "not both: an environment that also runs tools builds a ToolEnvironment itself."
        )
    if tools:
        built = build_tools(tools)
        return ToolEnvironment(built, parser or default_parser(tokenizer), timeout=timeout), [t.schema for t in built]
    if environment is None:
        return None, None
    if isinstance(environment, str):
        environment = import_callable(environment, "environment")
    if not callable(environment):
        raise ValueError(f"environment {environment!r} is not callable; give environment(messages, row) -> reply.")
    return environment, getattr(environment, "tool_schemas", None)


def build_rollout(
    tokenizer: Any, settings: RolloutSettings, *, eos_token_ids: Sequence[int]
) -> MultiTurnRollout | None:
    """The rollout ``settings`` describe, its template checked; None without tools or an environment. The one place
    the settings become a rollout: training, evaluation and generation share it."""
    from lightning_gkd.rollouts.templates import check_template_renders_tools

    built, schemas = build_environment(
        settings.tools, settings.environment, tokenizer, timeout=settings.tool_timeout, parser=settings.tool_parser
    )
    if built is None:
        return None
    check_template_renders_tools(tokenizer, schemas)
    return MultiTurnRollout(
        tokenizer,
        built,
        eos_token_ids=eos_token_ids,
        max_iterations=settings.max_tool_calling_iterations,
        max_transcript_tokens=settings.max_transcript_tokens,
        tools=schemas,
        state_columns=settings.tool_state_columns,
    )


__all__ = [
    "EnvironmentReply",
    "build_rollout",
    "MultiTurnRollout",
    "RolloutStats",
    "build_environment",
    "continuation_ids",
]
