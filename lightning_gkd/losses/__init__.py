"""Distillation losses as objects: built once from a run's teacher plan (``plan``), called per batch as
``loss(student, batch) -> LossOutput`` with the teacher signal inside. One class per teacher signal: ``dense``
(an in-process teacher's full distributions), ``sparse`` (a top-k signal; sampled-token estimators), ``routed``
(several teachers by a data column), ``cross_tokenizer`` (a teacher with another tokenizer), ``opd`` (OPD's policy
gradient). The math itself is ``lightning_gkd.ops``."""

from lightning_gkd.losses.base import (
    STUDENT_SAMPLES,
    DistillationLoss,
    LeanPath,
    Logged,
    LossOutput,
    combine,
    finite_flag,
    sample_figure_logs,
    sample_figures,
)

__all__ = [
    "STUDENT_SAMPLES",
    "DistillationLoss",
    "LeanPath",
    "Logged",
    "LossOutput",
    "combine",
    "finite_flag",
    "sample_figure_logs",
    "sample_figures",
]
