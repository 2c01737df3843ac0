"""Multi-turn rollouts: the student writes a turn, the environment (tools, a simulated user) answers, the student
writes again, until it answers without a call, hits the iteration cap or the token cap. Every token the student
sampled is a label (kept as sampled, never re-tokenized from text); the prompt and the environment's tokens are -100
(the tool mask).

A transcript is trained as it was sampled: each turn in the context the chat template rendered when the turn was
written. Where the template keeps the history as a prefix of the next render (ChatML, Qwen2.5), the next context is
the tokens so far plus the reply's, and the transcript is one training row. Where it rewrites earlier turns (Qwen3-
style templates drop earlier turns' reasoning; others rewrite tool calls), the next context is the template's new
render, and a new row (a *segment*) starts there: one transcript, several rows, each student token a label in
exactly one of them, so a step's token mean is unchanged. ``split_turns`` makes every turn its own row.

A turn is sampled through any ``Sampler`` (the method's engine) for the rows still going, so rows can finish at
different turns; each call gets every row's whole context (an engine that keeps KV caches reuses the shared prefix)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_gkd.data.chat_tokens import left_pad, render_chat
from lightning_gkd.data.loader import select_rows
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.sampling import derive_seed
from lightning_gkd.rollouts.environment import Environment, EnvironmentReply, Message, as_reply
from lightning_gkd.rollouts.settings import RolloutSettings
from lightning_gkd.rollouts.tools import FAILURE_KINDS

#: ``sample(context_ids, context_attention_mask, seed)`` -> the sampler's batch (``Sampler.sample`` with its model).
SampleTurn = Callable[[torch.Tensor, torch.Tensor, int], Mapping[str, torch.Tensor]]


@dataclass
class RolloutStats:
    """What a batch of rollouts did: per-transcript assistant ``turns``, tool ``calls``, ``lengths`` (tokens after
    the prompt, every segment's) and ``segments`` (training rows), ``failures`` by kind, and how many transcripts
    were ``truncated`` at the token cap, stopped by the iteration ``capped`` with a call pending, or ``unfinished``
    (a turn that hit ``max_new_tokens`` without EOS); ``reasoning_capped``: turns whose reasoning was closed at
    ``max_reasoning_tokens``."""

    turns: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    truncated: int = 0
    capped: int = 0
    unfinished: int = 0
    reasoning_capped: int = 0

    def metrics(self) -> dict[str, float]:
        """Per-transcript means (``turns``, ``calls``, ``failures``, ``transcript_length``, ``segments``), the failure
        rate over calls, each failure kind per transcript, the shares of truncated and capped transcripts and the
        share of turns whose reasoning was capped."""
        rows = max(len(self.turns), 1)
        calls, failures = sum(self.calls), sum(self.failures.values())
        out = {
            "calls": calls / rows,
            "failures": failures / rows,
            "failure_rate": failures / calls if calls else 0.0,
            "turns": sum(self.turns) / rows,
            "transcript_length": sum(self.lengths) / rows,
            "segments": sum(self.segments) / rows,
            "truncated": self.truncated / rows,
            "capped": self.capped / rows,
            "reasoning_capped": self.reasoning_capped / max(sum(self.turns), 1),
        }
        out.update({f"failures_{kind}": self.failures[kind] / rows for kind in FAILURE_KINDS})
        return out

    def add(self, other: RolloutStats) -> None:
        """Fold ``other``'s transcripts and counts into these."""
        self.turns += other.turns
        self.calls += other.calls
        self.lengths += other.lengths
        self.segments += other.segments
        self.failures.update(other.failures)
        self.truncated += other.truncated
        self.capped += other.capped
        self.unfinished += other.unfinished
        self.reasoning_capped += other.reasoning_capped


def _render(tokenizer: Any, messages: Sequence[Message], tools: list[dict] | None, generation: bool) -> str:
    return render_chat(tokenizer, messages, generation, tools)


def continuation_ids(
    tokenizer: Any, messages: Sequence[Message], reply: Sequence[Message], tools: list[dict] | None
) -> list[int] | None:
    """The tokens that follow the student's turn (``messages[-1]``, written up to its EOS) when ``reply`` answers it:
    whatever the template writes after the turn's EOS, the reply's messages and the next generation prompt.

    Found on the text: None when the render through the turn is not a prefix of the render with the reply, or the
    turn's render does not extend the render before it (a template that rewrites earlier turns): the next context
    is then the template's new render (``MultiTurnRollout`` starts a new segment there)."""
    before = _render(tokenizer, messages[:-1], tools, True)
    through = _render(tokenizer, messages, tools, False)
    after = _render(tokenizer, [*messages, *reply], tools, True)
    if not (through.startswith(before) and after.startswith(through)):
        return None
    turn = through[len(before) :]
    eos_text = tokenizer.eos_token or ""
    end = turn.rfind(eos_text) if eos_text else -1
    tail = turn[end + len(eos_text) :] if end >= 0 else ""
    return list(tokenizer(tail + after[len(through) :], add_special_tokens=False)["input_ids"])


def _find(tokens: Sequence[int], pattern: Sequence[int], start: int = 0) -> int:
    """The first index >= ``start`` where ``pattern`` occurs in ``tokens``, else -1."""
    width = len(pattern)
    for i in range(start, len(tokens) - width + 1):
        if list(tokens[i : i + width]) == list(pattern):
            return i
    return -1


@dataclass(frozen=True)
class ReasoningSpan:
    """Where a turn's reasoning lies in its tokens: ``start`` (its opening marker, or 0 when the context opened it),
    ``body`` (its first token after the marker), ``end`` (its closing marker, or None: never closed)."""

    start: int
    body: int
    end: int | None

    def stop(self, close_width: int, turn_length: int) -> int:
        """The index after the reasoning, closing marker included."""
        return turn_length if self.end is None else self.end + close_width


def reasoning_span(
    tokens: Sequence[int], open_ids: Sequence[int], close_ids: Sequence[int], *, opened: bool = False
) -> ReasoningSpan | None:
    """The reasoning of a turn's ``tokens``: from the first ``open_ids`` (or from 0 when ``opened``: the context
    already ends with the opening marker, as some templates' generation prompts do) to the first ``close_ids`` after
    it; None when the turn has none."""
    start = 0 if opened else _find(tokens, open_ids)
    if start < 0:
        return None
    body = start if opened else start + len(open_ids)
    end = _find(tokens, close_ids, body)
    return ReasoningSpan(start, body, end if end >= 0 else None)


@dataclass
class _Segment:
    """One training row of a transcript: ``ids`` (its context, then what followed), the first ``context_length`` of
    them the context it was rendered as, ``context_messages`` the messages that context renders; per token after
    the context: ``trained`` (a label) and the sampler's ``logprobs``."""

    context_length: int
    context_messages: list[Message]
    ids: list[int]
    trained: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def extend(self, tokens: Sequence[int], trained: Sequence[bool], logprobs: Sequence[float]) -> None:
        self.ids += tokens
        self.trained += trained
        self.logprobs += logprobs


@dataclass
class _Transcript:
    messages: list[Message]
    row: Mapping[str, Any]
    segments: list[_Segment]
    turns: int = 0
    calls: int = 0

    @property
    def current(self) -> _Segment:
        return self.segments[-1]


@dataclass
class _Turn:
    """A turn as sampled: its tokens, which of them are trained, their sampler log-probs."""

    tokens: list[int]
    trained: list[bool]
    logprobs: list[float]


class MultiTurnRollout:
    """Rolls a batch of prompts out over several turns with ``environment`` (see ``rollouts.environment``).

    ``max_iterations`` caps the environment replies (TRL's ``max_tool_calling_iterations``): after that many, the
    student's next turn is the last. ``max_transcript_tokens`` caps the context a turn is written in, prompt
    included: a turn or reply that would pass it is dropped and the transcript ends at the turn boundary before it
    (counted as ``truncated``). Both are checked by ``RolloutSettings`` (``build_rollout`` makes this from them), as
    are ``split_turns``, ``reasoning`` ("keep" or "drop": whether reasoning tokens are labels),
    ``max_reasoning_tokens`` and ``reasoning_markers`` (see ``RolloutSettings``). ``tools`` are the schemas the chat
    template renders; ``state_columns`` the batch columns each row's environment receives (its ``row``)."""

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
        split_turns: bool = False,
        reasoning: str = "keep",
        max_reasoning_tokens: int | None = None,
        reasoning_markers: Sequence[str] = ("<think>", "</think>"),
    ) -> None:
        self.tokenizer, self.environment = tokenizer, environment
        self.eos_token_ids = set(eos_token_ids)
        self.max_iterations, self.max_transcript_tokens = max_iterations, max_transcript_tokens
        self.tools, self.state_columns = tools, list(state_columns)
        self.split_turns, self.reasoning, self.max_reasoning_tokens = split_turns, reasoning, max_reasoning_tokens
        self.open_ids, self.close_ids = (
            list(tokenizer(marker, add_special_tokens=False)["input_ids"]) for marker in reasoning_markers
        )

    def run(self, sample: SampleTurn, batch: Mapping[str, Any], seed: int) -> tuple[dict[str, Any], RolloutStats]:
        """Transcripts for ``batch``'s prompts (``prompts``, ``prompt_attention_mask``, ``prompt_messages``): the
        sampler's batch contract (``input_ids``, ``attention_mask``, ``labels``, ``sampled_logprobs``, each
        ``(R, P + N)``; ``prompts``/``prompt_attention_mask`` ``(R, P)``: each row's context), one row per segment,
        a transcript's segments in order (R = B where no template rewrote a turn and ``split_turns`` is off: then
        the prompt columns are the batch's own). Every other column of ``batch`` is repeated for each of its
        segments; ``prompt_messages`` are each segment's context messages, ``transcripts`` each row's whole
        transcript, ``transcript_row`` ``(R,)`` the batch row it came from and ``segment`` ``(R,)`` its index in
        the transcript. Also the stats."""
        if "prompt_messages" not in batch:
            raise ValueError(
                "A multi-turn rollout needs each row's prompt messages in the batch (ChatDataModule."
                "carry_prompt_messages(); the on-policy methods call it when tools or an environment are set)."
            )
        prompts, prompt_mask = batch["prompts"], batch["prompt_attention_mask"]
        transcripts = []
        for i in range(prompts.shape[0]):
            messages = [dict(m) for m in batch["prompt_messages"][i]]
            ids = prompts[i][prompt_mask[i].bool()].tolist()
            transcripts.append(
                _Transcript(
                    messages=messages,
                    row={column: batch[column][i] for column in self.state_columns},
                    segments=[_Segment(len(ids), [dict(m) for m in messages], ids)],
                )
            )
        stats = RolloutStats()
        active = list(range(len(transcripts)))
        for turn in range(self.max_iterations + 1):
            if not active:
                break
            going = [transcripts[i] for i in active]
            turns = self._sample_turns(sample, going, derive_seed(seed, turn), stats, prompts.device)
            active = [
                i
                for i, written in zip(active, turns, strict=True)
                if self._take_turn(transcripts[i], written, last=turn == self.max_iterations, stats=stats)
            ]
        return self._batch(batch, transcripts, prompts), self._finish(stats, transcripts)

    # -- one turn ------------------------------------------------------------------------------------------------------
    def _call(
        self, sample: SampleTurn, contexts: list[list[int]], seed: int, device: torch.device
    ) -> list[tuple[list[int], list[float]]]:
        """One sampler call: each context's turn (its supervised tokens) and their log-probs."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        context_ids = left_pad(contexts, pad).to(device)
        context_mask = left_pad([[1] * len(ids) for ids in contexts], 0).to(device)
        out = sample(context_ids, context_mask, seed)
        width = context_ids.shape[1]
        written = []
        for j in range(len(contexts)):
            supervised = out["labels"][j, width:] != IGNORE_INDEX
            tokens = out["input_ids"][j, width:][supervised].tolist()
            logprobs = out["sampled_logprobs"][j, width:][supervised].tolist() if "sampled_logprobs" in out else []
            written.append((tokens, logprobs or [0.0] * len(tokens)))
        return written

    def _sample_turns(
        self,
        sample: SampleTurn,
        transcripts: Sequence[_Transcript],
        seed: int,
        stats: RolloutStats,
        device: torch.device,
    ) -> list[_Turn]:
        """The next turn of each of ``transcripts``, in its current context. A turn whose reasoning runs past
        ``max_reasoning_tokens`` is cut there, closed with the closing marker (not trained) and written on from
        there by a second call for those rows."""
        contexts = [t.current.ids for t in transcripts]
        written = self._call(sample, contexts, seed, device)
        turns = [_Turn(tokens, [True] * len(tokens), logprobs) for tokens, logprobs in written]
        if self.max_reasoning_tokens is not None:
            capped = []
            for j, (t, turn) in enumerate(zip(transcripts, turns, strict=True)):
                span = reasoning_span(turn.tokens, self.open_ids, self.close_ids, opened=self._opened(t))
                if span is not None and (span.end or len(turn.tokens)) - span.body > self.max_reasoning_tokens:
                    cut = span.body + self.max_reasoning_tokens
                    turns[j] = _Turn(
                        turn.tokens[:cut] + self.close_ids,
                        turn.trained[:cut] + [False] * len(self.close_ids),
                        turn.logprobs[:cut] + [0.0] * len(self.close_ids),
                    )
                    capped.append(j)
            if capped:
                stats.reasoning_capped += len(capped)
                more = self._call(sample, [contexts[j] + turns[j].tokens for j in capped], derive_seed(seed, 1), device)
                for j, (tokens, logprobs) in zip(capped, more, strict=True):
                    turns[j].tokens += tokens
                    turns[j].trained += [True] * len(tokens)
                    turns[j].logprobs += logprobs
        if self.reasoning == "drop":
            for t, turn in zip(transcripts, turns, strict=True):
                span = reasoning_span(turn.tokens, self.open_ids, self.close_ids, opened=self._opened(t))
                if span is not None:
                    stop = span.stop(len(self.close_ids), len(turn.tokens))
                    turn.trained[span.start : stop] = [False] * (stop - span.start)
        return turns

    def _opened(self, t: _Transcript) -> bool:
        """Whether ``t``'s context ends with the opening marker (the generation prompt opened the reasoning)."""
        return bool(self.open_ids) and t.current.ids[-len(self.open_ids) :] == self.open_ids

    def _take_turn(self, t: _Transcript, turn: _Turn, *, last: bool, stats: RolloutStats) -> bool:
        """Append ``turn`` to ``t`` and the environment's reply; True if ``t`` goes on."""
        segment = t.current
        if self.max_transcript_tokens is not None and len(segment.ids) + len(turn.tokens) > self.max_transcript_tokens:
            stats.truncated += 1
            return False
        segment.extend(turn.tokens, turn.trained, [lp * tr for lp, tr in zip(turn.logprobs, turn.trained, strict=True)])
        t.turns += 1
        content = self.tokenizer.decode(turn.tokens, skip_special_tokens=True)
        t.messages.append({"role": "assistant", "content": content})
        if not turn.tokens or turn.tokens[-1] not in self.eos_token_ids:
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
        following = (
            None if self.split_turns else continuation_ids(self.tokenizer, t.messages, reply.messages, self.tools)
        )
        if following is None:  # the template rewrote the history (or every turn is a row): a new segment
            t.messages += reply.messages
            context = self.tokenizer(_render(self.tokenizer, t.messages, self.tools, True), add_special_tokens=False)
            ids = list(context["input_ids"])
            if self.max_transcript_tokens is not None and len(ids) >= self.max_transcript_tokens:
                stats.truncated += 1
                return False
            t.segments.append(_Segment(len(ids), [dict(m) for m in t.messages], ids))
            return True
        if self.max_transcript_tokens is not None and len(segment.ids) + len(following) >= self.max_transcript_tokens:
            stats.truncated += 1
            return False
        segment.extend(following, [False] * len(following), [0.0] * len(following))
        t.messages += reply.messages
        return True

    # -- the batch -----------------------------------------------------------------------------------------------------
    @staticmethod
    def _finish(stats: RolloutStats, transcripts: Sequence[_Transcript]) -> RolloutStats:
        for t in transcripts:
            stats.turns.append(t.turns)
            stats.calls.append(t.calls)
            stats.lengths.append(sum(len(s.ids) - s.context_length for s in t.segments))
            stats.segments.append(len(t.segments))
        return stats

    def _batch(
        self, batch: Mapping[str, Any], transcripts: Sequence[_Transcript], prompts: torch.Tensor
    ) -> dict[str, Any]:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows = [(i, k, s) for i, t in enumerate(transcripts) for k, s in enumerate(t.segments)]
        split = len(rows) != len(transcripts)
        context_width = max([prompts.shape[1], *(s.context_length for _, _, s in rows)])
        completion = max((len(s.ids) - s.context_length for _, _, s in rows), default=0)
        width = context_width + completion
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for r, (_, _, s) in enumerate(rows):
            start = context_width - s.context_length
            end = context_width + len(s.ids) - s.context_length
            input_ids[r, start:end] = torch.tensor(s.ids, dtype=torch.long)
            attention[r, start:end] = 1
            trained = torch.tensor(s.trained, dtype=torch.bool)
            tail = input_ids[r, context_width:end]
            labels[r, context_width:end] = torch.where(trained, tail, IGNORE_INDEX)
            logprobs[r, context_width:end] = torch.tensor(s.logprobs, dtype=torch.float32)
        device = prompts.device
        source = torch.tensor([i for i, _, _ in rows], dtype=torch.long)
        out = dict(select_rows(batch, source)) if split else dict(batch)
        if split:
            out["prompts"] = input_ids[:, :context_width].to(device)
            out["prompt_attention_mask"] = attention[:, :context_width].to(device)
        out["prompt_messages"] = [s.context_messages for _, _, s in rows]
        return {
            **out,
            "input_ids": input_ids.to(device),
            "attention_mask": attention.to(device),
            "labels": labels.to(device),
            "sampled_logprobs": logprobs.to(device),
            "transcripts": [transcripts[i].messages for i, _, _ in rows],
            "transcript_row": source.to(device),
            "segment": torch.tensor([k for _, k, _ in rows], dtype=torch.long, device=device),
        }


def first_segments(out: Mapping[str, Any]) -> list[int]:
    """The rows of a rollout's batch that start a transcript (segment 0), in the batch's transcript order."""
    return [row for row, segment in enumerate(out["segment"].tolist()) if segment == 0]


def rollout_transcripts(out: Mapping[str, Any]) -> list[list[Message]]:
    """Each transcript of a rollout's batch once (its rows repeat it per segment), in the batch's order."""
    return [out["transcripts"][row] for row in first_segments(out)]


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
        split_turns=settings.split_turns,
        reasoning=settings.reasoning,
        max_reasoning_tokens=settings.max_reasoning_tokens,
        reasoning_markers=settings.reasoning_markers,
    )


__all__ = [
    "EnvironmentReply",
    "build_rollout",
    "MultiTurnRollout",
    "RolloutStats",
    "build_environment",
    "continuation_ids",
    "first_segments",
    "reasoning_span",
    "rollout_transcripts",
]
