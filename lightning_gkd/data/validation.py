"""Checks on chat rows, run once before training so a bad row fails early with its index and field."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool")


def validate_chat_rows(rows: Sequence[Mapping[str, Any]], *, name: str = "train_data") -> None:
    """Raise ``ValueError`` naming the first bad row: not a mapping, no ``messages`` list, a message without a
    known ``role`` or with non-string ``content``; or an empty dataset."""
    if len(rows) == 0:
        raise ValueError(f"{name} is empty: it has no rows. Point it at a dataset with at least one row.")
    for index in range(len(rows)):
        validate_chat_row(rows[index], index=index, name=name)


def validate_chat_row(row: Any, *, index: int, name: str = "train_data") -> None:
    where = f"{name} row {index}"
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a dict with a 'messages' field, got {type(row).__name__}.")
    messages = row.get("messages")
    if messages is None:
        raise ValueError(
            f"{where}: missing field 'messages' (fields present: {sorted(row)}). Each row needs "
            f"'messages': a list of {{'role', 'content'}} dicts."
        )
    check_messages(messages, f"{where}: 'messages'", turns=f"{where}: messages")


def check_messages(messages: Any, name: str, *, turns: str | None = None) -> None:
    """A non-empty list of ``{"role", "content"}`` dicts with known roles and string contents, else ValueError.
    ``name`` names the whole list in errors (``train_data row 3: 'messages'``), ``turns`` the prefix of one turn
    (``train_data row 3: messages`` -> ``...messages[0]``; default ``name``)."""
    turns = name if turns is None else turns
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise ValueError(f"{name} must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}.")
    for turn, message in enumerate(messages):
        field = f"{turns}[{turn}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{field} must be a dict with 'role' and 'content', got {type(message).__name__}.")
        role = message.get("role")
        if role not in CHAT_ROLES:
            detail = "is missing 'role'" if role is None else f"has unknown role {role!r}"
            raise ValueError(f"{field} {detail}; use one of {', '.join(CHAT_ROLES)}.")
        content = message.get("content")
        if not isinstance(content, str):
            detail = (
                "is missing 'content'"
                if content is None
                else f"has non-string content of type {type(content).__name__}"
            )
            raise ValueError(f"{field} {detail}; content must be a string.")


def rows_without_completion(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indices of validated chat rows whose last message is not the assistant's (prompt-only rows)."""
    return [index for index in range(len(rows)) if rows[index]["messages"][-1]["role"] != "assistant"]


def check_completions(rows: Sequence[Mapping[str, Any]], *, name: str, reason: str) -> None:
    """Raise ``ValueError`` naming the first row without an assistant completion. ``reason`` says why the run
    needs dataset completions (and how to do without them)."""
    missing = rows_without_completion(rows)
    if not missing:
        return
    first = missing[0]
    role = rows[first]["messages"][-1]["role"]
    shown = ", ".join(str(i) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
    raise ValueError(
        f"{name} row {first}: the last message is from {role!r}, not 'assistant', so the row has no "
        f"completion to train on ({len(missing)} of {len(rows)} rows have none: {shown}). {reason}"
    )


def evenly_spaced(count: int, limit: int | None) -> range:
    """At most ``limit`` indices spread over ``range(count)`` (all of them when ``limit`` is None)."""
    if limit is None or count <= limit:
        return range(count)
    return range(0, count, -(-count // limit))


def check_rows_tokenize(
    rows: Sequence[Mapping[str, Any]],
    tokenize: Callable[[Mapping[str, Any]], object],
    *,
    name: str,
    max_rows: int | None = 1000,
) -> None:
    """Run ``tokenize`` (what the collator does with a row) on up to ``max_rows`` validated rows spread evenly
    over ``rows`` (all when None), raising ``ValueError`` naming the first row it rejects: e.g. its prompt would
    be truncated away by ``max_length``, or the chat template cannot be split into prompt and completion."""
    for index in evenly_spaced(len(rows), max_rows):
        try:
            tokenize(rows[index])
        except ValueError as error:
            raise ValueError(f"{name} row {index}: {error}") from None
