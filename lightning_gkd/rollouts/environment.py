"""Environments: what answers the student between its turns. An environment is a callable
``environment(messages, row) -> reply``: given the conversation so far (ending with the student's latest assistant
message) and the row's carried columns, it returns the next messages (user or tool turns), an
``EnvironmentReply`` (messages plus counted tool calls and failures), or None when the episode is done. Simulated
users and verifiable environments plug in this way; ``ToolEnvironment`` (tools called by the student) is the
common case built on it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_gkd.rollouts.parsers import ToolCallParser
from lightning_gkd.rollouts.tools import Tool, run_tool_call

Message = dict[str, Any]


@dataclass
class EnvironmentReply:
    """The messages that answer a turn, and what it cost: tool ``calls`` run and ``failures`` by kind."""

    messages: list[Message]
    calls: int = 0
    failures: Counter[str] = field(default_factory=Counter)


Environment = Callable[[Sequence[Message], Mapping[str, Any]], "EnvironmentReply | list[Message] | None"]


def as_reply(value: EnvironmentReply | Sequence[Message] | None, where: str) -> EnvironmentReply | None:
    """An environment's return value as a reply (None: done); TypeError naming ``where`` for anything else."""
    if value is None or isinstance(value, EnvironmentReply):
        return value
    if isinstance(value, Sequence) and not isinstance(value, str):
        messages = [dict(message) for message in value]
        bad = next((m for m in messages if not isinstance(m.get("role"), str) or "content" not in m), None)
        if bad is None and messages:
            return EnvironmentReply(messages)
        if not messages:
            return None
    raise TypeError(
        f"{where} returned {value!r}; an environment returns the next messages ([{{'role': 'user', 'content': ...}}, "
        "...]), an EnvironmentReply, or None when the episode is done."
    )


class ToolEnvironment:
    """Runs the tool calls of the student's latest turn (read by ``parser``), each with ``timeout`` seconds and the
    row's carried columns as its ``row_state()``, and answers with one tool message per call (``name`` and
    ``content``, failures as ``{"error": ...}``). A turn without calls ends the episode."""

    def __init__(self, tools: Sequence[Tool], parser: ToolCallParser, *, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"tool_timeout must be > 0 seconds, got {timeout}.")
        self.tools = {tool.name: tool for tool in tools}
        self.parser, self.timeout = parser, timeout

    def __call__(self, messages: Sequence[Message], row: Mapping[str, Any]) -> EnvironmentReply | None:
        calls = self.parser.parse(str(messages[-1].get("content", "")))
        if not calls:
            return None
        reply = EnvironmentReply([], calls=len(calls))
        for call in calls:
            result = run_tool_call(self.tools, call, timeout=self.timeout, state=row)
            reply.messages.append({"role": "tool", "name": call.name or "unknown", "content": result.content})
            if result.failure is not None:
                reply.failures[result.failure] += 1
        return reply
