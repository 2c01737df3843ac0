"""Cross-tokenizer distillation, before any model loads: the ``cross_tokenizer`` settings, whether a run takes the
cross-tokenizer path (the teacher's tokenizer against the student's: ``get_vocab()`` equal = the same tokenizer, GKD's
usual path) and the refusals of what that path cannot do, each naming the option. The loss itself:
``lightning_gkd.losses.cross_tokenizer``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from transformers import PreTrainedTokenizerBase

from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import CrossTokenizerLoss
from lightning_gkd.teachers.spec import (
    TeacherEntry,
    TeacherPlan,
    folder_tokenizer,
    load_teacher_tokenizer,
    named_tokenizer,
    same_tokenizer,
)

Enabled = Literal["auto", "always", "never"]
ENABLED: tuple[str, ...] = get_args(Enabled)
#: ``cross_tokenizer`` keys read by the method and the loss object (the rest are ``CrossTokenizerLoss``'s).
_METHOD_KEYS = ("enabled", "teacher_max_length", "projection_cache", "distillation_weight", "crossentropy_weight")
_LOSS_KEYS = tuple(f.name for f in fields(CrossTokenizerLoss))
_OPTION = "cross_tokenizer"


@dataclass(frozen=True)
class CrossTokenizerSettings:
    """``GKDModule(cross_tokenizer=...)``: ``enabled`` (``auto``: when the tokenizers differ; ``always``: also with
    the same tokenizer; ``never``: GKD's usual path only, the teacher's tokenizer is not looked at), the loss
    (``CrossTokenizerLoss``) and ``teacher_max_length`` (the teacher's input budget in its tokens; None: the
    datamodule's ``max_length`` plus ``max_new_tokens``, at most the teacher's positions), ``projection_cache``
    (a folder where the ``projected`` loss's tables are cached, keyed by both tokenizers' fingerprints; None: built
    each run) and the batch loss's weights (TRL's ``uld_distillation_weight`` / ``uld_crossentropy_weight``):
    ``distillation_weight`` times the cross-tokenizer loss plus ``crossentropy_weight`` times the student's
    cross-entropy on its completion tokens. Checked when made."""

    enabled: Enabled = "auto"
    loss: CrossTokenizerLoss = field(default_factory=CrossTokenizerLoss)
    teacher_max_length: int | None = None
    projection_cache: str | None = None
    distillation_weight: float = 1.0
    crossentropy_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.enabled not in ENABLED:
            raise ValueError(
                f"{_OPTION}.enabled must be one of {', '.join(ENABLED)}, got {self.enabled!r} (auto: when the "
                "teacher's tokenizer differs from the student's; always: also when they are the same; never: off)."
            )
        length = self.teacher_max_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 2):
            raise ValueError(f"{_OPTION}.teacher_max_length must be an integer >= 2 or null, got {length!r}.")
        if self.projection_cache is not None and not isinstance(self.projection_cache, str | Path):
            raise ValueError(
                f"{_OPTION}.projection_cache must be a folder path or null, got {self.projection_cache!r}."
            )
        if self.projection_cache is not None:
            object.__setattr__(self, "projection_cache", str(self.projection_cache))
        for name in ("distillation_weight", "crossentropy_weight"):
            weight = getattr(self, name)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight >= 0:
                raise ValueError(f"{_OPTION}.{name} must be a number >= 0, got {weight!r}.")

    def as_dict(self) -> dict[str, Any]:
        """The flat mapping of conf/cross_tokenizer/ (plain values: checkpoints' hyper-parameters load weights-only)."""
        loss = {f.name: getattr(self.loss, f.name) for f in fields(CrossTokenizerLoss)}
        method = {key: getattr(self, key) for key in _METHOD_KEYS}
        return {**method, **loss}


def cross_tokenizer_settings(value: Any, *, beta: float, loss_temperature: float) -> CrossTokenizerSettings:
    """``value`` (None, a mapping as in conf/cross_tokenizer/, a ``CrossTokenizerLoss`` or settings) as settings.
    A null ``beta`` takes the method's ``divergence.beta``, null temperatures its ``loss_temperature``."""
    if isinstance(value, CrossTokenizerSettings):
        return value
    if isinstance(value, CrossTokenizerLoss):
        return CrossTokenizerSettings(loss=value)
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"{_OPTION} must be a mapping of settings (conf/cross_tokenizer/), got {value!r}.")
    given = dict(value or {})
    unknown = set(given) - set(_METHOD_KEYS) - set(_LOSS_KEYS)
    if unknown:
        raise ValueError(
            f"{_OPTION}: unknown key(s) {', '.join(sorted(unknown))}; it takes "
            f"{', '.join(sorted((*_METHOD_KEYS, *_LOSS_KEYS)))}."
        )
    method = {key: given.pop(key) for key in _METHOD_KEYS if key in given}
    defaults = {"beta": beta, "student_temperature": loss_temperature, "teacher_temperature": loss_temperature}
    for key, default in defaults.items():  # null: the method's own
        if given.get(key) is None:
            given[key] = default
    return CrossTokenizerSettings(loss=CrossTokenizerLoss(**given), **method)


def _changed_settings(value: Any, defaults: CrossTokenizerSettings) -> list[str]:
    """The ``cross_tokenizer`` settings in ``value`` (a mapping, ``CrossTokenizerLoss`` or settings) that differ from
    ``defaults`` (``enabled`` and nulls aside): ``key=value`` strings."""
    if isinstance(value, CrossTokenizerSettings):
        given: dict[str, Any] = value.as_dict()
    elif isinstance(value, CrossTokenizerLoss):
        given = {f.name: getattr(value, f.name) for f in fields(CrossTokenizerLoss)}
    else:
        given = dict(value or {})
    default = defaults.as_dict()
    return [
        f"{_OPTION}.{key}={item!r}"
        for key, item in given.items()
        if key != "enabled" and item is not None and item != default.get(key)
    ]


def unread_cross_tokenizer_settings(value: Any, *, beta: float, loss_temperature: float) -> None:
    """``ValueError`` for settings only the cross-tokenizer loss reads, given to a run that does not take it (the
    teacher shares the student's tokenizer, or ``enabled=never``): ``cross_tokenizer`` settings other than the
    defaults (the loss's, its weights, its budget and cache), where a null ``beta`` means the method's ``beta`` and
    null temperatures its ``loss_temperature`` (a checkpoint records them resolved)."""
    unread = _changed_settings(value, cross_tokenizer_settings(None, beta=beta, loss_temperature=loss_temperature))
    if unread:
        raise ValueError(
            f"{', '.join(unread)}: read only by the cross-tokenizer loss, and this run trains with GKD's usual loss "
            "(the teacher shares the student's tokenizer, or cross_tokenizer.enabled=never). Drop "
            f"{'it' if len(unread) == 1 else 'them'} (Hydra: cross_tokenizer=auto), or train across tokenizers: give "
            "the teacher's own tokenizer (model.teacher.tokenizer; Python: teacher_tokenizer=...) or set "
            f"{_OPTION}.enabled=always."
        )


# --------------------------------------------------------------------------- before models load


def plan_cross_tokenizer(
    plan: TeacherPlan,
    student_tokenizer: PreTrainedTokenizerBase,
    teacher_tokenizer: Any,
    settings: CrossTokenizerSettings,
    *,
    owner: type,
    seq_kd: bool,
    sparse_loss: str,
) -> PreTrainedTokenizerBase | None:
    """The teacher's tokenizer when this run takes the cross-tokenizer path, None for GKD's usual path. Loads
    tokenizers only (before any model); raises ``ValueError`` naming the option for what the path cannot do.

    The teacher's tokenizer: ``teacher_tokenizer`` (a tokenizer, folder or hub id), else the local teacher spec's
    ``tokenizer``, else its model spec's ``tokenizer`` (Hydra: ``model.teacher.tokenizer``), else the teacher's own
    folder if it holds a tokenizer; none of these (a built module, a hub id): the student's. ``owner``: the
    method's class (its ``cross_tokenizer_supported`` says whether it has the path)."""
    if settings.enabled == "never":
        return None
    entries = plan.entries
    if plan.routed or any(entry.kind != "local" for entry in entries.values()):
        _check_no_cross_teacher(plan, student_tokenizer, teacher_tokenizer, settings)
        return None
    entry = entries[""]
    source = teacher_tokenizer
    if source is None:
        source = named_tokenizer(entry) or folder_tokenizer(entry)
    tokenizer = student_tokenizer if source is None else load_teacher_tokenizer(source, entry)
    if settings.enabled == "auto" and same_tokenizer(student_tokenizer, tokenizer):
        return None
    why = f"{_OPTION}.enabled=always"
    if settings.enabled == "auto":
        why = "a teacher whose tokenizer differs from the student's"
    if not getattr(owner, "cross_tokenizer_supported", True):
        raise ValueError(
            f"{owner.__name__} cannot distil from {why}: its reward is the teacher's log-prob of each token the "
            "student sampled, which another tokenizer does not define. Use method=gkd (cross-tokenizer distillation, "
            f"{_OPTION}=auto), or a teacher with the student's tokenizer."
        )
    if seq_kd:
        raise ValueError(
            f"seq_kd=true with {why}: the teacher would sample in its own tokens. Set method.seq_kd=false "
            "(cross-tokenizer distillation trains on dataset completions and the student's samples), or use a "
            f"teacher with the student's tokenizer ({_OPTION}=off)."
        )
    if entry.top_k is not None:
        raise ValueError(
            f"teacher.top_k={entry.top_k} with {why}: a top-k signal lists the teacher's token ids, not the "
            f"student's. Set teacher.top_k=null (the cross-tokenizer loss reads the teacher's full distributions)."
        )
    if sparse_loss != "topk":
        raise ValueError(
            f"method.divergence.sparse_loss={sparse_loss} with {why}: the sparse losses read a top-k signal in the "
            f"student's token ids; the cross-tokenizer loss ({_OPTION}.loss) replaces them. Leave "
            "method.divergence.sparse_loss=topk."
        )
    return tokenizer


def _check_no_cross_teacher(
    plan: TeacherPlan,
    student_tokenizer: PreTrainedTokenizerBase,
    teacher_tokenizer: Any,
    settings: CrossTokenizerSettings,
) -> None:
    """teacher=cache|server|multi (or a built sparse teacher): no cross-tokenizer path. Refuse ``enabled=always``
    and a teacher tokenizer, given or named by a local multi entry, that differs from the student's."""
    kinds = ", ".join(sorted({entry.kind for entry in plan.entries.values()}))
    where = f"teacher.kind=multi (teachers: {kinds})" if plan.routed else f"teacher.kind={kinds}"
    named: list[tuple[str, Any]] = []
    for name, entry in plan.entries.items():  # a tokenizer an entry names, else a local teacher's own folder's
        source = named_tokenizer(entry)
        if source is None and entry.kind == "local":
            source = folder_tokenizer(entry)
        if source is not None:
            named.append((name, source))
    if teacher_tokenizer is not None:
        named.append(("", teacher_tokenizer))
    differing = [
        name for name, source in named if not same_tokenizer(student_tokenizer, load_teacher_tokenizer(source))
    ]
    if settings.enabled == "always" or differing:
        which = f" (teacher {differing[0]!r})" if differing and differing[0] else ""
        raise ValueError(
            f"Cross-tokenizer distillation{which} needs one in-process teacher (teacher=local), but this run has "
            f"{where}: a cache's or a server's top-k log-probs are over the student's token ids, and a multi "
            f"teacher's rows share one loss. Use teacher=local with model.teacher, or a teacher with the student's "
            f"tokenizer ({_OPTION}=off)."
        )


def check_cross_tokenizer_config(cfg: Any, datamodule: Any) -> None:
    """The CLI's checks before any model loads (a composed train config, its datamodule): a cross-tokenizer run
    with ``data.assistant_turns=all``, or with ``teacher=cache|server`` while model.teacher's tokenizer (a local
    folder: ``model.teacher.tokenizer``, else the teacher's own folder) differs from the student's. Methods without
    the cross-tokenizer path are not checked."""
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    from lightning_gkd.teachers.spec import teacher_plan

    target = get_object(cfg.method._target_) if cfg.get("method") and cfg.method.get("_target_") else None
    if not isinstance(target, type) or getattr(target, "cross_tokenizer_supported", None) is None:
        return
    method = OmegaConf.to_container(cfg.method, resolve=True)
    assert isinstance(method, dict)
    divergence = method.get("divergence") or {}
    settings = cross_tokenizer_settings(
        method.get("cross_tokenizer"),
        beta=divergence.get("beta", 0.5),
        loss_temperature=divergence.get("loss_temperature", 1.0),
    )
    if settings.enabled == "never":
        return
    plan = teacher_plan(method.get("teacher"))
    model_teacher = cfg.model.get("teacher") if cfg.get("model") else None
    if OmegaConf.is_config(model_teacher):
        model_teacher = OmegaConf.to_container(model_teacher, resolve=True)
    kinds = {entry.kind for entry in plan.entries.values()}
    if not plan.routed and kinds & {"cache", "server"} and model_teacher is not None:
        entry = TeacherEntry("local", {"model": model_teacher})
        tokenizer = named_tokenizer(entry) or folder_tokenizer(entry)
        if (
            tokenizer
            and Path(str(tokenizer)).is_dir()
            and not same_tokenizer(datamodule.tokenizer, load_teacher_tokenizer(tokenizer))
        ):
            raise ValueError(
                f"model.teacher's tokenizer ({tokenizer}) differs from the student's tokenizer, but "
                f"teacher.kind={kinds.pop()} gives its signal over the student's token ids. Cross-tokenizer "
                "distillation needs the teacher in process: use teacher=local."
            )
    if getattr(datamodule, "assistant_turns", "last") != "all":
        return
    active = plan_cross_tokenizer(
        plan,
        datamodule.tokenizer,
        method.get("teacher_tokenizer"),
        settings,
        owner=target,
        seq_kd=bool(method.get("seq_kd", False)),
        sparse_loss=str(divergence.get("sparse_loss", "topk")),
    )
    if active is not None:
        raise ValueError(_ASSISTANT_TURNS)


_ASSISTANT_TURNS = (
    "data.assistant_turns=all with a teacher whose tokenizer differs from the student's: the teacher reads the "
    "last assistant turn only (its own template on the prompt messages, then the completion's text). Set "
    f"data.assistant_turns=last, or use a teacher with the student's tokenizer ({_OPTION}=off)."
)


def check_cross_tokenizer_datamodule(datamodule: Any) -> None:
    """A cross-tokenizer run needs the rows' prompt messages in every batch and the last assistant turn only."""
    carry = getattr(datamodule, "carry_prompt_messages", None)
    if not callable(carry):
        raise TypeError(
            "Cross-tokenizer distillation renders each row's prompt messages with the teacher's chat template: use "
            f"a datamodule with carry_prompt_messages (ChatDataModule), not {type(datamodule).__name__}."
        )
    if getattr(datamodule, "assistant_turns", "last") == "all":
        raise ValueError(_ASSISTANT_TURNS)
    carry()
