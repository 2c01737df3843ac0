"""Checkpoint IO: Lightning checkpoints written atomically and read back with weights-only loading
(``SafeCheckpointIO``), folders written atomically, and frozen models kept out of checkpoint state."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch import nn


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read back: missing, truncated, corrupt, or holding pickled Python objects."""


class SafeCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that never unpickles arbitrary objects and never leaves a half-written checkpoint.

    - Loading always uses ``torch.load(weights_only=True)``: tensors, containers and plain Python values only.
      Our checkpoints (weights, optimizer and scheduler states, loop and callback states, hyperparameters, DPO's
      cached reference log-probs) contain nothing else; a file that needs pickle is refused.
    - A local checkpoint is written to a temporary file beside its target and renamed over it, so a run killed
      while saving keeps the previous file intact. Remote paths (``s3://``...) use Lightning's own writer.
    - A missing or unreadable checkpoint raises ``CheckpointError`` naming the file and the other checkpoints in
      its folder to resume from instead.

    Used by ``lightning-gkd`` for every strategy that keeps Lightning's default checkpoint IO; in your own code:
    ``L.Trainer(plugins=[SafeCheckpointIO()])``.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path) or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(staging, "xb") as file:  # (not mkstemp: keep the umask's permissions)
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        require_checkpoint(path)
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)
        except Exception as error:
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if isinstance(error, pickle.UnpicklingError):
                advice = (
                    "It holds Python objects that weights-only loading refuses to unpickle; only load such a "
                    "file if you trust where it came from (and then allow its classes with "
                    "torch.serialization.add_safe_globals)."
                )
            else:
                advice = "The file is truncated or corrupt (e.g. an interrupted copy or write)."
            raise CheckpointError(
                f"Cannot load checkpoint {str(path)!r} ({reason}). {advice}{_alternatives(path)}"
            ) from error


def require_checkpoint(path: _PATH) -> None:
    """Raise ``CheckpointError`` when a local checkpoint ``path`` does not exist, naming others to use instead."""
    if "://" not in str(path) and not Path(path).exists():
        raise CheckpointError(f"Checkpoint {str(path)!r} does not exist.{_alternatives(path)}")


def _alternatives(path: _PATH) -> str:
    folder = Path(path).parent
    others = (
        sorted(
            (p for p in folder.glob("*.ckpt") if p.resolve() != Path(path).resolve()),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        if folder.is_dir()
        else []
    )
    if not others:
        return " Start without ckpt_path, or point ckpt_path at another checkpoint."
    older = f" (others there: {', '.join(p.name for p in others[1:4])})" if len(others) > 1 else ""
    return f" Resume from the newest other checkpoint in its folder instead: ckpt_path={others[0]}{older}."


def use_safe_checkpoint_io(trainer: L.Trainer) -> bool:
    """Give ``trainer`` a ``SafeCheckpointIO`` when its strategy uses Lightning's plain ``TorchCheckpointIO``
    (sharded strategies that write their own checkpoint formats are left alone). True when installed."""
    if type(trainer.strategy.checkpoint_io) is not TorchCheckpointIO:
        return isinstance(trainer.strategy.checkpoint_io, SafeCheckpointIO)
    trainer.strategy.checkpoint_io = SafeCheckpointIO()
    return True


def resume_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where a callback that stops a fit saves the checkpoint to resume from (``ckpt_path=last`` finds it):
    ``last.ckpt`` in the ``ModelCheckpoint``'s folder, else in ``<default_root_dir>/checkpoints``."""
    folder = getattr(trainer.checkpoint_callback, "dirpath", None) or Path(trainer.default_root_dir) / "checkpoints"
    return Path(folder) / "last.ckpt"


def inside_accumulation_window(trainer: L.Trainer) -> bool:
    """Whether the fit stands between micro-batches of one optimizer step (``accumulate_grad_batches``): a checkpoint
    saved there would drop the accumulated gradients, so a callback that stops the fit saves none."""
    processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
    return bool(processed % trainer.accumulate_grad_batches)


def current_umask() -> int:
    """The process's file-mode creation mask (reading it means setting it: set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_folder_atomically(target: str | Path, write: Callable[[Path], None], *, replace: bool = True) -> Path:
    """``write(staging)`` fills a new folder beside ``target``, which is then renamed into place, so no reader ever
    sees a half-written folder. ``replace=True``: an existing ``target`` is swapped out only once the new one is
    complete. ``replace=False``: if ``target`` appears meanwhile (another process finished first), it is kept and
    the new copy dropped. Returns ``target`` resolved."""
    target = Path(target).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o777 & ~current_umask())  # mkdtemp makes it 0700: readable by its owner only on shared clusters
    try:
        write(staging)
        if replace and target.exists():
            old = target.with_name(f".{target.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                staging.rename(target)
            except OSError:
                if replace or not target.exists():
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def drop_frozen_state(state: dict[str, Any], frozen_names: Iterable[str], prefix: str = "") -> None:
    """Remove the frozen models' entries (``<prefix><name>.*``) from a module state dict: checkpoints never hold
    them."""
    prefixes = tuple(f"{prefix}{name}." for name in frozen_names)
    if prefixes:
        for key in [k for k in state if k.startswith(prefixes)]:
            del state[key]


def fill_frozen_state(state: dict[str, Any], frozen: Mapping[str, nn.Module], prefix: str = "") -> None:
    """Add the live frozen models' weights to a state dict being loaded, so loading stays strict for the rest."""
    for name, model in frozen.items():
        for key, value in model.state_dict().items():
            state.setdefault(f"{prefix}{name}.{key}", value)
