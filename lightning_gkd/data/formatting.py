"""``formatting_func``: a user function that turns each raw row into a chat row, applied lazily per row."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

from lightning_gkd.data.validation import looks_like_preference, preference_rows_error

FormattingFunc: TypeAlias = Callable[[Mapping[str, Any]], Any]
#: What a user may pass: the function itself, or a dotted path to it ("my_pkg.data.to_messages").
FormattingFuncSpec: TypeAlias = FormattingFunc | str


def resolve_formatting_func(spec: FormattingFuncSpec | None) -> FormattingFunc | None:
    """The callable for ``spec``: a callable as is (e.g. Hydra's ``_partial_: true`` result), a dotted path string
    resolved with ``hydra.utils.get_method``; None stays None."""
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str):
        from hydra.utils import get_method

        try:
            return get_method(spec)
        except Exception as error:  # hydra raises ImportError/ValueError variants
            raise ValueError(
                f"formatting_func={spec!r} cannot be imported ({error}). Give the dotted path of a "
                "function importable from where you run, e.g. 'my_package.data.to_messages' "
                "(Hydra: data.formatting_func=my_package.data.to_messages)."
            ) from None
    raise TypeError(f"formatting_func must be a callable or a dotted path string, got {type(spec).__name__}.")


def to_chat_row(value: Any, *, index: int, name: str) -> dict[str, Any]:
    """What a formatting function returned, or a native prompt/completion row -> a row with ``messages``.

    Accepted: a mapping with ``messages``; a mapping with ``prompt`` (and optionally ``completion``), each a
    string (prompt -> a user turn, completion -> an assistant turn) or a list of messages; a list of messages.
    Null fields (an Arrow column a row does not use) count as absent. A mapping with ``chosen`` and ``rejected``
    is a preference row: ``ValueError`` pointing to DPO.
    """
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return {"messages": list(value)}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} row {index}: formatting_func returned {type(value).__name__}; it must return a "
            "dict with 'messages' (a list of {'role', 'content'} dicts), a dict with 'prompt' and "
            "'completion', or a list of messages."
        )
    if value.get("messages") is not None:
        return dict(value)
    if looks_like_preference(value):
        raise ValueError(preference_rows_error(f"{name} row {index}"))
    if value.get("prompt") is not None:
        messages = _turns(value["prompt"], "user", f"{name} row {index}: 'prompt'")
        if value.get("completion") is not None:
            messages += _turns(value["completion"], "assistant", f"{name} row {index}: 'completion'")
        rest = {k: v for k, v in value.items() if k not in ("prompt", "completion")}
        return {**rest, "messages": messages}
    present = sorted(key for key, field in value.items() if field is not None)
    raise ValueError(
        f"{name} row {index}: formatting_func returned a dict with keys {present}; it needs "
        "'messages', or 'prompt' (and 'completion')."
    )


def _turns(part: Any, role: str, field: str) -> list[Any]:
    if isinstance(part, str):
        return [{"role": role, "content": part}]
    if isinstance(part, Sequence) and not isinstance(part, bytes):
        return list(part)
    raise ValueError(f"{field} must be a string or a list of {{'role', 'content'}} dicts, got {type(part).__name__}.")


def is_native_prompt_row(row: Any) -> bool:
    """A raw row to convert without a formatting_func: no ``messages``, but a ``prompt`` (TRL's prompt/completion
    and prompt-only formats) or ``chosen``/``rejected`` (a preference row, refused with a pointer to DPO)."""
    return isinstance(row, Mapping) and (
        row.get("messages") is None and (row.get("prompt") is not None or looks_like_preference(row))
    )


def has_prompt_rows(rows: Sequence[Any]) -> bool:
    """Whether some rows need ``is_native_prompt_row``'s conversion: for a ``datasets.Dataset`` by its columns (no
    row is read), for a list by its rows."""
    columns = getattr(rows, "column_names", None)
    if columns is not None:
        return "prompt" in columns or {"chosen", "rejected"} <= set(columns)
    return any(is_native_prompt_row(row) for row in rows)


class FormattedRows(Sequence):
    """A read-only view of ``rows`` with ``formatting_func`` applied to each row when it is read: nothing is
    copied or precomputed, so a large ``datasets.Dataset`` stays memory-mapped. With ``formatting_func=None`` the
    rows are native: a ``prompt`` (and ``completion``) row is converted by ``to_chat_row``, others read as they
    are."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        formatting_func: FormattingFunc | None,
        *,
        name: str = "train_data",
    ) -> None:
        self.rows, self.formatting_func, self.name = rows, formatting_func, name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Mapping[str, Any]:  # type: ignore[override]  # rows only: slices raise below
        if isinstance(index, slice):
            raise TypeError("FormattedRows is indexed by row number only.")
        if index < 0:
            index += len(self.rows)
        if not 0 <= index < len(self.rows):
            raise IndexError(index)
        row = self.rows[index]
        if self.formatting_func is not None:
            return to_chat_row(self.formatting_func(row), index=index, name=self.name)
        return to_chat_row(row, index=index, name=self.name) if is_native_prompt_row(row) else row

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        for index in range(len(self.rows)):
            yield self[index]


def chat_rows(
    rows: Sequence[Mapping[str, Any]], formatting_func: FormattingFunc | None, *, name: str
) -> Sequence[Mapping[str, Any]]:
    """``rows`` as chat rows: through ``formatting_func`` when given, else with native prompt/completion rows
    converted (both lazily, ``FormattedRows``); rows that all have ``messages`` are returned as they are."""
    if formatting_func is not None or has_prompt_rows(rows):
        return FormattedRows(rows, formatting_func, name=name)
    return rows
