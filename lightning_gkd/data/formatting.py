"""``formatting_func``: a user function that turns each raw row into a chat row, applied lazily per row."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

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
    """What a formatting function returned -> a row with ``messages``.

    Accepted: a mapping with ``messages``; a mapping with ``prompt`` (and optionally ``completion``), each a
    string (prompt -> a user turn, completion -> an assistant turn) or a list of messages; a list of messages.
    """
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return {"messages": list(value)}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} row {index}: formatting_func returned {type(value).__name__}; it must return a "
            "dict with 'messages' (a list of {'role', 'content'} dicts), a dict with 'prompt' and "
            "'completion', or a list of messages."
        )
    if "messages" in value:
        return dict(value)
    if "prompt" in value:
        messages = _turns(value["prompt"], "user")
        if value.get("completion") is not None:
            messages += _turns(value["completion"], "assistant")
        rest = {k: v for k, v in value.items() if k not in ("prompt", "completion")}
        return {**rest, "messages": messages}
    raise ValueError(
        f"{name} row {index}: formatting_func returned a dict with keys {sorted(value)}; it needs "
        "'messages', or 'prompt' (and 'completion')."
    )


def _turns(part: Any, role: str) -> list[Any]:
    if isinstance(part, str):
        return [{"role": role, "content": part}]
    return list(part)


class FormattedRows(Sequence):
    """A read-only view of ``rows`` with ``formatting_func`` applied to each row when it is read: nothing is
    copied or precomputed, so a large ``datasets.Dataset`` stays memory-mapped."""

    def __init__(
        self, rows: Sequence[Mapping[str, Any]], formatting_func: FormattingFunc, *, name: str = "train_data"
    ) -> None:
        self.rows, self.formatting_func, self.name = rows, formatting_func, name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]  # rows only: slices raise below
        if isinstance(index, slice):
            raise TypeError("FormattedRows is indexed by row number only.")
        if index < 0:
            index += len(self.rows)
        if not 0 <= index < len(self.rows):
            raise IndexError(index)
        return to_chat_row(self.formatting_func(self.rows[index]), index=index, name=self.name)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index in range(len(self.rows)):
            yield self[index]
