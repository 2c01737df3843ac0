"""Turn what a user passes as data (a Dataset, a list of dicts, a local file or folder, a hub id) into rows."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets

DataSource: TypeAlias = datasets.Dataset | Sequence[Mapping[str, Any]] | str | os.PathLike

#: Local data files by suffix: (the ``datasets`` builder, its options, what the file must hold).
_FILE_BUILDERS: dict[str, tuple[str, dict[str, Any], str]] = {
    ".jsonl": ("json", {}, 'JSON Lines: one JSON object per line, e.g. {"messages": [...]}'),
    ".json": ("json", {}, 'a JSON list of objects (or JSON Lines), e.g. [{"messages": [...]}]'),
    ".parquet": ("parquet", {}, "a Parquet table with a messages (or prompt/completion) column"),
    ".arrow": ("arrow", {}, "an Arrow stream as Dataset.save_to_disk writes (or pass its folder)"),
    ".csv": ("csv", {}, "a header line then rows of text columns, e.g. prompt,completion"),
    ".tsv": ("csv", {"sep": "\t"}, "a header line then tab-separated rows of text columns, e.g. prompt, completion"),
}
_SUPPORTED = ", ".join(_FILE_BUILDERS)


def load_rows(source: DataSource, *, split: str = "train", name: str = "train_data") -> Sequence[Mapping[str, Any]]:
    """Return an indexable collection of rows (``datasets.Dataset`` or a list of dicts).

    Accepted: a ``datasets.Dataset``; a ``DatasetDict`` (``split`` is taken); a list of dicts (kept as is);
    a path to a ``.jsonl``/``.json``/``.parquet``/``.arrow`` file or a ``.csv``/``.tsv`` file (text columns
    only, e.g. ``prompt`` and ``completion``); a folder written by ``Dataset.save_to_disk``; a folder of data
    files or a hub dataset id, both read with ``datasets.load_dataset(..., split=split)``. A file that is empty,
    unreadable or of another type is a ``ValueError`` naming it.
    """
    if isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise ValueError(
                f"{name}: the DatasetDict has no split {split!r} (it has {sorted(source)}). "
                f"Set the split option to one of those."
            )
        return source[split]
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, (str, os.PathLike)):
        return _load_path_or_hub(str(source), split=split, name=name)
    if isinstance(source, Sequence):
        return list(source)
    raise TypeError(
        f"{name}: expected a datasets.Dataset, a list of dicts, a file path or a hub dataset id, "
        f"got {type(source).__name__}."
    )


def _load_path_or_hub(source: str, *, split: str, name: str) -> datasets.Dataset:
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix in _FILE_BUILDERS:
        if not path.is_file():
            raise FileNotFoundError(f"{name}: data file {source!r} does not exist.")
        return _load_file(path, suffix, name=name)
    if path.is_dir():
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            return load_rows(loaded, split=split, name=name)
        return datasets.load_dataset(str(path), split=split)
    if path.is_file():
        raise ValueError(
            f"{name}: {source!r} is a {suffix or 'suffix-less'} file, which is not a supported data file. Supported: "
            f"{_SUPPORTED} (or a dataset folder). Convert it, e.g. to JSON Lines with one "
            '{"messages": [...]} (or {"prompt": ..., "completion": ...}) object per line.'
        )
    if source.startswith((".", "/", "~")) or suffix:
        raise FileNotFoundError(
            f"{name}: {source!r} is neither an existing file/folder nor a hub dataset id. "
            f"Supported files: {_SUPPORTED}."
        )
    return datasets.load_dataset(source, split=split)


def _load_file(path: Path, suffix: str, *, name: str) -> datasets.Dataset:
    builder, options, holds = _FILE_BUILDERS[suffix]
    empty = ValueError(
        f"{name}: data file '{path}' is empty: it has no rows. Write at least one row into it; a {suffix} file "
        f"holds {holds}."
    )
    if path.stat().st_size == 0:
        raise empty
    if builder == "csv":
        options = {**options, **_text_columns(path, options.get("sep", ","))}
    try:
        rows = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception as error:  # datasets raises bare StopIteration, ValueError, ArrowInvalid, DatasetGenerationError
        if "corresponds to no data" in str(error):  # a blank file, '[]', or a header alone
            raise empty from None
        cause = error
        while cause.__cause__ is not None or cause.__context__ is not None:  # the parser's own words
            cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
        raise ValueError(
            f"{name}: cannot read data file '{path}' as {suffix} ({type(cause).__name__}: {str(cause)[:200]}). "
            f"A {suffix} file holds {holds}; fix the file or convert it to one of {_SUPPORTED}."
        ) from error
    if len(rows) == 0:
        raise empty
    return rows


def _text_columns(path: Path, sep: str) -> dict[str, Any]:
    """CSV options that read every column as text (pandas would read "3" as a number) and only an empty cell as
    null (a prompt-only row's missing completion), not "NA" or "null"."""
    with path.open(newline="", encoding="utf-8") as file:
        header = next(csv.reader(file, delimiter=sep), [])
    return {
        "features": datasets.Features({column: datasets.Value("string") for column in header}),
        "keep_default_na": False,
        "na_values": [""],
    }
