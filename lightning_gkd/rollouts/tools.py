"""Tools a student may call during a rollout: typed Python functions with docstrings, their JSON schemas (from
transformers' ``get_json_schema``, what chat templates render), and running one call with a timeout where every
failure becomes an ``{"error": ...}`` result and a counted failure kind, never an exception.

Tools run user code in this process (a thread per call, so a timeout stops waiting for it but cannot kill it)."""

from __future__ import annotations

import contextvars
import importlib
import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

#: The failure kinds a tool call can end in (``train/tools/failures`` counts them all).
FAILURE_KINDS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout", "unserialisable")

_ROW_STATE: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("lightning_gkd_tool_row_state")
_EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lightning_gkd_tool")


def row_state() -> Mapping[str, Any]:
    """The columns of the row whose rollout is calling the tool (those the method carries: ``tool_state_columns``),
    e.g. a row's own key-value store. Inside a tool call only; ``RuntimeError`` elsewhere."""
    try:
        return _ROW_STATE.get()
    except LookupError:
        raise RuntimeError(
            "row_state() is only available inside a tool called by a rollout (it returns that row's carried columns: "
            "GKDModule(rollout={'tool_state_columns': [...]}); Hydra: method.rollout.tool_state_columns=[...])."
        ) from None


@contextmanager
def using_row_state(state: Mapping[str, Any]) -> Iterator[None]:
    token = _ROW_STATE.set(state)
    try:
        yield
    finally:
        _ROW_STATE.reset(token)


@dataclass(frozen=True)
class Tool:
    """A callable the student may call by ``name``; ``schema`` is what the chat template renders."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from an assistant turn: ``name`` and ``arguments``; ``error`` when it could not be parsed
    (``malformed``: the text between the call markers is not a JSON object with a name and arguments)."""

    name: str
    arguments: Mapping[str, Any]
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """A call's result as the tool message's content, and its failure kind (None: it succeeded)."""

    content: str
    failure: str | None = None


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """``module.attribute`` (Hydra's way of naming a function) to the object; ValueError naming ``what``."""
    module_name, _, attribute = path.rpartition(".")
    try:
        value = getattr(importlib.import_module(module_name), attribute) if module_name else None
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {path!r} cannot be imported ({error}); give 'package.module.function'.") from error
    if value is None:
        raise ValueError(f"{what} {path!r} is not an import path; give 'package.module.function'.")
    return value


def build_tools(tools: Sequence[Callable[..., Any] | str]) -> list[Tool]:
    """Tools from callables or their import paths, each with its JSON schema; ValueError naming a non-callable, a
    function whose schema cannot be built (missing type hints or docstring) or a duplicate name."""
    built: list[Tool] = []
    for index, entry in enumerate(tools):
        function = import_callable(entry, f"tools[{index}]") if isinstance(entry, str) else entry
        if not callable(function):
            raise ValueError(
                f"tools[{index}] ({entry!r}) is not callable; a tool is a typed function with a docstring."
            )
        name = getattr(function, "__name__", repr(function))
        try:
            schema = get_json_schema(function)
        except Exception as error:  # transformers raises its own TypeError/ValueError subclasses
            raise ValueError(
                f"tools[{index}] {name!r}: its JSON schema cannot be built ({error}). A tool needs type hints on "
                "every argument and a Google-style docstring with an 'Args:' line per argument "
                "(transformers.utils.get_json_schema)."
            ) from error
        built.append(Tool(schema["function"]["name"], function, schema))
    names = [tool.name for tool in built]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"tools has several tools named {duplicates}; each tool needs its own name.")
    return built


def error_content(message: str) -> str:
    return json.dumps({"error": message})


def run_tool_call(
    tools: Mapping[str, Tool], call: ToolCall, *, timeout: float, state: Mapping[str, Any] | None = None
) -> ToolResult:
    """Run ``call`` with ``state`` as its ``row_state()``, waiting at most ``timeout`` seconds. A malformed call, an
    unknown tool, arguments the function does not take, an exception, a timeout or a result ``json.dumps`` cannot
    write gives ``{"error": ...}`` and its failure kind. A string result is the content as is; others are JSON."""
    if call.error is not None:
        return ToolResult(error_content(call.error), "malformed")
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(error_content(f"unknown tool {call.name!r}; tools: {sorted(tools)}"), "unknown_tool")
    try:
        inspect.signature(tool.function).bind(**call.arguments)
    except TypeError as error:
        return ToolResult(error_content(f"bad arguments for {call.name}: {error}"), "bad_arguments")
    context = contextvars.copy_context()

    def call_in_context() -> Any:
        with using_row_state(state or {}):
            return tool.function(**call.arguments)

    future = _EXECUTOR.submit(context.run, call_in_context)
    try:
        result = future.result(timeout=timeout)
    except FutureTimeout:
        return ToolResult(error_content(f"{call.name} timed out after {timeout:g} s"), "timeout")
    except Exception as error:
        return ToolResult(error_content(f"{call.name} raised {type(error).__name__}: {error}"), "exception")
    if isinstance(result, str):
        return ToolResult(result)
    try:
        return ToolResult(json.dumps(result))
    except (TypeError, ValueError) as error:
        return ToolResult(error_content(f"{call.name} returned an unserialisable result: {error}"), "unserialisable")
