"""``RolloutSettings``: multi-turn rollouts with tools or an environment (the on-policy methods' ``rollout`` group;
Hydra ``method.rollout.*``; TRL's names)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gkd.rollouts.parsers import ToolCallParser


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

    @property
    def enabled(self) -> bool:
        """Whether samples are multi-turn transcripts (tools or an environment are set)."""
        return bool(self.tools) or self.environment is not None
