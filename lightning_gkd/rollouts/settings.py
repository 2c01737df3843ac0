"""``RolloutSettings``: multi-turn rollouts with tools or an environment (the on-policy methods' ``rollout`` group;
Hydra ``method.rollout.*``; TRL's names)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gkd.rollouts.parsers import ToolCallParser

#: ``RolloutSettings.reasoning``'s choices.
REASONING_CHOICES = ("keep", "drop")


@dataclass(frozen=True)
class RolloutSettings:
    """With ``tools`` or an ``environment``, a sampled completion is a whole transcript: the model writes a turn, the
    tools (or the environment) answer, until it answers without a call, ``max_tool_calling_iterations`` replies have
    been made or the transcript reaches ``max_transcript_tokens`` (``rollouts.rollout.MultiTurnRollout``). Neither:
    one completion per prompt, and the other fields are not read. Checked when made, before any model loads."""

    #: Tools the model may call: callables with typed signatures and docstrings, or their import paths.
    tools: Sequence[Callable[..., Any] | str] = ()
    #: Instead of tools: ``environment(messages, row) -> next messages | None``, or its import path.
    environment: Callable[..., Any] | str | None = None
    #: Environment replies per transcript (>= 0); the model's next turn is then the last.
    max_tool_calling_iterations: int = 5
    #: Seconds a tool call may take before it counts as a failure (> 0).
    tool_timeout: float = 10.0
    #: Cap on a transcript's tokens, prompt included (>= 1; None: none).
    max_transcript_tokens: int | None = None
    #: Row columns a tool reads through ``lightning_gkd.rollouts.row_state()``.
    tool_state_columns: Sequence[str] = ()
    #: Reads the calls of a turn (None: the tokenizer's response schema, else ``<tool_call>{json}</tool_call>``).
    tool_parser: ToolCallParser | None = None
    #: Every assistant turn its own training row, in the context it was written in, even where the template keeps
    #: the history as a prefix (a teacher of another tokenizer needs it). False: a transcript is one row, split only
    #: where the template rewrites earlier turns.
    split_turns: bool = False
    #: Whether the tokens of a turn's reasoning (``reasoning_markers`` and what they enclose) are trained: "keep"
    #: (labels, as the student wrote them) or "drop" (context only: the student reads them, no loss on them).
    reasoning: str = "keep"
    #: Cap on the reasoning tokens of one turn (>= 1; None: none). Past it the reasoning is closed with the end
    #: marker (written for the student, never trained) and the student writes the rest of the turn from there.
    max_reasoning_tokens: int | None = None
    #: The texts that open and close a turn's reasoning (Qwen3's and DeepSeek-R1's ``<think>``, ``</think>``).
    reasoning_markers: Sequence[str] = ("<think>", "</think>")

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools or ()))  # Hydra: null or a list
        object.__setattr__(self, "tool_state_columns", tuple(self.tool_state_columns or ()))
        iterations = self.max_tool_calling_iterations
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
            raise ValueError(
                f"rollout.max_tool_calling_iterations must be an integer >= 0, got {iterations!r} (0: the model's "
                "first turn is its last)."
            )
        if isinstance(self.tool_timeout, bool) or not self.tool_timeout > 0:
            raise ValueError(f"rollout.tool_timeout must be > 0 seconds, got {self.tool_timeout!r}.")
        cap = self.max_transcript_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"rollout.max_transcript_tokens must be an integer >= 1 or null (no cap), got {cap!r}.")
        if self.reasoning not in REASONING_CHOICES:
            raise ValueError(
                f"rollout.reasoning must be one of {REASONING_CHOICES} (train the student's reasoning tokens or only "
                f"read them), got {self.reasoning!r}."
            )
        budget = self.max_reasoning_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"rollout.max_reasoning_tokens must be an integer >= 1 or null (no cap), got {budget!r}.")
        markers = tuple(self.reasoning_markers or ())
        if len(markers) != 2 or not all(isinstance(m, str) and m for m in markers) or markers[0] == markers[1]:
            raise ValueError(
                "rollout.reasoning_markers must be two different non-empty texts (the opening and the closing "
                f"marker of a turn's reasoning, e.g. ['<think>', '</think>']), got {self.reasoning_markers!r}."
            )
        object.__setattr__(self, "reasoning_markers", markers)

    @property
    def enabled(self) -> bool:
        """Whether samples are multi-turn transcripts (tools or an environment are set)."""
        return bool(self.tools) or self.environment is not None
