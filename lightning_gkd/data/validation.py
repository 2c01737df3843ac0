"""Checks on chat rows, run once before training so a bad row fails early with its index and field."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_gkd.data.images import IMAGE_PART_TYPES, check_image_source, image_sources, row_has_images

CHAT_ROLES = ("system", "user", "assistant", "tool")


def validate_chat_rows(
    rows: Sequence[Mapping[str, Any]], *, name: str = "train_data", images_allowed: bool = False
) -> None:
    """Raise ``ValueError`` naming the first bad row: not a mapping, no ``messages`` list, a message without a
    known ``role`` or with content that is neither a string nor a list of text/image parts; or an empty dataset.
    A row with an image is an error unless ``images_allowed`` (a processor collates the rows); with it, every
    image must resolve (an existing file, or a PIL image / bytes; ``data.images.check_image_source``)."""
    if len(rows) == 0:
        raise ValueError(f"{name} is empty: it has no rows. Point it at a dataset with at least one row.")
    for index in range(len(rows)):
        validate_chat_row(rows[index], index=index, name=name)
        row = rows[index]
        if not row_has_images(row):
            continue
        if not images_allowed:
            raise ValueError(
                f"{name} row {index} holds an image, but the data is collated by a text-only tokenizer. Train a "
                "vision-language student with its processor (ChatDataModule(processor=...); Hydra: a student folder "
                "with a processor, or data.processor=<folder>), or drop the image parts."
            )
        try:
            for source in image_sources(row):
                check_image_source(source)
        except ValueError as error:
            raise ValueError(f"{name} row {index}: {error}") from None


def validate_chat_row(row: Any, *, index: int, name: str = "train_data") -> None:
    where = f"{name} row {index}"
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a dict with a 'messages' field, got {type(row).__name__}.")
    messages = row.get("messages")
    if messages is None:
        if looks_like_preference(row):
            raise ValueError(preference_rows_error(where))
        present = sorted(key for key, value in row.items() if value is not None)  # Arrow rows hold nulls
        raise ValueError(
            f"{where}: missing field 'messages' (fields present: {present}). Each row needs 'messages' (a list of "
            "{'role', 'content'} dicts) or 'prompt' (and 'completion'), each a string or a list of messages; "
            "convert other fields with formatting_func (Hydra: data.formatting_func=my_module.to_messages)."
        )
    if isinstance(messages, str):
        raise ValueError(
            f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} dicts, got a string: "
            f"{messages!r:.60}. A CSV cell holds only text: store message lists in a .jsonl/.json/.parquet file, or "
            "give 'prompt' and 'completion' columns."
        )
    check_messages(messages, f"{where}: 'messages'", turns=f"{where}: messages")


def looks_like_preference(row: Mapping[str, Any]) -> bool:
    """A row with ``chosen`` and ``rejected`` (text, messages or token ids) and no ``messages``: a preference pair."""
    return row.get("messages") is None and any(
        row.get(f"chosen{suffix}") is not None and row.get(f"rejected{suffix}") is not None
        for suffix in ("", "_input_ids")
    )


def preference_rows_error(where: str) -> str:
    return (
        f"{where} has 'chosen' and 'rejected' fields: these look like preference rows, which chat data does not "
        "train on. Train on them with DPO: `method=dpo data=preference_files` (Python: PreferenceDataModule with "
        "DPOModule); for chat data give 'messages', or 'prompt' and 'completion'."
    )


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
        if isinstance(content, str):
            continue
        if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
            check_content_parts(content, field)
            continue
        kind = type(content).__name__
        detail = "is missing 'content'" if content is None else f"has non-string content of type {kind}"
        raise ValueError(f"{field} {detail}; content must be a string or a list of text and image parts.")


def check_content_parts(parts: Sequence[Any], field: str) -> None:
    """A message's list content: ``{"type": "text", "text": str}`` and ``{"type": "image", ...}`` parts (the
    transformers multimodal chat format), else ValueError naming the part."""
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind in IMAGE_PART_TYPES:
            continue
        raise ValueError(
            f"{field}['content'][{index}] is {part!r:.80}; a content part is {{'type': 'text', 'text': str}} or "
            "{'type': 'image', ...} (the image under 'image', 'path' or 'url', or in the row's 'images' column)."
        )


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


def whole_prompt_truncated(max_length: int, num_completion: int) -> str:
    """The error text for a row whose completion alone fills ``max_length``: truncation keeps no prompt token."""
    return (
        f"max_length={max_length} truncates away the whole prompt: the completion alone has {num_completion} "
        "tokens. Raise max_length (Hydra: data.max_length) or shorten the completion."
    )


def prompt_start(row: Any, width: int = 60) -> str:
    """The first ``width`` characters of a row's prompt as a user wrote it (the first message's content for
    ``messages`` or a message-list ``prompt``, the ``prompt`` string itself), for error messages; '' if none."""
    if not isinstance(row, Mapping):
        return ""
    prompt = row.get("messages") if row.get("messages") is not None else row.get("prompt")
    if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)) and prompt:
        prompt = prompt[0].get("content") if isinstance(prompt[0], Mapping) else None
    return prompt[:width] if isinstance(prompt, str) else ""


def prompt_cut(max_length: int, num_prompt: int, num_completion: int, start: str) -> str:
    """The error text for one row whose prompt would lose its beginning (the collators' check of a row that setup
    did not sample)."""
    return (
        f"max_length={max_length} cuts the beginning off this row's prompt ({num_prompt} prompt + {num_completion} "
        f"completion tokens; max_length={num_prompt + num_completion} fits it), so it would train on a prompt "
        f"without its start (prompt starts {start!r}). Setup checks only length_check_rows rows. Raise max_length "
        "(Hydra: data.max_length), shorten the prompt, or set truncate_prompts=True (Hydra: "
        "data.truncate_prompts=true) to train on the prompt's last tokens."
    )


def check_prompt_truncation(
    rows: Sequence[Mapping[str, Any]],
    lengths: Callable[[Mapping[str, Any]], tuple[int, int]],
    *,
    name: str,
    max_length: int,
    truncate_prompts: bool,
    max_rows: int | None,
) -> None:
    """Check that ``max_length`` keeps every prompt whole, on up to ``max_rows`` rows spread evenly (all when None).

    ``lengths(row)`` gives a row's untruncated ``(prompt_tokens, completion_tokens)`` (a ``ValueError`` it raises is
    re-raised naming the row). Truncation keeps the last ``max_length`` tokens, so a row with
    ``prompt + completion > max_length`` loses the beginning of its prompt. Raises ``ValueError`` naming the first row
    whose completion alone fills ``max_length`` (no prompt token would remain), whatever ``truncate_prompts``; then,
    when some checked rows lose the beginning of their prompt, raises with their count, the first one and the
    ``max_length`` that fits every checked row, or with ``truncate_prompts`` only warns with the count.
    """
    indices = evenly_spaced(len(rows), max_rows)
    cut: list[tuple[int, int, int]] = []  # (row, prompt tokens, completion tokens)
    needed = 0
    for index in indices:
        row = rows[index]
        try:
            num_prompt, num_completion = lengths(row)
        except ValueError as error:
            raise ValueError(f"{name} row {index}: {error}") from None
        total = num_prompt + num_completion
        needed = max(needed, total)
        if total <= max_length:
            continue
        if num_completion >= max_length:
            raise ValueError(
                f"{name} row {index}: {whole_prompt_truncated(max_length, num_completion)} "
                f"Prompt starts {prompt_start(row)!r}."
            )
        cut.append((index, num_prompt, num_completion))
    if not cut:
        return
    index, num_prompt, num_completion = cut[0]
    checked = f"{len(cut)} of {len(indices)} checked rows"
    sample = len(indices) < len(rows)
    if sample:
        checked += f" (a sample of the {len(rows)} rows: length_check_rows={max_rows})"
    fits = f"max_length={needed} fits every checked row" + (" (rows not checked may need more)" if sample else "")
    if truncate_prompts:
        rank_zero_warn(
            f"{name}: max_length={max_length} cuts the beginning off the prompt of {checked}, first row {index} "
            f"({num_prompt} prompt + {num_completion} completion tokens); truncate_prompts=True, so they train on "
            f"their prompts' last tokens. {fits}."
        )
        return
    raise ValueError(
        f"{name}: max_length={max_length} cuts the beginning off the prompt of {checked}, so they would train on "
        f"prompts without their start. First: row {index}, {num_prompt} prompt + {num_completion} completion "
        f"tokens, prompt starts {prompt_start(rows[index])!r}. {fits}: raise max_length (Hydra: "
        f"data.max_length={needed}), shorten those prompts, or set truncate_prompts=True (Hydra: "
        "data.truncate_prompts=true) to train on the prompts' last tokens."
    )
