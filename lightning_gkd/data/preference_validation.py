"""Checks on preference rows, run once before training so a bad row fails early with its index and field."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_warn

from lightning_gkd.data.images import check_image_source, image_parts, image_sources
from lightning_gkd.data.validation import check_messages

PairFormat = Literal["conversational", "text", "tokenized"]
TEXT_FIELDS = ("prompt", "chosen", "rejected")
TOKEN_FIELDS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
REF_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")

_ROW_HELP = (
    "Each row needs 'prompt', 'chosen' and 'rejected', either all plain strings or lists of "
    "{'role', 'content'} messages (chosen/rejected: one assistant message), or pre-tokenized "
    "'prompt_input_ids', 'chosen_input_ids' and 'rejected_input_ids'."
)


def pair_format(row: Mapping[str, Any]) -> PairFormat:
    """Which of the three accepted row formats ``row`` uses (pre-tokenized ids win over text fields)."""
    if all(field in row for field in TOKEN_FIELDS):
        return "tokenized"
    return (
        "conversational"
        if isinstance(row.get("prompt"), Sequence) and not isinstance(row.get("prompt"), str)
        else "text"
    )


def validate_preference_rows(
    rows: Sequence[Mapping[str, Any]], *, name: str = "train_data", images_allowed: bool = False
) -> set[PairFormat]:
    """Raise ``ValueError`` naming the first bad row; return the formats found.

    Bad: not a mapping; a missing field; text fields that mix strings and message lists; an empty completion
    (``""``, no message, empty content, no token ids); messages with an unknown role or content that is neither a
    string nor text/image parts; chosen/rejected that are not a single assistant message; only one of the two
    reference log-probs. Images (image parts of the prompt's messages, or TRL's ``images`` column) are bad unless
    ``images_allowed`` (a vision-language processor collates the pairs); with it, every image must resolve (an
    existing file, or a PIL image / bytes: ``data.images.check_image_source``), and completions hold none.
    Warns (once) about rows whose chosen and rejected completions are identical: they teach nothing.
    """
    if len(rows) == 0:
        raise ValueError(f"{name} is empty: it has no rows. Point it at a dataset with at least one row.")
    formats: set[PairFormat] = set()
    identical: list[int] = []
    for index in range(len(rows)):
        row = rows[index]
        kind = validate_preference_row(row, index=index, name=name, images_allowed=images_allowed)
        formats.add(kind)
        if _identical_sides(row, kind):
            identical.append(index)
    if identical:
        shown = ", ".join(str(i) for i in identical[:5]) + (", ..." if len(identical) > 5 else "")
        rank_zero_warn(
            f"{name}: {len(identical)} of {len(rows)} rows have chosen == rejected (rows {shown}). "
            "Such a pair has zero preference margin and gives no learning signal; drop those rows or "
            "fix their rejected completion."
        )
    return formats


def validate_preference_row(
    row: Any, *, index: int, name: str = "train_data", images_allowed: bool = False
) -> PairFormat:
    where = f"{name} row {index}"
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a dict, got {type(row).__name__}. {_ROW_HELP}")
    present = [field for field in REF_FIELDS if row.get(field) is not None]
    if len(present) == 1:
        raise ValueError(f"{where}: has {present[0]!r} but not its partner; give both {REF_FIELDS} or neither.")
    kind = pair_format(row)
    if kind == "tokenized":
        for field in TOKEN_FIELDS:
            ids = row[field]
            if (
                isinstance(ids, (str, bytes))
                or not isinstance(ids, Sequence)
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            ):
                raise ValueError(f"{where}: {field!r} must be a list of token ids (ints), got {ids!r:.80}.")
            if len(ids) == 0:
                raise ValueError(
                    f"{where}: {field!r} is empty; every pair needs a non-empty prompt, chosen and rejected."
                )
        return kind
    missing = [field for field in TEXT_FIELDS if row.get(field) is None]
    if missing:
        if "prompt" in missing and row.get("messages") is not None:
            raise ValueError(
                f"{where}: missing field 'prompt' (fields present: {sorted(row)}); the row looks like a chat row "
                "('messages'): DPO needs prompt/chosen/rejected pairs; for chat data use method=gkd or method=sft "
                "with data=chat_files."
            )
        raise ValueError(f"{where}: missing field {missing[0]!r} (fields present: {sorted(row)}). {_ROW_HELP}")
    if kind == "text":
        if row.get("images"):
            raise ValueError(
                f"{where}: has an 'images' column but a plain-string prompt: images go in a conversational prompt "
                "(a list of messages whose content holds a {'type': 'image'} part where each image goes)."
            )
        for field in TEXT_FIELDS:
            value = row[field]
            if not isinstance(value, str):
                raise ValueError(
                    f"{where}: 'prompt' is a string, so {field!r} must be one too, got "
                    f"{type(value).__name__}. {_ROW_HELP}"
                )
            if value == "" and field != "prompt":
                raise ValueError(
                    f"{where}: {field!r} is an empty completion; every pair needs a non-empty chosen "
                    "and rejected completion. Drop or fix this row."
                )
        return kind
    check_messages(row["prompt"], f"{where}: 'prompt'")
    if image_parts(row["prompt"]) or row.get("images"):
        _check_prompt_images(row, where, images_allowed)
    for field in ("chosen", "rejected"):
        value = row[field]
        if isinstance(value, str):
            raise ValueError(
                f"{where}: 'prompt' is a list of messages, so {field!r} must be one too "
                f"([{{'role': 'assistant', 'content': ...}}]), got a string. {_ROW_HELP}"
            )
        check_messages(value, f"{where}: {field!r}")
        if len(value) != 1 or value[0]["role"] != "assistant":
            raise ValueError(
                f"{where}: {field!r} must be exactly one assistant message, got roles {[m['role'] for m in value]}."
            )
        if image_parts(value):
            raise ValueError(
                f"{where}: {field!r} holds an image; a completion is text the policy writes, and images go in the "
                "prompt's messages."
            )
        if value[0]["content"] == "":
            raise ValueError(
                f"{where}: {field!r} is an empty completion (the assistant content is ''); every pair "
                "needs a non-empty chosen and rejected completion. Drop or fix this row."
            )
    return kind


def _check_prompt_images(row: Mapping[str, Any], where: str, images_allowed: bool) -> None:
    """ValueError unless the prompt's images may be collated (``images_allowed``) and each one resolves."""
    if not images_allowed:
        raise ValueError(
            f"{where}: its prompt holds an image, but the pairs are collated by a text-only tokenizer. Train a "
            "vision-language policy with its processor (PreferenceDataModule(processor=...); Hydra: a policy folder "
            "with a processor, or data.processor=<folder>), or drop the image parts."
        )
    try:
        for source in image_sources({"messages": row["prompt"], "images": row.get("images")}):
            check_image_source(source)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _identical_sides(row: Mapping[str, Any], kind: PairFormat) -> bool:
    if kind == "tokenized":
        return list(row["chosen_input_ids"]) == list(row["rejected_input_ids"])
    return row["chosen"] == row["rejected"]
