"""The toy recovery task: an agentic task where a slip leads to a state the teacher's clean transcripts never show.

Each row holds a small directory of records (the ``records`` column, JSON) under 4-letter keys that only the
``lookup`` tool can read. The user names a key; its record is another key, whose record is the number asked for. A
correct transcript makes two calls, copying a key each time (from the prompt, then from the first result), and
answers with the number:

    user       kqzt
    assistant  <tool_call>{"name":"lookup","arguments":{"key":"kqzt"}}</tool_call>
    tool       wbxe
    assistant  <tool_call>{"name":"lookup","arguments":{"key":"wbxe"}}</tool_call>
    tool       58
    assistant  58

``lookup`` checks its argument: a key that is not four lowercase letters, or that the directory does not hold,
raises, and the rollout answers with a tool message ``{"error": ...}`` (which does not repeat the key). A student that
miscopies a key has to notice the error and call again with the right key, copied again from where it came from (a
*recovery*):

    assistant  <tool_call>{"name":"lookup","arguments":{"key":"kqxt"}}</tool_call>
    tool       {"error": "lookup raised KeyError: "}
    assistant  <tool_call>{"name":"lookup","arguments":{"key":"kqzt"}}</tool_call>

The dataset's ``messages`` are the clean transcripts (what SFT and supervised KD train on); ``teacher_rows`` adds
error→retry episodes (injected miscopies, the error, the correct retry) for the teacher's training only, with the
injected miscopies never labelled (``MistakeMasking``), so the teacher's own greedy transcripts are clean but its
distribution after an error says "retry with the right key". The calls have the tools task's format and tool name,
so the task's models start from that task's (scripts/train_toy_tools.py --task recovery)."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_gkd.rollouts.tools import row_state
from lightning_gkd.toy.tools import task_rollout_for, tool_call

KEY_LENGTH = 4
ALPHABET = string.ascii_lowercase
DECOYS = 4  # records besides the two the question leads through
_SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}
_DEFAULT_ROWS = {"train": 20000, "val": 256, "test": 512}


def lookup(key: str) -> str:
    """Look up the record this row's directory stores under a key: another key, or a number.

    Args:
        key: The record's key, four lowercase letters.
    """
    if not isinstance(key, str) or len(key) != KEY_LENGTH or not all(c in ALPHABET for c in key):
        raise ValueError("bad key")
    records = json.loads(row_state()["records"])
    if key not in records:
        raise KeyError()  # the message names no key: the right one is where the agent copied it from
    return str(records[key])


#: The task's tools, as ``method.rollout.tools`` names them.
TOOLS = ("lightning_gkd.toy.recovery.lookup",)
#: The row columns the tools read (``method.rollout.tool_state_columns``).
STATE_COLUMNS = ("records",)


def error_message(key: str) -> str:
    """The tool message's content when ``lookup`` is called with ``key`` on an empty directory, as a rollout writes
    it (``lightning_gkd.rollouts.tools.run_tool_call``): what a miscopied key gets back."""
    from lightning_gkd.rollouts.tools import ToolCall, build_tools, run_tool_call

    tools = {tool.name: tool for tool in build_tools([lookup])}
    return run_tool_call(tools, ToolCall("lookup", {"key": key}), timeout=5.0, state={"records": "{}"}).content


def miscopy(key: str, rng: random.Random) -> str:
    """A slip of the kind a weak copier makes: one letter replaced (most often), two neighbours swapped, a letter
    dropped or a letter doubled; never ``key`` itself."""
    while True:
        kind = rng.choices(("replace", "swap", "drop", "double"), weights=(6, 2, 1, 1))[0]
        i = rng.randrange(len(key))
        if kind == "replace":
            wrong = key[:i] + rng.choice(ALPHABET.replace(key[i], "")) + key[i + 1 :]
        elif kind == "swap":
            i = min(i, len(key) - 2)
            wrong = key[:i] + key[i + 1] + key[i] + key[i + 2 :]
        elif kind == "drop":
            wrong = key[:i] + key[i + 1 :]
        else:
            wrong = key[: i + 1] + key[i] + key[i + 1 :]
        if wrong != key:
            return wrong


def transcript(
    records: Mapping[str, str], start: str, mistakes: Sequence[tuple[int, str]] = ()
) -> list[dict[str, Any]]:
    """The transcript for the question ``start``: a lookup of ``start``, a lookup of the key it holds, the answer.
    ``mistakes`` ((hop, wrong key), hop 0 or 1) inserts a failed lookup of the wrong key, and its error, before that
    hop's correct lookup, in the order given. Each message carries ``mistake`` True when it is an injected miscopy."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": start}]
    key = start
    for hop in range(2):
        for where, wrong in mistakes:
            if where == hop:
                messages.append({"role": "assistant", "content": tool_call("lookup", key=wrong), "mistake": True})
                messages.append({"role": "tool", "name": "lookup", "content": error_message(wrong)})
        messages.append({"role": "assistant", "content": tool_call("lookup", key=key)})
        messages.append({"role": "tool", "name": "lookup", "content": records[key]})
        key = records[key]
    messages.append({"role": "assistant", "content": key})
    return messages


def _clean(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "mistake"} for m in messages]


def _directory(rng: random.Random) -> tuple[dict[str, str], str, str]:
    """A row's records, the question's key and the answer."""
    keys: list[str] = []
    while len(keys) < 2 + DECOYS:
        key = "".join(rng.choice(ALPHABET) for _ in range(KEY_LENGTH))
        if key not in keys:
            keys.append(key)
    start, middle, *decoys = keys
    value = str(rng.randint(10, 99))
    entries = [(start, middle), (middle, value)]
    for decoy in decoys:  # decoys look like the others: a key or a number
        entries.append((decoy, rng.choice(keys) if rng.random() < 0.5 else str(rng.randint(10, 99))))
    rng.shuffle(entries)
    return dict(entries), start, value


def recovery_rows(split: str = "train", num_rows: int | None = None) -> list[dict[str, Any]]:
    """Rows of ``split`` (``train``/``val``/``test``, disjoint seeds): ``messages`` (the clean correct transcript),
    ``records`` (JSON of the row's directory) and ``answer`` (the number, as text)."""
    if split not in _SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(_SPLIT_SEEDS)}, got {split!r}.")
    rng = random.Random(2000 + _SPLIT_SEEDS[split])
    rows = []
    for _ in range(num_rows or _DEFAULT_ROWS[split]):
        records, start, value = _directory(rng)
        rows.append({"messages": _clean(transcript(records, start)), "records": json.dumps(records), "answer": value})
    return rows


def teacher_rows(num_rows: int, *, error_share: float = 0.4, seed: int = 0) -> list[dict[str, Any]]:
    """The teacher's training rows: ``num_rows`` training transcripts (the train split's questions and directories),
    a share ``error_share`` of them with injected miscopies: one (at either hop), or in a fifth of them two (the
    retry miscopied again, or one at each hop), each followed by its error and the correct retry. Each row's
    ``mistake_turns`` lists the indices (among its assistant messages) of the injected miscopies, which training must
    not label (``MistakeMasking``). Returns the rows (``messages``, ``records``, ``answer``, ``mistake_turns``)."""
    if not 0 <= error_share <= 1:
        raise ValueError(f"error_share must be in [0, 1], got {error_share}.")
    rng = random.Random(seed)
    out = []
    for row in recovery_rows("train", num_rows):
        records, start = json.loads(row["records"]), row["messages"][0]["content"]
        sources = [start, records[start]]
        mistakes: list[tuple[int, str]] = []
        if rng.random() < error_share:
            hops = [rng.randrange(2)]
            if rng.random() < 0.2:
                hops.append(rng.choice([hops[0], 1 - hops[0]]))
            mistakes = [(hop, miscopy(sources[hop], rng)) for hop in sorted(hops)]
        messages = transcript(records, start, mistakes)
        turns = [m for m in messages if m["role"] == "assistant"]
        out.append(
            {
                "messages": _clean(messages),
                "records": row["records"],
                "answer": row["answer"],
                "mistake_turns": [i for i, m in enumerate(turns) if m.get("mistake")],
            }
        )
    return out


class MistakeMasking:
    """Wraps a ``ChatMLCollator`` built with ``assistant_turns="all"``: the batch it collates, with the labels of
    each row's injected miscopies (its ``mistake_turns``, indices among its assistant messages) set to -100, so the
    teacher learns to retry after an error without learning to miscopy. Returns the batch from ``__call__``."""

    def __init__(self, collator: Any) -> None:
        if getattr(collator, "assistant_turns", None) != "all":
            raise ValueError("MistakeMasking needs a collator with assistant_turns='all' (every turn labelled).")
        self.collator = collator

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collator, name)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        from lightning_gkd.data.chat_tokens import tokenize_chat
        from lightning_gkd.ops.constants import IGNORE_INDEX

        batch = self.collator(rows)
        labels = batch["labels"]
        for i, row in enumerate(rows):
            if not row.get("mistake_turns"):
                continue
            chat = tokenize_chat(
                self.collator.tokenizer,
                row["messages"],
                self.collator.max_length,
                assistant_turns="all",
                truncate_prompts=self.collator.truncate_prompts,
                tools=self.collator.tools,
            )
            offset = labels.shape[1] - len(chat.ids)  # rows are left-padded
            for turn in row["mistake_turns"]:
                start, end = chat.earlier_turns[turn]  # a miscopy is never the last turn
                labels[i, offset + start : offset + end] = IGNORE_INDEX
        return batch


#: How a transcript of this task ends, in the order ``failure_kind`` checks them; the first two are successes.
OUTCOMES = (
    "correct",
    "correct after an error",
    "error not recovered",
    "malformed call",
    "wrong answer",
    "not stopping",
)
#: The outcomes that count as a success (the final answer is right).
SUCCESSES = ("correct", "correct after an error")


def failure_kind(messages: Sequence[Mapping[str, Any]], row: Mapping[str, Any]) -> str:
    """How a transcript of this task ended (one of ``OUTCOMES``): the right number with every call succeeding
    (*correct*) or after at least one call that failed (*correct after an error*: a recovery); else a transcript with
    a call that does not parse, names another tool or other arguments (*malformed call*), one whose calls were well
    formed but a lookup failed (a miscopied key) and it never got to the number (*error not recovered*), one that
    ends on a call (*not stopping*: the iteration or token cap), or a wrong final answer with every call succeeding
    (*wrong answer*: the number misread)."""
    from lightning_gkd.rollouts.parsers import HermesToolCallParser

    records = json.loads(row["records"])
    parser = HermesToolCallParser()
    errors = malformed = False
    assistant = [str(m["content"]) for m in messages if m["role"] == "assistant"]
    for content in assistant:
        for call in parser.parse(content):
            if call.error is not None or call.name != "lookup" or set(call.arguments) != {"key"}:
                malformed = True
            elif call.arguments["key"] not in records:
                errors = True
    final = assistant[-1] if assistant else ""
    ended_on_call = bool(parser.parse(final)) or not assistant
    if not ended_on_call and final.strip() == row["answer"]:
        return "correct" if not (errors or malformed) else "correct after an error"
    if malformed:
        return "malformed call"
    if errors:
        return "error not recovered"
    return "not stopping" if ended_on_call else "wrong answer"


#: How the task is rolled out and scored: tool replies per transcript (two reads and up to two retries), tokens a
#: turn, tokens a transcript.
MAX_TOOL_CALLING_ITERATIONS, MAX_NEW_TOKENS, MAX_TRANSCRIPT_TOKENS = 4, 24, 208


def task_rollout(tokenizer: Any) -> Any:
    """The ``MultiTurnRollout`` this task is trained and scored with (``lookup``, the row's ``records``, its caps)."""
    return task_rollout_for(
        tokenizer,
        tools=TOOLS,
        state_columns=STATE_COLUMNS,
        max_tool_calling_iterations=MAX_TOOL_CALLING_ITERATIONS,
        max_transcript_tokens=MAX_TRANSCRIPT_TOKENS,
    )
