"""What ``GKDModule`` needs to train against teachers other than one full in-process model: the settings each kind
of teacher allows (checked before any model loads), and the loss from a sparse (top-k) teacher signal."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import torch
from torch import nn

from lightning_gkd.data.loader import select_rows
from lightning_gkd.models.loading import ModelSource, check_same_vocab, vocab_size
from lightning_gkd.ops.hf import (
    check_output_head,
    final_hidden_states,
    output_head,
    resolve_eos_token_id,
    resolve_pad_token_id,
)
from lightning_gkd.ops.sparse_kd import sampled_kl_loss, topk_distillation_loss
from lightning_gkd.teachers.base import SparseTeacher, next_tokens, supervised_positions
from lightning_gkd.teachers.local import LocalTeacher
from lightning_gkd.teachers.routing import route_rows
from lightning_gkd.teachers.spec import TeacherPlan, build_remote_teacher

#: The loss against a sparse teacher: ``topk`` the generalized JSD (``beta``) of the coarse distributions over the
#: teacher's top-k and one bucket for the rest (exact KL of those; equals the full loss at k = V), ``topk_renorm``
#: both renormalised over the top-k (no rest bucket), ``k1``/``k3`` the sampled-token reverse-KL estimators on the
#: student's own samples (``lightning_gkd.ops.sparse_kd``).
SparseLoss = Literal["topk", "topk_renorm", "k1", "k3"]
SPARSE_LOSSES: tuple[str, ...] = get_args(SparseLoss)

#: A GKD ``teacher``: a model source (the in-process model), a teacher spec (``lightning_gkd.teachers.spec``) or a
#: built sparse teacher.
TeacherSource = ModelSource | Mapping[str, Any] | SparseTeacher


def check_teacher_settings(
    plan: TeacherPlan, *, lmbda: float, beta: float, seq_kd: bool, loss_temperature: float, sparse_loss: str
) -> None:
    """Raise ``ValueError`` for settings a run's teachers cannot serve, naming the setting and what to do."""
    if sparse_loss not in SPARSE_LOSSES:
        raise ValueError(f"sparse_loss must be one of {', '.join(SPARSE_LOSSES)}, got {sparse_loss!r}.")
    kinds = {entry.kind for entry in plan.entries.values()}
    if plan.all_local_dense:
        return
    if loss_temperature != 1.0:
        raise ValueError(
            f"loss_temperature={loss_temperature}: a top-k teacher signal carries log-probs at temperature 1 only "
            "(the full logits are not there to rescale). Set method.loss_temperature=1.0, or use an in-process "
            "teacher without top_k."
        )
    if "cache" in kinds and (lmbda > 0 or seq_kd):
        raise ValueError(
            f"teacher.kind=cache holds the teacher's log-probs for the dataset completions only, but lmbda={lmbda} "
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


def build_teachers(
    plan: TeacherPlan,
    load: Callable[[Any, str], nn.Module],
    student: nn.Module,
    tokenizer: Any,
    *,
    same_vocab: bool = True,
) -> tuple[dict[str, Any], dict[str, nn.Module]]:
    """Each teacher's source by name, and the in-process models among them. ``load(source, role)`` loads a frozen
    model (role ``teacher``, or ``teacher.<name>`` under ``multi``); a remote teacher's ``check`` runs now, before
    training: the server is up and serves the student's tokenizer, the cache was made with it. ``same_vocab``:
    in-process teachers must have the student's vocabulary size (False: a cross-tokenizer teacher)."""
    sources: dict[str, Any] = {}
    models: dict[str, nn.Module] = {}
    for name, entry in plan.entries.items():
        if entry.kind == "local":
            role = f"teacher.{name}" if name else "teacher"
            models[name] = load(entry.settings["model"], role)
            if same_vocab:
                _check_same_vocab(student, models[name], role)
            sources[name] = LocalTeacher(models[name], top_k=entry.top_k)
            continue
        sources[name] = source = build_remote_teacher(entry)
        check = getattr(source, "check", None)
        if callable(check):
            check(tokenizer, vocab_size(student))
    return sources, models


def _check_same_vocab(student: nn.Module, teacher: nn.Module, role: str) -> None:
    try:
        check_same_vocab(student, teacher, teacher_role=role)
    except ValueError as error:
        raise ValueError(
            f"{error} For a teacher with another tokenizer, give its tokenizer (Hydra: model.teacher.tokenizer=<folder "
            "or hub id>, null takes the teacher's own folder; Python: GKDModule(teacher_tokenizer=...)): "
            "cross_tokenizer=auto (the default) then distils across tokenizers; cross_tokenizer.enabled=always "
            "forces that loss with the same tokenizer."
        ) from None


def server_sampler(teacher: Any, student: nn.Module, tokenizer: Any, **sampling: Any) -> Any:
    """A ``ServerSampler`` over a served teacher: seq_kd's completions written by the server."""
    from lightning_gkd.teachers.server import ServerSampler

    return ServerSampler(
        teacher,
        eos_token_id=resolve_eos_token_id(student, tokenizer),
        pad_token_id=resolve_pad_token_id(tokenizer),
        **sampling,
    )


def sparse_teacher_loss(
    student: nn.Module,
    teacher: SparseTeacher,
    batch: Mapping[str, torch.Tensor],
    *,
    sparse_loss: str,
    beta: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-mean loss of ``student`` against ``teacher``'s top-k signal at the supervised positions of
    ``batch``, and the student's final hidden states there (for the non-finite watch). The student's logits exist
    ``chunk_size`` positions at a time only."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = supervised_positions(batch["labels"])
    check_output_head(student, ids, mask)
    hidden = final_hidden_states(student, ids, mask, positions)
    head = output_head(student)
    signal = teacher.topk(batch, positions).to(hidden.device)
    if sparse_loss in ("topk", "topk_renorm"):
        loss = topk_distillation_loss(
            hidden, head, signal.ids, signal.logprobs, beta=beta, tail=sparse_loss == "topk", chunk_size=chunk_size
        )
        return loss, hidden
    if signal.next_logprobs is None:
        raise ValueError(
            f"sparse_loss={sparse_loss} needs the teacher's log-prob of each sampled token, which "
            f"{type(teacher).__name__} did not return; use sparse_loss=topk."
        )
    tokens = next_tokens(ids, positions)
    loss = sampled_kl_loss(
        hidden,
        head,
        tokens,
        signal.next_logprobs,
        estimator=sparse_loss,
        chunk_size=chunk_size,
    )
    return loss, hidden


def routed_loss(
    batch: Mapping[str, Any],
    column: str,
    sources: Mapping[str, Any],
    loss_of: Callable[[dict[str, Any], Any], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, int]]]:
    """``teacher.kind=multi``: each teacher's loss on its own rows (``loss_of(rows, source)``, a token mean) and
    the token mean over the whole batch; also, per teacher, its detached loss and supervised-token count."""
    total: torch.Tensor | None = None
    tokens = 0
    per_teacher: dict[str, tuple[torch.Tensor, int]] = {}
    for name, rows in route_rows(batch, column, list(sources)).items():
        part = select_rows(batch, rows)
        count = int(supervised_positions(part["labels"]).sum())
        loss = loss_of(part, sources[name])
        per_teacher[name] = (loss.detach(), count)
        total = loss * count if total is None else total + loss * count
        tokens += count
    if total is None:  # an empty batch
        raise ValueError("routed_loss: the batch has no rows.")
    return total / max(tokens, 1), per_teacher
