"""Tool-call parsers: an assistant turn's text to the calls it makes. ``HermesToolCallParser`` reads the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format (Qwen2.5, Hermes); ``ResponseSchemaParser`` uses
the tokenizer's own response schema (``tokenizer.parse_response``) where its chat template defines one.
``default_parser`` picks between them. Any object with ``parse(text) -> list[ToolCall]`` plugs in the same way."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from lightning_gkd.rollouts.tools import ToolCall


@runtime_checkable
class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]:
        """The calls ``text`` makes, in order; a call that cannot be read is a ``ToolCall`` with ``error`` set."""
        ...


def _call_from_object(value: Any) -> ToolCall:
    """A ``{"name": str, "arguments": dict | JSON string}`` object (or OpenAI's ``{"function": {...}}``) as a
    call; anything else as a malformed one."""
    if isinstance(value, Mapping) and isinstance(value.get("function"), Mapping):
        value = value["function"]
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return ToolCall("", {}, error=f"a tool call needs a 'name' string, got {value!r}")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return ToolCall(value["name"], {}, error=f"arguments of {value['name']} are not JSON: {error}")
    if not isinstance(arguments, Mapping):
        return ToolCall(value["name"], {}, error=f"arguments of {value['name']} must be an object, got {arguments!r}")
    return ToolCall(value["name"], dict(arguments))


class HermesToolCallParser:
    """Calls written as ``<tool_call>JSON</tool_call>``, the JSON an object with ``name`` and ``arguments`` (an
    object, or a string holding one). Text outside the markers is the turn's content; an opening marker without its
    closing one, or JSON that does not parse, is a malformed call."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.start, self.end = start, end
        self._block = re.compile(re.escape(start) + r"(.*?)(" + re.escape(end) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for match in self._block.finditer(text):
            body, closed = match.group(1).strip(), bool(match.group(2))
            if not closed:
                calls.append(ToolCall("", {}, error=f"{self.start} without {self.end}: {body[:80]!r}"))
                continue
            try:
                value = json.loads(body)
            except json.JSONDecodeError as error:
                calls.append(ToolCall("", {}, error=f"the tool call is not JSON ({error}): {body[:80]!r}"))
                continue
            calls.append(_call_from_object(value))
        return calls


class ResponseSchemaParser:
    """The calls the tokenizer's response schema finds (``tokenizer.parse_response(text)["tool_calls"]``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str) -> list[ToolCall]:
        try:
            message = self.tokenizer.parse_response(text)
        except Exception as error:
            return [ToolCall("", {}, error=f"the response does not match the tokenizer's response schema: {error}")]
        return [_call_from_object(call) for call in (message or {}).get("tool_calls") or []]


def default_parser(tokenizer: Any) -> ToolCallParser:
    """The tokenizer's response schema where it has one, else the ``<tool_call>`` format."""
    if getattr(tokenizer, "response_schema", None) and callable(getattr(tokenizer, "parse_response", None)):
        return ResponseSchemaParser(tokenizer)
    return HermesToolCallParser()
