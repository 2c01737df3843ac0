"""Teachers from config: ``teacher.kind=local|cache|server`` (one teacher) or ``multi`` (rows routed by a column).

A GKD teacher is given as a model source (a folder, a hub id, a spec with ``name_or_path``, an ``nn.Module``: the
in-process model, as before), a built teacher object, or a *teacher spec*, a mapping with ``kind``:

- ``{kind: local, model: <model source>, top_k: null, tokenizer: null}``: the in-process model; ``top_k`` set =
  train on its top-k log-probs with the sparse loss (what a cache or server of it gives), null = full distributions;
  ``tokenizer``: the teacher's tokenizer when it differs from the student's (cross-tokenizer distillation,
  ``lightning_gkd.losses.cross_tokenizer``; null = the model spec's ``tokenizer``, else the one in the model's folder);
- ``{kind: cache, path: <folder>, top_k: null}``: top-k log-probs (or, for a cache built with ``signal=hidden``,
  final hidden states and the head: full distributions) precomputed by ``lightning-gkd-cache``
  (``lightning_gkd.teachers.offline``); no teacher model in memory;
- ``{kind: server, url: ..., model: null, top_k: 20, timeout: 60, concurrency: 4, retries: 4, backoff: 1}``: a vLLM
  OpenAI-compatible server scoring each batch's token ids (``lightning_gkd.teachers.server``); with ``signal: hidden``
  (and ``head: null, dtype: bfloat16``, no ``top_k``) a vLLM pooling server sending the teacher's final hidden
  states, scored with the teacher's head read here (``lightning_gkd.teachers.hidden_server``): full distributions;
- ``{kind: multi, column: teacher, teachers: {<name>: <spec>, ...}}``: each row's ``column`` value names its teacher.

``teacher_plan`` checks a spec (unknown kinds and keys, a bad ``top_k``) before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.models.loading import ModelSource, limit_output_rows, shared_vocab_rows, vocab_size
from lightning_gkd.teachers.base import SparseTeacher, TeacherBase
from lightning_gkd.teachers.hidden import HiddenStateTeacher
from lightning_gkd.teachers.local import LocalTeacher

TEACHER_KINDS = ("local", "cache", "server", "multi")
#: what a served teacher sends: top-k log-probs (a generative server) or final hidden states (a pooling server)
SERVER_SIGNALS = ("topk", "hidden")
#: A distillation ``teacher`` argument: a model source (the in-process model), a teacher spec or a built sparse teacher.
TeacherSource = ModelSource | Mapping[str, Any] | SparseTeacher | HiddenStateTeacher
_KEYS: dict[str, set[str]] = {
    "local": {"model", "top_k", "tokenizer"},
    "cache": {"path", "top_k"},
    "server": {"url", "model", "top_k", "signal", "head", "dtype", "timeout", "concurrency", "retries", "backoff"},
    "multi": {"column", "teachers"},
}


@dataclass(frozen=True)
class TeacherEntry:
    """One teacher of a run: its ``kind``, its settings (the spec without ``kind``), or an object already built."""

    kind: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    built: Any = None

    @property
    def top_k(self) -> int | None:
        return self.settings.get("top_k")

    @property
    def dense(self) -> bool:
        """Whether this teacher gives full distributions: an in-process model without ``top_k``, a server with
        ``signal: hidden``, a cache of hidden states (its manifest says), or a built object with ``hidden_states``
        and no ``topk``."""
        if self.kind == "local":
            return self.top_k is None
        if self.kind == "server":
            return self.settings.get("signal") == "hidden"
        if self.kind == "cache":
            from lightning_gkd.teachers.offline.manifest import read_manifest

            manifest = read_manifest(str(self.settings["path"])) or {}
            return manifest.get("signal") == "hidden"
        return hasattr(self.built, "hidden_states") and not hasattr(self.built, "topk")


@dataclass(frozen=True)
class TeacherPlan:
    """The run's teachers by name (one, named ``""``, unless ``multi``) and the routing column of a ``multi``."""

    entries: dict[str, TeacherEntry]
    column: str | None = None

    @property
    def routed(self) -> bool:
        return self.column is not None

    @property
    def all_dense(self) -> bool:
        return all(entry.dense for entry in self.entries.values())


def is_teacher_spec(teacher: Any) -> bool:
    return isinstance(teacher, Mapping) and "kind" in teacher


def teacher_plan(teacher: Any) -> TeacherPlan:
    """The plan for a GKD ``teacher`` argument (see the module docstring); raises ``ValueError`` naming what is wrong
    in a spec."""
    if not is_teacher_spec(teacher):
        if hasattr(teacher, "topk") and not isinstance(teacher, nn.Module):  # a sparse teacher object
            if not isinstance(teacher, TeacherBase):
                raise TypeError(
                    f"A teacher object must subclass lightning_gkd.teachers.base.TeacherBase (its check, "
                    f"check_datamodule and close do nothing unless overridden), got {type(teacher).__name__}."
                )
            return TeacherPlan({"": TeacherEntry("object", {"top_k": getattr(teacher, "top_k", None)}, teacher)})
        if isinstance(teacher, HiddenStateTeacher):  # a built dense teacher without a model (server, cache)
            return TeacherPlan({"": TeacherEntry("object", {}, teacher)})
        return TeacherPlan({"": TeacherEntry("local", {"model": teacher})})
    kind = _check_spec(teacher, "teacher")
    if kind != "multi":
        return TeacherPlan({"": _entry(teacher, "teacher")})
    teachers = teacher.get("teachers")
    if not isinstance(teachers, Mapping) or not teachers:
        raise ValueError(
            "teacher.kind=multi needs teacher.teachers: a mapping {name: teacher spec} with at least one teacher, "
            f"got {teachers!r}."
        )
    entries: dict[str, TeacherEntry] = {}
    for name, spec in teachers.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"teacher.teachers: names must be non-empty strings, got {name!r}.")
        where = f"teacher.teachers.{name}"
        if is_teacher_spec(spec) and _check_spec(spec, where) == "multi":
            raise ValueError(f"{where}: a multi teacher cannot contain another multi teacher.")
        entries[name] = _entry(spec, where) if is_teacher_spec(spec) else TeacherEntry("local", {"model": spec})
    column = teacher.get("column") or "teacher"
    return TeacherPlan(entries, column=str(column))


def _check_spec(spec: Mapping[str, Any], where: str) -> str:
    kind = spec["kind"]
    if kind not in TEACHER_KINDS:
        raise ValueError(f"{where}.kind must be one of {', '.join(TEACHER_KINDS)}, got {kind!r}.")
    unknown = set(spec) - _KEYS[kind] - {"kind"}
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))} for kind={kind}; it takes "
            f"{', '.join(sorted(_KEYS[kind]))}."
        )
    top_k = spec.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"{where}.top_k must be a positive integer or null, got {top_k!r}.")
    if kind == "server":
        _check_server_signal(spec, where)
    required = {"local": "model", "cache": "path", "server": "url"}.get(kind)
    if required is not None and not spec.get(required):
        raise ValueError(f"{where}: kind={kind} needs {where}.{required}.")
    return str(kind)


def _check_server_signal(spec: Mapping[str, Any], where: str) -> None:
    signal = spec.get("signal") or "topk"
    if signal not in SERVER_SIGNALS:
        raise ValueError(
            f"{where}.signal must be one of {', '.join(SERVER_SIGNALS)} (top-k log-probs from a generative vLLM "
            f"server, or final hidden states from a pooling one), got {signal!r}."
        )
    if signal == "hidden" and spec.get("top_k") is not None:
        raise ValueError(
            f"{where}: signal=hidden gives the teacher's full distributions, so top_k={spec['top_k']} would not be "
            f"read. Set {where}.top_k=null (Hydra: teacher=server_hidden has none)."
        )
    if signal == "topk":
        unread = sorted(key for key in ("head", "dtype") if spec.get(key) is not None)
        if unread:
            raise ValueError(
                f"{where}: {', '.join(unread)} are read only with signal=hidden (a pooling server sending hidden "
                f"states); this server sends top-k log-probs. Remove them, or set {where}.signal=hidden."
            )


def _entry(spec: Mapping[str, Any], where: str) -> TeacherEntry:
    kind = _check_spec(spec, where)
    return TeacherEntry(kind, {key: value for key, value in spec.items() if key != "kind"})


def build_remote_teacher(entry: TeacherEntry) -> Any:
    """The teacher object of a ``cache`` or ``server`` entry (or the object given)."""
    if entry.built is not None:
        return entry.built
    settings = {key: value for key, value in entry.settings.items() if value is not None}
    if entry.kind == "cache":
        from lightning_gkd.teachers.offline.reader import open_teacher_cache

        return open_teacher_cache(settings.pop("path"), **settings)
    if entry.kind == "server":
        if settings.pop("signal", "topk") == "hidden":
            from lightning_gkd.teachers.hidden_server import HiddenServerTeacher

            return HiddenServerTeacher(settings.pop("url"), **settings)
        from lightning_gkd.teachers.server import ServerTeacher

        return ServerTeacher(settings.pop("url"), **settings)
    raise ValueError(f"build_remote_teacher: kind={entry.kind} is built by the method (an in-process model).")


def build_teachers(
    plan: TeacherPlan,
    load: Callable[[Any, str], nn.Module],
    student: nn.Module,
    tokenizer: Any,
    *,
    same_vocab: bool = True,
) -> tuple[dict[str, Any], dict[str, nn.Module]]:
    """Each teacher's source by name, and the in-process models among them. ``load(source, role)`` loads a frozen
    model (role ``teacher``, or ``teacher.<name>`` under ``multi``); each source's ``check`` runs now, before
    training: the server is up and serves the student's tokenizer, the cache was made with it.

    ``same_vocab`` (False: a cross-tokenizer teacher, compared through its own tokenizer): the student and its
    teachers share the student's tokenizer and are compared over the vocabulary rows they all have
    (``share_vocabulary``), which the student and the teachers are limited to here."""
    sources: dict[str, Any] = {}
    models: dict[str, nn.Module] = {}
    for name, entry in plan.entries.items():
        if entry.kind == "local":
            models[name] = load(entry.settings["model"], _role(name))
            sources[name] = LocalTeacher(models[name], top_k=entry.top_k)
        else:
            sources[name] = build_remote_teacher(entry)
    rows = share_vocabulary(plan, sources, student, tokenizer) if same_vocab else vocab_size(student)
    for source in sources.values():
        source.check(tokenizer, rows)
    return sources, models


def _role(name: str) -> str:
    return f"teacher.{name}" if name else "teacher"


def signal_rows(source: Any) -> int | None:
    """The vocabulary rows a teacher's distributions are over: an in-process model's output rows, a hidden-state
    teacher's head rows, a top-k cache's recorded range; None when the source cannot tell (a top-k server)."""
    if isinstance(source, LocalTeacher):
        return vocab_size(source.model)
    if isinstance(source, HiddenStateTeacher):
        return source.vocab_size
    rows = getattr(source, "vocab_rows", None)
    return None if rows is None else int(rows)


def share_vocabulary(plan: TeacherPlan, sources: Mapping[str, Any], student: nn.Module, tokenizer: Any) -> int | None:
    """The token ids ``[0, V)`` the student and its teachers (one tokenizer) are compared on, ``V`` the fewest rows
    among them (``models.loading.shared_vocab_rows``): models padded differently past the tokenizer (Qwen2.5-7B
    and 0.5B) distil over the rows they share. The student, each in-process teacher and each hidden-state teacher's
    head are limited to ``V`` here, so every loss, sampler and figure reads the truncated models. A local teacher
    with another row count must be known to use the student's tokenizer (``names_same_tokenizer``: the one its spec
    names, tokenizer files in its folder, or its hub id's): otherwise the difference is refused as another
    tokenizer's."""
    student_rows = vocab_size(student)
    rows = {"student": student_rows} | {_role(name): signal_rows(source) for name, source in sources.items()}
    for name, source in sources.items():
        size = rows[_role(name)]
        if isinstance(source, LocalTeacher) and None not in (size, student_rows) and size != student_rows:
            _check_padded_only(plan.entries[name], tokenizer, student_rows, size, _role(name))
    shared = shared_vocab_rows(tokenizer, rows)
    if shared is None:
        return None
    limit_output_rows(student, shared)
    for source in sources.values():
        if isinstance(source, LocalTeacher):
            limit_output_rows(source.model, shared)
        elif isinstance(source, HiddenStateTeacher):
            source.limit_rows(shared)
    return shared


def _check_padded_only(entry: TeacherEntry, tokenizer: Any, student_rows: Any, teacher_rows: Any, role: str) -> None:
    same = names_same_tokenizer(entry, tokenizer)
    if same:
        return
    why = (
        "its tokenizer is another one"
        if same is False
        else "its tokenizer is not known to be the student's (the teacher spec names none, its folder holds no "
        "tokenizer files and no hub tokenizer of it could be read)"
    )
    raise ValueError(
        f"Student vocabulary size {student_rows} differs from the {role}'s {teacher_rows}, and {why}. Models padded "
        "differently over one tokenizer distil over the rows they share once that is known: name the teacher's "
        "tokenizer (Hydra: model.teacher.tokenizer=<folder or hub id>; Python: teacher={'kind': 'local', 'model': "
        "..., 'tokenizer': ...}). With another tokenizer, cross_tokenizer=auto (the default) distils across "
        "tokenizers; cross_tokenizer.enabled=always forces that loss."
    )


# --------------------------------------------------------------------------- a teacher's tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def named_tokenizer(entry: TeacherEntry) -> Any:
    """The tokenizer a local teacher entry names: its ``tokenizer`` key, else its model spec's."""
    if entry.settings.get("tokenizer"):
        return entry.settings["tokenizer"]
    model = entry.settings.get("model")
    return model.get("tokenizer") if isinstance(model, Mapping) else None


def folder_tokenizer(entry: TeacherEntry) -> str | None:
    """The teacher model's own folder when it holds tokenizer files; None otherwise (a built module, a config, a
    folder without a tokenizer, a hub id): the student's tokenizer is assumed. A hub id's tokenizer is fetched
    before models load only when named (``model.teacher.tokenizer=<hub id>``); after its model has loaded from the
    hub, a differing vocabulary size fetches it to confirm (``names_same_tokenizer``)."""
    model = entry.settings.get("model")
    name = model.get("name_or_path") if isinstance(model, Mapping) and not model.get("config") else model
    if not isinstance(name, str | Path) or not str(name):
        return None
    folder = Path(name).expanduser()
    if folder.is_dir() and any((folder / file).is_file() for file in _TOKENIZER_FILES):
        return str(folder)
    return None


def load_teacher_tokenizer(source: Any, entry: TeacherEntry | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer object as is; a folder or hub id loaded (with the teacher model spec's revision and
    trust_remote_code)."""
    if isinstance(source, PreTrainedTokenizerBase):
        return source
    model = entry.settings.get("model") if entry is not None else None
    spec = model if isinstance(model, Mapping) else {}
    revision = (spec.get("init_kwargs") or {}).get("revision")
    return load_tokenizer(str(source), revision=revision, trust_remote_code=bool(spec.get("trust_remote_code")))


def names_same_tokenizer(entry: TeacherEntry, tokenizer: PreTrainedTokenizerBase) -> bool | None:
    """Whether a local teacher entry's tokenizer has ``tokenizer``'s vocabulary: the one its spec or model spec
    names, else tokenizer files in its folder, else the tokenizer of its hub id (the model is loaded from the hub
    anyway when this is asked; one that cannot be fetched counts as unknown). None when none is known."""
    source = named_tokenizer(entry) or folder_tokenizer(entry)
    if source is None and (hub_id := _hub_model_id(entry)) is not None:
        try:
            return same_tokenizer(tokenizer, load_teacher_tokenizer(hub_id, entry))
        except (OSError, ValueError):
            return None
    return None if source is None else same_tokenizer(tokenizer, load_teacher_tokenizer(source, entry))


def _hub_model_id(entry: TeacherEntry) -> str | None:
    """The hub id a local teacher entry's model is loaded from (``org/name``, not a local path), else None."""
    model = entry.settings.get("model")
    name = model.get("name_or_path") if isinstance(model, Mapping) and not model.get("config") else model
    if not isinstance(name, str) or not name or Path(name).expanduser().exists():
        return None
    return None if name.startswith((".", "/", "~")) or name.count("/") > 1 else name


def same_tokenizer(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> bool:
    """Whether two tokenizers share one vocabulary (the same token string at every id)."""
    return student is teacher or student.get_vocab() == teacher.get_vocab()
