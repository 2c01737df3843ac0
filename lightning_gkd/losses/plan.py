"""Which loss object a run trains with, chosen once from its teacher plan (``teachers.spec.teacher_plan``), and the
settings each teacher signal allows, checked before any model loads.

Per teacher: an in-process model without ``top_k`` gives full distributions (``DenseDistillation``); any other
teacher a top-k signal (``TopKDistillation`` with ``sparse_loss=topk|topk_renorm``, ``SampledDistillation`` with
``k1|k3``). Under ``teacher.kind=multi`` one loss per teacher name, routed by the rows' column
(``RoutedDistillation``). OPD's policy gradient picks its teacher signal the same way (``policy_gradient_loss``).
A setting that the chosen losses would not read is refused (``refuse_unread_settings``), naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from lightning_gkd.losses.base import DistillationLoss, LeanPath
from lightning_gkd.losses.dense import DenseDistillation
from lightning_gkd.losses.opd import DensePolicyGradient, TopKPolicyGradient
from lightning_gkd.losses.routed import RoutedDistillation
from lightning_gkd.losses.sparse import SampledDistillation, TopKDistillation
from lightning_gkd.teachers.hidden import HiddenStateTeacher
from lightning_gkd.teachers.local import LocalTeacher
from lightning_gkd.teachers.spec import TeacherPlan

#: The loss against a sparse teacher: ``topk`` the generalized JSD (``beta``) of the coarse distributions over the
#: teacher's top-k and one bucket for the rest (exact KL of those; equals the full loss at k = V), ``topk_renorm``
#: both renormalised over the top-k (no rest bucket), ``k1``/``k3`` the sampled-token reverse-KL estimators on the
#: student's own samples (``lightning_gkd.ops.divergence.sparse_kd``).
SparseLoss = Literal["topk", "topk_renorm", "k1", "k3"]
SPARSE_LOSSES: tuple[str, ...] = get_args(SparseLoss)


def _is_dense(source: Any) -> bool:
    """Full distributions: the in-process model without ``top_k``, or a teacher of final hidden states and a head
    (``HiddenStateTeacher``: a pooling server, a hidden-state cache)."""
    return isinstance(source, HiddenStateTeacher) or isinstance(source, LocalTeacher) and source.top_k is None


def divergence_loss(
    sources: Mapping[str, Any],
    column: str | None,
    *,
    beta: float,
    temperature: float,
    sparse_loss: str,
    chunk_size: int,
    lean: LeanPath,
) -> DistillationLoss:
    """GKD's loss against the run's teachers (``sources``: name -> teacher; ``""`` the only one unless routed by
    ``column``): the generalized JSD (``beta``, ``temperature``) over each dense teacher's full distributions, and
    ``sparse_loss`` against each sparse one."""

    def one(source: Any) -> DistillationLoss:
        if _is_dense(source):
            return DenseDistillation(source, beta=beta, temperature=temperature, chunk_size=chunk_size, lean=lean)
        if sparse_loss in ("k1", "k3"):
            return SampledDistillation(source, estimator=sparse_loss, chunk_size=chunk_size)
        return TopKDistillation(source, beta=beta, tail=sparse_loss == "topk", chunk_size=chunk_size)

    return _routed(column, {name: one(source) for name, source in sources.items()})


def policy_gradient_loss(
    sources: Mapping[str, Any], column: str | None, *, sparse_loss: str, **settings: Any
) -> DistillationLoss:
    """OPD's training loss against the run's teachers: ``DensePolicyGradient`` for a dense teacher,
    ``TopKPolicyGradient`` (its ``kl_coef`` term: ``sparse_loss`` ``topk`` with a tail bucket, or ``topk_renorm``)
    for a sparse one; ``settings`` are ``PolicyGradientDistillation``'s."""

    def one(source: Any) -> DistillationLoss:
        if _is_dense(source):
            return DensePolicyGradient(source, **settings)
        return TopKPolicyGradient(source, tail=sparse_loss == "topk", **settings)

    return _routed(column, {name: one(source) for name, source in sources.items()})


def _routed(column: str | None, losses: dict[str, DistillationLoss]) -> DistillationLoss:
    return losses[""] if column is None else RoutedDistillation(column, losses)


# --------------------------------------------------------------------------- before models load


def check_sparse_loss(sparse_loss: str) -> None:
    if sparse_loss not in SPARSE_LOSSES:
        raise ValueError(f"sparse_loss must be one of {', '.join(SPARSE_LOSSES)}, got {sparse_loss!r}.")


def check_teacher_settings(
    plan: TeacherPlan, *, lmbda: float, beta: float, seq_kd: bool, loss_temperature: float, sparse_loss: str
) -> None:
    """GKD: raise ``ValueError`` for settings a run's teachers cannot serve, naming the setting and what to do."""
    check_sparse_loss(sparse_loss)
    kinds = {entry.kind for entry in plan.entries.values()}
    if seq_kd and any(entry.kind == "server" and entry.dense for entry in plan.entries.values()):
        raise ValueError(
            "seq_kd=true samples completions from the teacher, and a teacher server with signal=hidden is a pooling "
            "server: it sends hidden states and does not generate. Set method.seq_kd=false, or serve the teacher "
            "for completions too (teacher=server, signal=topk)."
        )
    if plan.all_dense and "cache" not in kinds:
        return
    if loss_temperature != 1.0 and not plan.all_dense:
        raise ValueError(
            f"loss_temperature={loss_temperature}: a top-k teacher signal carries log-probs at temperature 1 only "
            "(the full logits are not there to rescale). Set method.loss_temperature=1.0, or use an in-process "
            "teacher without top_k."
        )
    if "cache" in kinds and (lmbda > 0 or seq_kd):
        raise ValueError(
            f"teacher.kind=cache holds the teacher's signal for the dataset completions only, but lmbda={lmbda} "
            f"and seq_kd={seq_kd} train on new samples. Set method.lmbda=0.0 and method.seq_kd=false (supervised "
            "KD), or use teacher=server or teacher=local to score samples."
        )
    if seq_kd and (plan.routed or "server" not in kinds and "local" not in kinds):
        raise ValueError(
            "seq_kd=true needs one teacher that can write completions (kind=local or kind=server); "
            f"this run's teachers are {', '.join(sorted(kinds))}{' (multi)' if plan.routed else ''}."
        )
    if sparse_loss in ("k1", "k3") and (lmbda < 1 or seq_kd or beta != 1):
        raise ValueError(
            f"sparse_loss={sparse_loss} estimates the reverse KL from the student's own samples: set "
            f"method.lmbda=1.0, method.seq_kd=false and method.beta=1.0 (got lmbda={lmbda}, seq_kd={seq_kd}, "
            f"beta={beta}), or use sparse_loss=topk."
        )


def refuse_unread_settings(plan: TeacherPlan, *, sparse_loss: str, lean_loss: bool, owner: str) -> None:
    """``ValueError`` for a loss setting no teacher of this run reads: ``sparse_loss`` other than ``topk`` with only
    dense teachers (full distributions), ``lean_loss=False`` with only sparse ones (their losses always read hidden
    states). ``owner``: the method, for the message."""
    dense = [entry.dense for entry in plan.entries.values()]
    if sparse_loss != "topk" and all(dense):
        raise ValueError(
            f"{owner}(sparse_loss={sparse_loss!r}): sparse_loss is read only against a sparse teacher (teacher=cache"
            "|server, or teacher.top_k set), and this run's teacher gives full distributions (the generalized JSD "
            "over the whole vocabulary). Leave sparse_loss=topk (Hydra: method.sparse_loss=topk), or set "
            "teacher.top_k to train on the teacher's top-k."
        )
    if not lean_loss and not any(dense):
        raise ValueError(
            f"{owner}(lean_loss=False): lean_loss chooses between final hidden states and full logits for an "
            "in-process teacher's full distributions, and this run has only sparse teachers, whose losses always "
            "read hidden states. Leave lean_loss=True (Hydra: method.lean_loss=true)."
        )
