"""What a command was asked to load: a model folder, a hub id or a checkpoint file, checked before anything loads."""

from __future__ import annotations

from pathlib import Path

MODEL_FILES = ("config.json", "adapter_config.json")  # a save_pretrained folder: a model, or a PEFT adapter
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def looks_like_path(value: str) -> bool:
    """A value that can only mean a local path (a hub id is ``name`` or ``owner/name``)."""
    return value.startswith((".", "/", "~")) or value.count("/") > 1 or value.endswith(".ckpt")


def check_model_folder(value: str, option: str) -> Path | None:
    """The model folder ``value`` names (resolved), or None for a hub id (whose reachability ``load_causal_lm``
    checks). ``FileNotFoundError``/``ValueError`` naming ``option`` for a path that is no model folder, with the
    exported model of a run folder as the suggestion."""
    path = Path(value).expanduser()
    if not path.exists():
        if looks_like_path(value):
            raise FileNotFoundError(
                f"{option}: {value!r} does not exist (relative to {Path.cwd()}). Pass a model folder written by "
                "save_pretrained, e.g. the student a lightning-gkd run exported: outputs/runs/<run>/student."
            )
        return None
    if path.is_file():
        raise ValueError(f"{option}: {value!r} is a file; pass the model folder written by save_pretrained.")
    if any((path / name).is_file() for name in MODEL_FILES):
        return path.resolve()
    exported = [path / name for name in ("student", "student_merged") if (path / name / "config.json").is_file()]
    hint = (
        f" It looks like a lightning-gkd run folder; its exported model is {exported[0]}."
        if exported
        else " Pass a folder written by save_pretrained, e.g. outputs/runs/<run>/student."
    )
    raise FileNotFoundError(f"{option}: {value!r} holds no config.json, so it is not a model folder.{hint}")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)
