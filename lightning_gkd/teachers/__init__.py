"""Teachers: where a distillation loss gets the teacher's signal for a batch. ``Teacher`` is the protocol the
losses read; ``LocalTeacher`` is the in-process frozen model (the default). Other sources (a precomputed cache, a
served model) implement the same methods."""

from lightning_gkd.teachers.base import (
    SparseTeacher,
    Teacher,
    TeacherUnavailable,
    TopKSignal,
    next_tokens,
    supervised_positions,
)
from lightning_gkd.teachers.local import LocalTeacher

__all__ = [
    "LocalTeacher",
    "SparseTeacher",
    "Teacher",
    "TeacherUnavailable",
    "TopKSignal",
    "next_tokens",
    "supervised_positions",
]
