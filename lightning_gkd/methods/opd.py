"""OPDModule: on-policy distillation as a policy gradient (the teacher's log-prob of each sampled token is the
reward), built on GKDModule's on-policy machinery; the loss itself is ``lightning_gkd.ops.opd``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.methods.gkd import GKDModule
from lightning_gkd.methods.gkd_teachers import TeacherSource, routed_loss
from lightning_gkd.models.loading import ModelSource
from lightning_gkd.ops.chunked_jsd import projected_jsd_loss
from lightning_gkd.ops.hf import (
    LeanForwardUnsupported,
    check_output_head,
    final_hidden_states,
    output_head,
    resolve_eos_token_id,
)
from lightning_gkd.ops.losses import IGNORE_INDEX
from lightning_gkd.ops.opd import OPDStats, policy_gradient_distillation_loss
from lightning_gkd.ops.sparse_kd import topk_distillation_loss
from lightning_gkd.ops.topk import topk_log_probs
from lightning_gkd.teachers import CacheTeacher, LocalTeacher, next_tokens, supervised_positions
from lightning_gkd.teachers.spec import teacher_plan


@dataclass(frozen=True)
class _Part:
    """One teacher's share of a batch: its OPD loss (a token mean), statistics, full-distribution term, tokens."""

    loss: torch.Tensor
    stats: OPDStats
    divergence: torch.Tensor | None
    tokens: int


class OPDModule(GKDModule):
    r"""On-policy distillation as a policy gradient (OPD): on the student's own samples ``x_t`` the reward of each
    token is ``r_t = log p_T(x_t) − log p_S(x_t)``, its advantage the ``gamma``-discounted sum of the rewards from
    ``t`` to the row's end, and the loss the surrogate ``−mean_t(w_t · A_t · log p_S(x_t))`` with truncated
    importance weights ``w_t = min(p_S(x_t) / p_sampler(x_t), max_is_weight)`` (``ops.opd``). With ``gamma = 0`` and
    fresh samples its gradient is the sampled reverse-KL (k1) gradient, in expectation exactly ``∇ KL(S‖T)``.
    ``kl_coef > 0`` adds ``kl_coef`` times the full-distribution generalized JSD (``beta``; default 1 = reverse KL)
    on the same positions: the teacher's whole distribution for an in-process teacher, its top-k with a tail bucket
    (``sparse_loss``: ``topk`` or ``topk_renorm``) for a served one.

    Why a subclass of ``GKDModule``: OPD reuses all of GKD's on-policy machinery (samplers ``hf``/``vllm``, teachers
    ``local``/``server``/``multi``, grouped generation with ``steps_per_generation``, checkpointed groups, DDP) and
    changes only the loss on the student's samples and its logging; a subclass gives OPD its own knobs and config
    file (``method=opd``) without OPD-only arguments in GKD's signature.

    Every training batch is the student's samples (``lmbda`` is fixed at 1, ``seq_kd`` off), drawn at ``temperature``
    (default 1: then ``w_t = p_S / p_sampler`` compares the same distribution, and is 1 on samples from the current
    weights). The sampler log-prob of each token is the batch's ``sampled_logprobs`` (every shipped sampler writes
    them); ``importance_weights=False``, or a batch without them, uses ``w = 1``. Samples become stale under grouped
    generation (``ChatDataModule(steps_per_generation=k)``: the later micro-batches of a group were sampled before
    the group's earlier optimizer steps) and with ``sampler=vllm`` synced every few steps; the weights correct that.

    The teacher's log-prob of each sampled token comes from an in-process teacher's final hidden states and head
    (no full logits), or from a sparse teacher's ``TopKSignal.next_logprobs`` (``teacher=server``). A top-k cache
    (``teacher=cache``) holds log-probs of the dataset completions only and cannot score new samples: refused.
    Under ``teacher=multi`` each teacher scores its own rows and the loss is the token mean over all of them. The
    student's loss needs its final hidden states and a head ``check_output_head`` can describe (the models whose
    heads the lean path knows); another model raises naming it (OPD has no full-logits path).

    Validation batches are the dataset completions, not samples: the surrogate means nothing there, so validation
    (``completion_loss``) logs GKD's loss, the generalized JSD (``beta``) against the teacher, and ``val/loss``
    stays comparable with GKD runs. Logged per training step: ``train/opd/reward`` (mean ``r``), ``train/opd/kl``
    (``−reward``, the sampled estimate of KL(S‖T)), ``train/opd/is_weight_mean``, ``train/opd/is_weight_max``,
    ``train/opd/is_truncated_fraction``, ``train/opd/eos_rate`` (rows whose sample ended with an EOS within
    ``max_new_tokens``), ``train/opd/divergence`` (the full-distribution term, with ``kl_coef > 0``), and GKD's
    ``train/loss`` and ``train/completion_length``.

    Args (every other argument is ``GKDModule``'s, e.g. ``sampler``, ``max_new_tokens``, ``optimizer``):
        gamma: discount of later rewards in [0, 1]: 0 = per-token reward, 1 = the whole remaining return.
        max_is_weight: truncation (> 0) of the importance weights.
        kl_coef: weight (>= 0) of the added full-distribution term.
        importance_weights: weight by ``p_S / p_sampler`` from the batch's ``sampled_logprobs``.
        lmbda, seq_kd: must stay 1 and False (OPD trains on the student's samples only).
        beta: the generalized JSD of the ``kl_coef`` term and of the validation loss (1 = reverse KL).
        temperature: the sampling temperature.
    """

    cross_tokenizer_supported = False  # the reward needs log p_T of the student's own tokens

    def __init__(
        self,
        student: ModelSource,
        teacher: TeacherSource,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        gamma: float = 0.0,
        max_is_weight: float = 2.0,
        kl_coef: float = 0.0,
        importance_weights: bool = True,
        lmbda: float = 1.0,
        seq_kd: bool = False,
        beta: float = 1.0,
        temperature: float = 1.0,
        **kwargs: Any,
    ) -> None:
        if lmbda != 1:
            raise ValueError(
                f"OPDModule trains on the student's own samples only, so lmbda must be 1.0, got {lmbda}. Drop the "
                "setting (it defaults to 1.0), or use GKDModule (method=gkd) to mix in dataset completions."
            )
        if seq_kd:
            raise ValueError(
                "OPDModule trains on the student's own samples, not the teacher's: seq_kd must be False, got True. "
                "Drop the setting (it defaults to False), or use GKDModule (method=gkd) for sequence-level KD."
            )
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma (the discount of later rewards) must be in [0, 1], got {gamma}.")
        if not max_is_weight > 0:
            raise ValueError(f"max_is_weight (the importance weights' truncation) must be > 0, got {max_is_weight}.")
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef (the full-distribution term's weight) must be >= 0, got {kl_coef}.")
        if kwargs.get("sparse_loss", "topk") in ("k1", "k3"):
            raise ValueError(
                f"sparse_loss={kwargs['sparse_loss']}: OPD's loss already is a sampled-token estimator; sparse_loss "
                "picks the full-distribution term (kl_coef) and the validation loss: set sparse_loss=topk or "
                "topk_renorm."
            )
        plan = teacher_plan(teacher)
        if any(entry.kind == "cache" or isinstance(entry.built, CacheTeacher) for entry in plan.entries.values()):
            raise ValueError(
                "teacher.kind=cache holds the teacher's log-probs of the dataset completions only, and OPD scores "
                "the student's new samples: use teacher=local (in process) or teacher=server (a vLLM server)."
            )
        super().__init__(
            student, teacher, tokenizer, lmbda=lmbda, seq_kd=seq_kd, beta=beta, temperature=temperature, **kwargs
        )
        self.gamma, self.max_is_weight, self.kl_coef = gamma, max_is_weight, kl_coef
        self.importance_weights = importance_weights

    # -- the loss -------------------------------------------------------------------------------------------------
    def completion_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Validation's loss on the dataset completions: GKD's generalized JSD (``beta``) against the teacher."""
        return super().distillation_loss(batch)

    def distillation_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The OPD loss on a batch of the student's samples (the class docstring), logging ``train/opd/*``. A token
        mean over the supervised positions, as GKD's loss (``training_step`` returns ``step_loss`` of it)."""
        if self.teacher_column is None:
            parts = [self.opd_part(batch, self.teacher_source)]
            loss = parts[0].loss
        else:
            parts = []

            def part_loss(rows: dict[str, Any], teacher: Any) -> torch.Tensor:
                parts.append(self.opd_part(rows, teacher))
                return parts[-1].loss

            loss, per_teacher = routed_loss(batch, self.teacher_column, self.teacher_sources, part_loss)
            for name, (value, tokens) in per_teacher.items():
                self.log(f"train/teacher/{name}/loss", value, batch_size=tokens, add_dataloader_idx=False)
                self.log(f"train/teacher/{name}/tokens", float(tokens), reduce_fx="sum", add_dataloader_idx=False)
        self.log_opd(parts, batch["labels"])
        return loss

    def opd_part(self, batch: dict[str, Any], teacher: Any) -> _Part:
        """The OPD loss of ``batch`` against one teacher source, with its statistics."""
        try:
            return self._opd_part(batch, teacher)
        except LeanForwardUnsupported as reason:
            raise ValueError(
                f"OPDModule computes log-probs from final hidden states and each model's head, and {reason}; OPD "
                "has no full-logits path: use models whose heads the lean loss describes (Llama, Qwen, Mistral, "
                "Gemma, ...; tests/test_ops_hf_heads.py)."
            ) from reason

    def _opd_part(self, batch: dict[str, Any], teacher: Any) -> _Part:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        positions = supervised_positions(batch["labels"])
        check_output_head(self.student, ids, mask)
        hidden = final_hidden_states(self.student, ids, mask, positions)
        head = output_head(self.student)  # after the forward: FSDP2 has gathered the root unit
        self.nonfinite_guard.record(self.model_role, hidden)
        tokens = next_tokens(ids, positions)
        divergence: torch.Tensor | None = None
        if isinstance(teacher, LocalTeacher) and teacher.top_k is None:
            teacher_hidden, teacher_head = teacher.hidden_states(batch, positions)
            self.nonfinite_guard.record("teacher", teacher_hidden)
            _, _, following = topk_log_probs(
                teacher_hidden, teacher_head, 1, next_tokens=tokens, chunk_size=self.loss_chunk_size
            )
            assert following is not None  # next_tokens were given
            teacher_logprobs = following
            if self.kl_coef > 0:
                divergence = projected_jsd_loss(
                    hidden,
                    head,
                    teacher_hidden,
                    teacher_head,
                    beta=self.beta,
                    temperature=self.loss_temperature,
                    chunk_size=self.loss_chunk_size,
                )
        else:
            signal = teacher.topk(batch, positions).to(hidden.device)
            if signal.next_logprobs is None:
                raise ValueError(
                    f"OPD's reward is the teacher's log-prob of each sampled token, which {type(teacher).__name__} "
                    "did not return (TopKSignal.next_logprobs is None): use teacher=local or teacher=server."
                )
            teacher_logprobs = signal.next_logprobs
            if self.kl_coef > 0:
                divergence = topk_distillation_loss(
                    hidden,
                    head,
                    signal.ids,
                    signal.logprobs,
                    beta=self.beta,
                    tail=self.sparse_loss == "topk",
                    chunk_size=self.loss_chunk_size,
                )
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)[positions]
        loss, stats = policy_gradient_distillation_loss(
            hidden,
            head,
            tokens,
            teacher_logprobs,
            rows=rows,
            sampler_logprobs=self._sampler_logprobs(batch, positions),
            gamma=self.gamma,
            max_weight=self.max_is_weight,
            chunk_size=self.loss_chunk_size,
        )
        if divergence is not None:
            loss = loss + self.kl_coef * divergence
        return _Part(loss, stats, None if divergence is None else divergence.detach(), int(positions.sum()))

    def _sampler_logprobs(self, batch: dict[str, Any], positions: torch.Tensor) -> torch.Tensor | None:
        """``(N,)`` the log-prob each token following a True position was sampled with (None: no weights)."""
        logprobs = batch.get("sampled_logprobs")
        if logprobs is None or not self.importance_weights:
            return None
        if logprobs.shape != batch["input_ids"].shape:
            raise ValueError(
                f"sampled_logprobs {tuple(logprobs.shape)} must match input_ids {tuple(batch['input_ids'].shape)}: "
                "the log-prob of each token at its own column (lightning_gkd.ops.sampling.completion_batch)."
            )
        return next_tokens(logprobs, positions)  # each position's next column, as for the tokens themselves

    # -- logging --------------------------------------------------------------------------------------------------
    def log_opd(self, parts: list[_Part], labels: torch.Tensor) -> None:
        """``train/opd/*``: the token-weighted statistics over the parts (teachers) of one training batch."""
        counted = [part for part in parts if part.tokens]
        if not counted:
            return
        tokens = sum(part.tokens for part in counted)

        def mean(values: list[torch.Tensor]) -> torch.Tensor:
            return (
                torch.stack([value * part.tokens for value, part in zip(values, counted, strict=True)]).sum() / tokens
            )

        reward = mean([part.stats.mean_reward for part in counted])
        self.log("train/opd/reward", reward, batch_size=tokens)
        self.log("train/opd/kl", -reward, batch_size=tokens)
        self.log("train/opd/is_weight_mean", mean([part.stats.mean_weight for part in counted]), batch_size=tokens)
        largest = torch.stack([part.stats.max_weight for part in counted]).max()
        self.log("train/opd/is_weight_max", largest, batch_size=tokens, reduce_fx="max")
        truncated = mean([part.stats.truncated_fraction for part in counted])
        self.log("train/opd/is_truncated_fraction", truncated, batch_size=tokens)
        divergences = [part.divergence for part in counted if part.divergence is not None]
        if len(divergences) == len(counted):
            self.log("train/opd/divergence", mean(divergences), batch_size=tokens)
        rate = eos_rate(labels, resolve_eos_token_id(self.student, self.tokenizer))
        if rate is not None:
            self.log("train/opd/eos_rate", rate, batch_size=labels.shape[0])


def eos_rate(labels: torch.Tensor, eos_token_id: int | list[int] | None) -> torch.Tensor | None:
    """The fraction of rows of a sampled batch (``labels`` ``(B, L)``) whose last supervised token is an EOS, i.e.
    whose sample ended within ``max_new_tokens`` (None without an EOS id or a supervised token)."""
    if eos_token_id is None:
        return None
    supervised = labels != IGNORE_INDEX
    sampled = supervised.any(dim=1)
    if not sampled.any():
        return None
    columns = torch.arange(labels.shape[1], device=labels.device)
    last = labels.gather(1, (supervised * columns).argmax(dim=1, keepdim=True)).squeeze(1)
    eos = torch.as_tensor(eos_token_id, device=labels.device).reshape(-1)
    return (torch.isin(last, eos) & sampled).float().sum() / sampled.sum()
