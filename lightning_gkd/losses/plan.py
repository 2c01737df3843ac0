"""Which loss object a run trains with, chosen once from its teacher plan (``teachers.spec.teacher_plan``), and the
settings each teacher signal allows, checked before any model loads.

Per teacher: an in-process model without ``top_k`` gives full distributions (``DenseDistillation``); any other
teacher a top-k signal (``TopKDistillation`` with ``sparse_loss=topk|topk_renorm``, ``SampledDistillation`` with
``k1|k3``). Under ``teacher.kind=multi`` one loss per teacher name, routed by the rows' column
(``RoutedDistillation``). OPD's policy gradient picks its teacher signal the same way (``policy_gradient_loss``).
The settings themselves: ``losses.settings``.
A setting that the chosen losses would not read is refused (``refuse_unread_settings``), naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_gkd.losses.base import DistillationLoss, LeanPath
from lightning_gkd.losses.dense import DenseDistillation
from lightning_gkd.losses.opd import DensePolicyGradient, TopKPolicyGradient
from lightning_gkd.losses.routed import RoutedDistillation
from lightning_gkd.losses.settings import DivergenceSettings, PolicyGradientSettings
from lightning_gkd.losses.sparse import SampledDistillation, TopKDistillation
from lightning_gkd.ops.hf.forward import EosTokenId
from lightning_gkd.teachers.hidden import HiddenStateTeacher
from lightning_gkd.teachers.local import LocalTeacher
from lightning_gkd.teachers.spec import TeacherPlan


def _is_dense(source: Any) -> bool:
    """Full distributions: the in-process model without ``top_k``, or a teacher of final hidden states and a head
    (``HiddenStateTeacher``: a pooling server, a hidden-state cache)."""
    return isinstance(source, HiddenStateTeacher) or isinstance(source, LocalTeacher) and source.top_k is None


def divergence_loss(
    sources: Mapping[str, Any], column: str | None, divergence: DivergenceSettings, *, lean: LeanPath
) -> DistillationLoss:
    """GKD's loss against the run's teachers (``sources``: name -> teacher; ``""`` the only one unless routed by
    ``column``): ``divergence``'s generalized JSD over each dense teacher's full distributions (``lean``: the run's
    shared fallback policy), and its ``sparse_loss`` against each sparse one."""

    def one(source: Any) -> DistillationLoss:
        if _is_dense(source):
            return DenseDistillation(source, divergence, lean=lean)
        if divergence.sparse_loss in ("k1", "k3"):
            return SampledDistillation(source, divergence)
        return TopKDistillation(source, divergence)

    return _routed(column, {name: one(source) for name, source in sources.items()})


def policy_gradient_loss(
    sources: Mapping[str, Any],
    column: str | None,
    policy_gradient: PolicyGradientSettings,
    divergence: DivergenceSettings,
    *,
    eos_token_id: EosTokenId,
) -> DistillationLoss:
    """OPD's training loss against the run's teachers: ``DensePolicyGradient`` for a dense teacher,
    ``TopKPolicyGradient`` (its ``kl_coef`` term: ``sparse_loss`` ``topk`` with a tail bucket, or ``topk_renorm``)
    for a sparse one."""

    def one(source: Any) -> DistillationLoss:
        kind = DensePolicyGradient if _is_dense(source) else TopKPolicyGradient
        return kind(source, policy_gradient, divergence, eos_token_id=eos_token_id)

    return _routed(column, {name: one(source) for name, source in sources.items()})


def _routed(column: str | None, losses: dict[str, DistillationLoss]) -> DistillationLoss:
    return losses[""] if column is None else RoutedDistillation(column, losses)


# --------------------------------------------------------------------------- before models load


def check_teacher_settings(plan: TeacherPlan, divergence: DivergenceSettings, *, lmbda: float, seq_kd: bool) -> None:
    """GKD: raise ``ValueError`` for settings a run's teachers cannot serve, naming the setting and what to do."""
    kinds = {entry.kind for entry in plan.entries.values()}
    if seq_kd and any(entry.kind == "server" and entry.dense for entry in plan.entries.values()):
        raise ValueError(
            "seq_kd=true samples completions from the teacher, and a teacher server with signal=hidden is a pooling "
            "server: it sends hidden states and does not generate. Set method.seq_kd=false, or serve the teacher "
            "for completions too (teacher=server, signal=topk)."
        )
    if plan.all_dense and "cache" not in kinds:
        return
    if divergence.loss_temperature != 1.0 and not plan.all_dense:
        raise ValueError(
            f"loss_temperature={divergence.loss_temperature}: a top-k teacher signal carries log-probs at "
            "temperature 1 only (the full logits are not there to rescale). Set "
            "method.divergence.loss_temperature=1.0, or use an in-process teacher without top_k."
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
    sparse_loss, beta = divergence.sparse_loss, divergence.beta
    if sparse_loss in ("k1", "k3") and (lmbda < 1 or seq_kd or beta != 1):
        raise ValueError(
            f"sparse_loss={sparse_loss} estimates the reverse KL from the student's own samples: set "
            f"method.lmbda=1.0, method.seq_kd=false and method.divergence.beta=1.0 (got lmbda={lmbda}, "
            f"seq_kd={seq_kd}, beta={beta}), or use sparse_loss=topk."
        )


def refuse_unread_settings(plan: TeacherPlan, divergence: DivergenceSettings, *, owner: str) -> None:
    """``ValueError`` for a loss setting no teacher of this run reads: ``sparse_loss`` other than ``topk`` with only
    dense teachers (full distributions), ``lean_loss=False`` with only sparse ones (their losses always read hidden
    states). ``owner``: the method, for the message."""
    dense = [entry.dense for entry in plan.entries.values()]
    if divergence.sparse_loss != "topk" and all(dense):
        raise ValueError(
            f"{owner}(divergence.sparse_loss={divergence.sparse_loss!r}): sparse_loss is read only against a sparse "
            "teacher (teacher=cache|server, or teacher.top_k set), and this run's teacher gives full distributions "
            "(the generalized JSD over the whole vocabulary). Leave sparse_loss=topk (Hydra: "
            "method.divergence.sparse_loss=topk), or set teacher.top_k to train on the teacher's top-k."
        )
    if not divergence.lean_loss and not any(dense):
        raise ValueError(
            f"{owner}(divergence.lean_loss=False): lean_loss chooses between final hidden states and full logits for "
            "an in-process teacher's full distributions, and this run has only sparse teachers, whose losses always "
            "read hidden states. Leave lean_loss=True (Hydra: method.divergence.lean_loss=true)."
        )
