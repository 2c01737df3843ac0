"""Checks on chat rows, run once before training so a bad row fails early with its index and field."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
        raise ValueError(f"{where}: missing field 'messages' (fields present: {sorted(row)}). Each row needs "
                         f"'messages': a list of {{'role', 'content'}} dicts.")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {messages!r:.80}.")
    for turn, message in enumerate(messages):
        field = f"{where}: messages[{turn}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{field} must be a dict with 'role' and 'content', got {type(message).__name__}.")
        role = message.get("role")
        if role not in CHAT_ROLES:
            detail = "is missing 'role'" if role is None else f"has unknown role {role!r}"
            raise ValueError(f"{field} {detail}; use one of {', '.join(CHAT_ROLES)}.")
        content = message.get("content")
        if not isinstance(content, str):
            detail = "is missing 'content'" if content is None else (
                f"has non-string content of type {type(content).__name__}")
            raise ValueError(f"{field} {detail}; content must be a string.")
