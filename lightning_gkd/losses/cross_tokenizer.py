"""GKD with a teacher whose tokenizer differs from the student's (cross-tokenizer distillation), as a loss object.

Both models score the same completion *text*. For every batch (dataset completions, the student's samples,
validation) the student's completions are decoded with byte spans (``data.retokenize.student_completions``),
re-tokenized for the teacher after its own chat template of the rows' prompt messages (``teacher_batch``), and the
two tokenizations are compared group by group (``ops.aligned_row_loss``: byte-span alignment, then each group's
likelihood under both models and the teacher's projected first-token distribution (``projected``, the default;
``ops.chunk_likelihood``), the likelihoods alone, or merged probabilities with GOLD's hybrid loss or ULD). Only the
completion positions are projected to logits (``[N, V]`` per model, from final hidden states; full logits where the
lean forward is unsupported).

The batch loss is the mean over *all aligned groups of the batch* (a row weighs by its group count; TRL averages
per-row means instead), times the settings' ``distillation_weight``, plus ``crossentropy_weight`` times the student's
cross-entropy on its completion tokens (a token mean). Its ``count`` is the group count, so the optimizer step's
normaliser counts groups, not student tokens.

Who decides: ``cross_tokenizer_plan.plan_cross_tokenizer`` (before any model loads) compares the teacher's
tokenizer with the student's (``get_vocab()`` equal = the same tokenizer: GKD's usual path) and refuses what the
cross path cannot do.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.retokenize import student_completions, teacher_batch
from lightning_gkd.data.token_projection import ProjectionTables, projection_tables
from lightning_gkd.losses.base import DistillationLoss, LeanPath, Logged, LossOutput, finite_flag
from lightning_gkd.losses.cross_tokenizer_plan import CrossTokenizerSettings, check_cross_tokenizer_datamodule
from lightning_gkd.models.loading import vocab_size
from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import (
    cross_tokenizer_batch_loss,
    cross_tokenizer_row_terms,
    matched_vocabulary,
)
from lightning_gkd.ops.hf.forward import resolve_eos_token_id
from lightning_gkd.ops.hf.heads import hidden_states_and_head
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits
from lightning_gkd.teachers.base import supervised_positions
from lightning_gkd.teachers.local import LocalTeacher


class CrossTokenizerDistillation(DistillationLoss):
    """The cross-tokenizer loss of a batch (see the module docstring) against ``teacher`` (an in-process model with
    ``teacher_tokenizer``). The matched vocabulary (token strings both tokenizers hold, within both models' logit
    columns) and the projection tables are computed once, here.

    Logged: ``cross_tokenizer/groups`` (aligned groups per batch), and ``cross_tokenizer/matched`` /
    ``cross_tokenizer/unmatched`` (the hybrid's unweighted parts, group means) and ``cross_tokenizer/crossentropy``
    (with ``settings.crossentropy_weight > 0``). ``max_new_tokens``: how much longer than the datamodule's
    ``max_length`` a sampled row can be (the teacher's input budget, ``check_datamodule``)."""

    def __init__(
        self,
        teacher: LocalTeacher,
        student_tokenizer: PreTrainedTokenizerBase,
        teacher_tokenizer: PreTrainedTokenizerBase,
        settings: CrossTokenizerSettings,
        *,
        student: nn.Module,
        max_new_tokens: int = 0,
        lean: LeanPath | None = None,
    ) -> None:
        self.teacher = teacher
        self.student_tokenizer, self.teacher_tokenizer = student_tokenizer, teacher_tokenizer
        self.settings, self.loss_settings = settings, settings.loss
        eos = resolve_eos_token_id(student, student_tokenizer)  # a sample ends at any of the model's EOS ids
        self.student_end_ids: Collection[int] = {eos} if isinstance(eos, int) else set(eos or [])
        if student_tokenizer.eos_token_id is not None:
            self.student_end_ids = {*self.student_end_ids, student_tokenizer.eos_token_id}
        self.lean = lean or LeanPath()
        student_width, teacher_width = vocab_size(student), vocab_size(teacher.model)
        if teacher_width is not None and len(teacher_tokenizer) > teacher_width:
            raise ValueError(
                f"The teacher's tokenizer ({getattr(teacher_tokenizer, 'name_or_path', '')!r}) has "
                f"{len(teacher_tokenizer)} tokens but the teacher model's vocabulary has {teacher_width}: give the "
                "teacher its own tokenizer (Python: teacher_tokenizer=...; Hydra: model.teacher.tokenizer=<its "
                "folder or hub id>, null takes the teacher's folder)."
            )
        self.matched: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.loss_settings.loss == "hybrid":
            s_ids, t_ids = matched_vocabulary(student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab())
            keep = (s_ids < (student_width or len(student_tokenizer))) & (t_ids < (teacher_width or 1 << 62))
            self.matched = (s_ids[keep], t_ids[keep])
        self._matched_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.projection: ProjectionTables | None = None
        if self.loss_settings.loss == "projected":
            self.projection = projection_tables(student_tokenizer, teacher_tokenizer, settings.projection_cache)
            self.projection.first_token[self.projection.first_token >= (student_width or len(student_tokenizer))] = -1
        positions = getattr(getattr(teacher.model, "config", None), "max_position_embeddings", None)
        self.teacher_positions: int | None = int(positions) if isinstance(positions, int) else None
        self.max_length = settings.teacher_max_length or self.teacher_positions or 1 << 20
        self.max_new_tokens = max_new_tokens  # the samples' length beyond the datamodule's max_length
        self.tools: list[dict] | None = None  # the schemas the teacher's template renders (multi-turn rollouts)
        self.max_context_tokens: int | None = None  # a rollout's student contexts, when longer than max_length

    def check_datamodule(self, datamodule: Any) -> None:
        """Ask ``datamodule`` for the rows' prompt messages (``check_cross_tokenizer_datamodule``) and set the
        teacher's input budget when ``teacher_max_length`` is null: the student's (the datamodule's ``max_length``
        plus ``max_new_tokens``), at most the teacher's positions."""
        check_cross_tokenizer_datamodule(datamodule)
        student_max_length = self.max_context_tokens or getattr(datamodule, "max_length", None)
        if self.settings.teacher_max_length is None and student_max_length:
            budget = student_max_length + self.max_new_tokens
            self.max_length = min(budget, self.teacher_positions) if self.teacher_positions else budget

    def use_tools(self, tools: list[dict] | None, *, max_context_tokens: int | None) -> None:
        """Each row is then one student turn of a rollout, its context the turn's messages: the teacher renders them
        with ``tools``' schemas through its own template (checked: it must render tools and tool messages), and its
        input budget covers contexts of ``max_context_tokens`` (when ``teacher_max_length`` is null)."""
        from lightning_gkd.rollouts.templates import check_template_renders_tools

        check_template_renders_tools(self.teacher_tokenizer, tools)
        self.tools, self.max_context_tokens = tools, max_context_tokens

    @property
    def matched_count(self) -> int:
        return 0 if self.matched is None else int(self.matched[0].numel())

    def _matched(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.matched is None:
            return None
        if device not in self._matched_on:
            self._matched_on[device] = (self.matched[0].to(device), self.matched[1].to(device))
        return self._matched_on[device]

    def _projection(self, device: torch.device) -> ProjectionTables | None:
        """The projection tables on ``device`` (moved once, not per batch)."""
        if self.projection is None:
            return None
        if self.projection.device != device:
            self.projection = self.projection.to(device)
        return self.projection

    def teacher_inputs(self, batch: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """The student's completions of ``batch`` and the teacher's batch of the same texts."""
        messages = batch.get("prompt_messages")
        if messages is None:
            raise ValueError(
                "The batch has no 'prompt_messages': the cross-tokenizer teacher renders each row's prompt with its "
                "own chat template. Fit with a ChatDataModule (GKDModule.check_datamodule calls its "
                "carry_prompt_messages()), or collate with ChatMLCollator(..., carry_prompt_messages=True)."
            )
        completions = student_completions(self.student_tokenizer, batch, end_ids=self.student_end_ids)
        teacher = teacher_batch(
            self.teacher_tokenizer,
            messages,
            [c.text for c in completions],
            max_length=self.max_length,
            tools=self.tools,
        )
        return completions, teacher

    def _logits(
        self, student: nn.Module, batch: Mapping[str, Any], t_batch: Mapping[str, torch.Tensor], *, lean: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both models' logits at their completion positions, and what the non-finite guard reads of each (hidden
        states on the lean path, else the logits)."""
        s_positions = supervised_positions(batch["labels"])
        t_positions = supervised_positions(t_batch["labels"])
        if lean:
            hidden, head = hidden_states_and_head(
                student, batch["input_ids"], batch["attention_mask"], s_positions, batch.get("vision")
            )
            t_hidden, t_head = self.teacher.hidden_states(t_batch, t_positions)
            with torch.no_grad():
                t_logits = t_head.logits(t_hidden)
            return head.logits(hidden), hidden, t_logits, t_hidden
        s_logits = causal_lm_logits(student, batch)[s_positions]
        t_logits = self.teacher.logits(t_batch)[t_positions]
        return s_logits, s_logits, t_logits, t_logits

    def __call__(self, student: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        """The loss of ``batch`` (``input_ids``, ``attention_mask``, ``labels``, ``prompt_messages``)."""
        completions, teacher_rows = self.teacher_inputs(batch)
        device = batch["input_ids"].device
        t_batch = {key: teacher_rows[key].to(device) for key in ("input_ids", "attention_mask", "labels")}
        s_logits, s_states, t_logits, t_states = self.lean.run(
            lambda: self._logits(student, batch, t_batch, lean=True),
            lambda: self._logits(student, batch, t_batch, lean=False),
            loss_name="cross-tokenizer",
        )
        matched = self._matched(device)
        projection = self._projection(device)
        if self.loss_settings.loss in ("likelihood", "projected"):  # the whole batch at once, vectorised
            distances = cross_tokenizer_batch_loss(
                s_logits,
                t_logits,
                [c.ids for c in completions],
                teacher_rows["completion_ids"],
                [c.spans for c in completions],
                teacher_rows["completion_spans"],
                settings=self.loss_settings,
                projection=projection,
            )
            terms = []
        else:
            s_rows = s_logits.split([len(c.ids) for c in completions])
            t_rows = t_logits.split([len(ids) for ids in teacher_rows["completion_ids"]])
            terms = [
                cross_tokenizer_row_terms(
                    s_row,
                    t_row,
                    completion.ids,
                    t_ids,
                    completion.spans,
                    t_spans,
                    settings=self.loss_settings,
                    matched=matched,
                )
                for s_row, t_row, completion, t_ids, t_spans in zip(
                    s_rows,
                    t_rows,
                    completions,
                    teacher_rows["completion_ids"],
                    teacher_rows["completion_spans"],
                    strict=True,
                )
            ]
            distances = torch.cat([term.loss for term in terms]) if terms else s_logits.new_zeros(0)
        groups = int(distances.numel())
        loss = distances.mean() if groups else s_logits.sum() * 0.0
        rows = float(batch["input_ids"].shape[0])
        logs = {"cross_tokenizer/groups": Logged(float(groups), rows)}
        if groups and self.loss_settings.loss == "hybrid":
            matched_part = torch.cat([t.matched for t in terms if t.matched is not None]).detach().mean()
            unmatched_part = torch.cat([t.unmatched for t in terms if t.unmatched is not None]).detach().mean()
            logs["cross_tokenizer/matched"] = Logged(matched_part, float(groups))
            logs["cross_tokenizer/unmatched"] = Logged(unmatched_part, float(groups))
        if self.settings.distillation_weight != 1.0:
            loss = self.settings.distillation_weight * loss
        if self.settings.crossentropy_weight > 0:
            targets = torch.tensor([i for c in completions for i in c.ids], dtype=torch.long, device=device)
            crossentropy = F.cross_entropy(s_logits, targets) if targets.numel() else s_logits.sum() * 0.0
            loss = loss + self.settings.crossentropy_weight * crossentropy
            logs["cross_tokenizer/crossentropy"] = Logged(crossentropy.detach(), float(max(groups, 1)))
        finite = {"student": finite_flag(s_states), "teacher": finite_flag(t_states)}
        return LossOutput(loss, torch.tensor(groups, device=device), logs, finite)
