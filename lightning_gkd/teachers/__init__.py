"""Teachers: where a distillation loss gets the teacher's signal for a batch. ``Teacher`` (dense: logits or hidden
states) and ``SparseTeacher`` (top-k log-probs, ``TopKSignal``) are the protocols the losses read, ``TeacherBase`` the
base every teacher source subclasses (its checks and ``close``); ``LocalTeacher`` is the in-process frozen model (the
default; both protocols), ``CacheTeacher`` reads an offline top-k cache (``lightning-gkd-cache``), ``ServerTeacher`` a
vLLM server. ``HiddenStateTeacher`` is a dense teacher without a model: final hidden states read elsewhere and the
teacher's head (``HiddenServerTeacher``: a vLLM pooling server; ``HiddenCacheTeacher``: a cache built with
``signal=hidden``). ``lightning_gkd.teachers.spec`` builds them from config
(``teacher.kind=local|cache|server|multi``)."""

from lightning_gkd.teachers.base import (
    SparseTeacher,
    Teacher,
    TeacherBase,
    TeacherUnavailable,
    TopKSignal,
    next_tokens,
    supervised_positions,
)
from lightning_gkd.teachers.hidden import HiddenStateTeacher
from lightning_gkd.teachers.hidden_server import HiddenServerTeacher
from lightning_gkd.teachers.local import LocalTeacher
from lightning_gkd.teachers.offline.reader import CacheTeacher, HiddenCacheTeacher
from lightning_gkd.teachers.server import ServerSampler, ServerTeacher

__all__ = [
    "CacheTeacher",
    "HiddenCacheTeacher",
    "HiddenServerTeacher",
    "HiddenStateTeacher",
    "LocalTeacher",
    "ServerSampler",
    "ServerTeacher",
    "SparseTeacher",
    "Teacher",
    "TeacherBase",
    "TeacherUnavailable",
    "TopKSignal",
    "next_tokens",
    "supervised_positions",
]
