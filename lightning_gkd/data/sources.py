"""Turn what a user passes as data (a Dataset, a list of dicts, a local file or folder, a hub id) into rows."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets

DataSource: TypeAlias = datasets.Dataset | Sequence[Mapping[str, Any]] | str | os.PathLike

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_rows(source: DataSource, *, split: str = "train", name: str = "train_data") -> Sequence[Mapping[str, Any]]:
    """Return an indexable collection of rows (``datasets.Dataset`` or a list of dicts).

    Accepted: a ``datasets.Dataset``; a ``DatasetDict`` (``split`` is taken); a list of dicts (kept as is);
    a path to a ``.json``/``.jsonl``/``.parquet`` file; a folder written by ``Dataset.save_to_disk``; a folder of
    data files or a hub dataset id, both read with ``datasets.load_dataset(..., split=split)``.
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
        return datasets.load_dataset(_FILE_BUILDERS[suffix], data_files=str(path), split="train")
    if path.is_dir():
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            return load_rows(loaded, split=split, name=name)
        return datasets.load_dataset(str(path), split=split)
    if source.startswith((".", "/", "~")) or suffix:
        raise FileNotFoundError(
            f"{name}: {source!r} is neither an existing file/folder nor a hub dataset id. "
            f"Supported files: {', '.join(sorted(_FILE_BUILDERS))}."
        )
    return datasets.load_dataset(source, split=split)
