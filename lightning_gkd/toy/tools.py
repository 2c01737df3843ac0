"""The toy agentic task: each row holds its own facts (a key-value store of 2-digit numbers, the ``facts`` column,
JSON) that only the ``lookup`` tool can read; the question asks for the sum of two of them, which the ``add`` tool
computes. A correct transcript makes three calls (lookup, lookup, add) and then answers with the sum:

    user       b+e
    assistant  <tool_call>{"name":"lookup","arguments":{"key":"b"}}</tool_call>
    tool       37
    assistant  <tool_call>{"name":"lookup","arguments":{"key":"e"}}</tool_call>
    tool       58
    assistant  <tool_call>{"name":"add","arguments":{"a":37,"b":58}}</tool_call>
    tool       95
    assistant  95

The facts are never in the prompt, so a student that invents a tool result (or skips a call) is right by chance
only. Tools get the row's facts through ``lightning_gkd.rollouts.row_state()`` (the method carries the column:
``tool_state_columns=["facts"]``)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_gkd.rollouts.tools import row_state

KEYS = "abcdefghijklmnopqrstuvwxyz"
FACTS_PER_ROW = 6
_SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}
_DEFAULT_ROWS = {"train": 20000, "val": 256, "test": 512}


def lookup(key: str) -> int:
    """Look up the number this row's facts store under a key.

    Args:
        key: The key, one lowercase letter.
    """
    facts = row_state()["facts"]
    if isinstance(facts, str):  # the shipped rows hold JSON text; a jsonl row may hold the object itself
        facts = json.loads(facts)
    if key not in facts:
        raise KeyError(f"no fact named {key!r}")
    return int(facts[key])


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return int(a) + int(b)


#: The task's tools, as ``method.rollout.tools`` names them.
TOOLS = ("lightning_gkd.toy.tools.lookup", "lightning_gkd.toy.tools.add")


def tool_call(name: str, **arguments: Any) -> str:
    """A call in the ``<tool_call>`` format, compact JSON (what the teacher is trained to write)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def transcript(facts: dict[str, int], first: str, second: str) -> list[dict[str, str]]:
    """The correct three-call transcript for ``first+second``."""
    a, b = facts[first], facts[second]
    return [
        {"role": "user", "content": f"{first}+{second}"},
        {"role": "assistant", "content": tool_call("lookup", key=first)},
        {"role": "tool", "name": "lookup", "content": str(a)},
        {"role": "assistant", "content": tool_call("lookup", key=second)},
        {"role": "tool", "name": "lookup", "content": str(b)},
        {"role": "assistant", "content": tool_call("add", a=a, b=b)},
        {"role": "tool", "name": "add", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


def tool_rows(split: str = "train", num_rows: int | None = None) -> list[dict[str, Any]]:
    """Rows of ``split`` (``train``/``val``/``test``, disjoint seeds): ``messages`` (the correct transcript),
    ``facts`` (JSON of the row's key-value store) and ``answer`` (the sum, as text)."""
    if split not in _SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(_SPLIT_SEEDS)}, got {split!r}.")
    rng = random.Random(1000 + _SPLIT_SEEDS[split])
    rows = []
    for _ in range(num_rows or _DEFAULT_ROWS[split]):
        keys = rng.sample(KEYS, FACTS_PER_ROW)
        facts = {key: rng.randint(10, 99) for key in keys}
        first, second = rng.sample(keys, 2)
        messages = transcript(facts, first, second)
        rows.append({"messages": messages, "facts": json.dumps(facts), "answer": messages[-1]["content"]})
    return rows


#: How a transcript of this task ends, in the order ``failure_kind`` checks them.
OUTCOMES = (
    "correct",
    "malformed call",
    "wrong tool or arguments",
    "ignored a lookup result",
    "ignored the sum",
    "invented a tool result",
    "not stopping",
)


def failure_kind(messages: Sequence[Mapping[str, Any]], row: Mapping[str, Any]) -> str:
    """Where a transcript of this task went wrong (one of ``OUTCOMES``), judged by its first deviation from the
    correct procedure: a call that does not parse (*malformed call*); a call to another tool, a lookup of a key the
    question does not name, or other arguments (*wrong tool or arguments*); an ``add`` of other numbers than the
    lookups returned (*ignored a lookup result*), or a final answer other than the sum ``add`` returned (*ignored the
    sum*): both are the issue's "ignoring a result"; an answer given
    before both lookups and the addition came back (*invented a tool result*); a transcript that ends on a call or
    mid-turn (*not stopping*: the iteration or token cap)."""
    from lightning_gkd.rollouts.parsers import HermesToolCallParser

    facts = json.loads(row["facts"])
    wanted = set(row["messages"][0]["content"].split("+"))
    parser = HermesToolCallParser()
    looked_up: dict[str, int] = {}
    added: int | None = None
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for position in assistant:
        content = str(messages[position]["content"])
        calls = parser.parse(content)
        if not calls:  # an answer
            if position != assistant[-1]:
                return "not stopping"
            if len(looked_up) < 2 or added is None:
                return "correct" if content.strip() == row["answer"] else "invented a tool result"
            return "correct" if content.strip() == row["answer"] else "ignored the sum"
        for call in calls:
            if call.error is not None:
                return "malformed call"
            if call.name == "lookup" and call.arguments.get("key") in wanted and set(call.arguments) == {"key"}:
                looked_up[call.arguments["key"]] = facts[call.arguments["key"]]
            elif call.name == "add" and set(call.arguments) == {"a", "b"}:
                if sorted(map(str, call.arguments.values())) != sorted(map(str, looked_up.values())):
                    return "ignored a lookup result"
                added = sum(looked_up.values())
            else:
                return "wrong tool or arguments"
    return "not stopping"  # the last turn was a call: the cap ended the transcript


#: How the task is rolled out and scored: tool replies per transcript, tokens a turn, tokens a transcript.
MAX_TOOL_CALLING_ITERATIONS, MAX_NEW_TOKENS, MAX_TRANSCRIPT_TOKENS = 4, 24, 128


def task_rollout_for(
    tokenizer: Any,
    *,
    tools: Sequence[str],
    state_columns: Sequence[str],
    max_tool_calling_iterations: int,
    max_transcript_tokens: int,
) -> Any:
    """A toy agentic task's ``MultiTurnRollout``: its ``tools`` (import paths), the row columns they read, its caps;
    EOS is the tokenizer's. Returns the rollout (``lightning_gkd.rollouts.build_rollout``)."""
    from lightning_gkd.rollouts import RolloutSettings, build_rollout

    settings = RolloutSettings(
        tools=list(tools),
        max_tool_calling_iterations=max_tool_calling_iterations,
        tool_timeout=5.0,
        max_transcript_tokens=max_transcript_tokens,
        tool_state_columns=list(state_columns),
    )
    return build_rollout(tokenizer, settings, eos_token_ids=[tokenizer.eos_token_id])


def task_rollout(tokenizer: Any) -> Any:
    """The ``MultiTurnRollout`` this task is trained and scored with (its tools, the row's ``facts``, its caps)."""
    return task_rollout_for(
        tokenizer,
        tools=TOOLS,
        state_columns=("facts",),
        max_tool_calling_iterations=MAX_TOOL_CALLING_ITERATIONS,
        max_transcript_tokens=MAX_TRANSCRIPT_TOKENS,
    )
