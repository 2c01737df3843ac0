"""A teacher cache's ``manifest.json`` (its keys: ``teachers.offline.format``): read, written whole, checked complete,
and the ``lightning-gkd-cache`` commands that build, resume or rebuild the cache it describes, for errors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_gkd.teachers.offline.atomic import write_atomically
from lightning_gkd.teachers.offline.format import (
    BUILD_COMMAND,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    manifest_signal,
)
from lightning_gkd.teachers.offline.shards import shard_name


def new_manifest(settings: Mapping[str, Any], status: str, **stats: Any) -> dict[str, Any]:
    """The manifest of a cache built with ``settings``: "building" (no ``stats`` yet), or "complete" with them."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "status": status, **settings, **stats}


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The manifest of the cache in ``folder``, or None when it has none."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a teacher cache manifest (format {manifest.get('format')!r}).")
    return manifest


def write_manifest(folder: str | Path, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` atomically (``write_atomically``)."""
    text = json.dumps(manifest, indent=2) + "\n"
    write_atomically(Path(folder) / MANIFEST_NAME, lambda tmp: tmp.write_text(text))


def signal_flags(manifest: Mapping[str, Any]) -> str:
    """The ``lightning-gkd-cache`` keys that choose what ``manifest``'s cache holds."""
    if manifest_signal(manifest) == "hidden":
        return f"cache.signal=hidden cache.hidden_dtype={manifest['hidden_dtype']}"
    return f"cache.top_k={manifest['k']}"


def resume_hint(folder: str | Path, manifest: Mapping[str, Any] | None = None) -> str:
    """The command that builds (or resumes) the cache in ``folder``."""
    python = "or lightning_gkd.teachers.offline.build.build_teacher_cache(..., path=...)"
    if manifest is None:
        return f"`{BUILD_COMMAND} cache.path={folder}` with the model=/data= settings of the training run, {python}"
    return (
        f"`{BUILD_COMMAND} cache.path={folder} {signal_flags(manifest)}` with the model=/data= settings it was "
        f"started with (teacher {manifest['teacher']['name_or_path']}), {python}"
    )


def rebuild_hint(manifest: Mapping[str, Any]) -> str:
    """The command that builds a new cache like the one ``manifest`` describes, for this run's data."""
    return f"`{BUILD_COMMAND} cache.path=<a new folder> {signal_flags(manifest)}` with this run's model=/data= settings"


def missing_shards(folder: Path, manifest: Mapping[str, Any]) -> list[str]:
    return [shard_name(s) for s in range(int(manifest["num_shards"])) if not (folder / shard_name(s)).is_file()]


def load_complete_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a complete cache; an error naming the folder and the build/resume command otherwise."""
    folder = Path(folder).expanduser()
    manifest = read_manifest(folder) if folder.is_dir() else None
    if manifest is None:
        raise FileNotFoundError(
            f"No teacher cache at {folder} (no {MANIFEST_NAME}). Build it with {resume_hint(folder)}."
        )
    missing = missing_shards(folder, manifest)
    if manifest.get("status") != "complete" or missing:
        raise RuntimeError(
            f"The teacher cache at {folder} is incomplete ({len(missing)} of {manifest['num_shards']} shards "
            f"missing{', first ' + missing[0] if missing else ''}): its build was stopped. Resume it with "
            f"{resume_hint(folder, manifest)}; shards already written are kept."
        )
    return manifest
