"""GKDModule: generalized knowledge distillation (on-policy, supervised and sequence-level KD)."""

from __future__ import annotations

from functools import partial
from typing import Any

from transformers import PreTrainedTokenizerBase

from lightning_gkd.asynchronous import AsyncSettings
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.settings import ValidationSettings
from lightning_gkd.losses.base import DistillationLoss, LossOutput
from lightning_gkd.losses.cross_tokenizer import CrossTokenizerDistillation
from lightning_gkd.losses.cross_tokenizer_plan import (
    CrossTokenizerSettings,
    cross_tokenizer_settings,
    plan_cross_tokenizer,
    unread_cross_tokenizer_settings,
)
from lightning_gkd.losses.plan import check_teacher_settings, refuse_unread_settings
from lightning_gkd.losses.settings import DivergenceSettings
from lightning_gkd.methods.base import Group, settings_group
from lightning_gkd.methods.on_policy import ENGINE_ARGUMENTS, OnPolicyModule
from lightning_gkd.models.loading import ModelSource
from lightning_gkd.rollouts import RolloutSettings
from lightning_gkd.samplers import SamplingSettings
from lightning_gkd.teachers.spec import TeacherSource, teacher_plan
from lightning_gkd.training.settings import TrainingSettings


class GKDModule(OnPolicyModule):
    """Distil a frozen ``teacher`` into a trainable ``student`` with the generalized JSD (Agarwal et al., GKD).

    Each training batch: with probability ``lmbda`` the student samples completions for the batch prompts
    (on-policy); otherwise, if ``seq_kd``, the teacher samples them; otherwise the dataset completions are used (see
    ``OnPolicyModule`` for ``sampling``, grouped generation, the engines and ``rollout``). The loss, on training
    batches and on validation's dataset completions alike, is ``distillation_loss(batch)``: the loss object
    ``self.loss`` built once from the teacher plan (``lightning_gkd.losses``) with ``divergence``
    (``DivergenceSettings``):

    - an in-process teacher: ``generalized_jsd_loss(beta)`` between student and teacher next-token distributions at
      every completion position, at ``loss_temperature`` (``DenseDistillation``). From final hidden states
      (``lean_loss``, default on): only the supervised positions are projected to logits, ``loss_chunk_size``
      positions at a time, so full B × T × V logits never exist; models whose head the lean path cannot describe
      fall back to full logits with a warning;
    - a sparse teacher (``teacher=cache|server``, or ``teacher.top_k``): ``sparse_loss`` on its top-k signal;
    - ``teacher.kind=multi``: each teacher scores its own rows; the loss is the token mean over all of them, and
      ``<train|val>/teacher/<name>/loss`` and ``.../tokens`` are logged per teacher;
    - a teacher with another tokenizer (``teacher_tokenizer``, or the teacher spec's ``tokenizer``; Hydra
      ``model.teacher.tokenizer``) when ``cross_tokenizer`` allows it (``CrossTokenizerSettings``, or a mapping as in
      conf/cross_tokenizer/; default ``enabled: auto``): ``distillation_weight`` times the projected chunk loss
      (default), chunk likelihoods, GOLD's hybrid or ULD on byte-aligned groups, plus ``crossentropy_weight`` times
      the student's cross-entropy (``CrossTokenizerDistillation``). ``cross_tokenizer`` settings other than the
      defaults are refused on any other path, ``sparse_loss`` with only full-distribution teachers,
      ``lean_loss=False`` with only sparse ones: a setting the run would not read fails before any model loads.

    ``loss``: your own loss object instead (a ``lightning_gkd.losses.DistillationLoss``: ``loss(student, batch) ->
    LossOutput``), or a factory of one (a class or ``functools.partial``; Hydra ``_partial_: true``) called with
    ``teacher=`` the teacher source (``LocalTeacher``, a cache or a server). GKD's own loss settings (``divergence``,
    ``cross_tokenizer``) then do not apply.

    ``student``/``teacher``: an ``nn.Module``, a local folder or hub id, or a spec mapping (see
    ``lightning_gkd.models.loading.load_causal_lm`` and ``lightning_gkd.teachers.spec``). ``training``
    (``TrainingSettings``): the optimizer and scheduler factories (``functools.partial(torch.optim.AdamW, lr=1e-4)``;
    Hydra ``_partial_: true``), ``seed``, ``nonfinite``, ``frozen_dtype`` (the teacher's dtype; "auto": bfloat16
    where the hardware multiplies bf16 fast, unless the teacher's dtype was chosen), ...; ``validation``
    (``ValidationSettings``): generation metrics and their completions' length.

    Every group argument takes the settings, a mapping of overrides applied onto GKD's defaults (the class's
    ``default_<group>``: TRL's ``GKDConfig`` values, e.g. ``sampling.temperature=0.9``, ``max_new_tokens=128``,
    ``divergence.beta=0.5``), or None for those: ``GKDModule(student, teacher, tokenizer, lmbda=1.0,
    sampling={"max_new_tokens": 64})``.
    """

    cross_tokenizer_supported = True  # a teacher with another tokenizer takes the cross-tokenizer loss

    def __init__(
        self,
        student: ModelSource,
        teacher: TeacherSource,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        lmbda: float = 0.5,
        seq_kd: bool = False,
        sampling: Group[SamplingSettings] = None,
        divergence: Group[DivergenceSettings] = None,
        rollout: Group[RolloutSettings] = None,
        asynchronous: Group[AsyncSettings] = None,
        cross_tokenizer: Group[CrossTokenizerSettings] = None,
        teacher_tokenizer: PreTrainedTokenizerBase | str | None = None,
        loss: DistillationLoss | Any = None,
        training: Group[TrainingSettings] = None,
        validation: Group[ValidationSettings] = None,
    ) -> None:
        divergence = settings_group(divergence, self.default_divergence, "divergence")
        plan = teacher_plan(teacher)
        check_teacher_settings(plan, divergence, lmbda=lmbda, seq_kd=seq_kd)
        tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        cross = cross_tokenizer_settings(
            cross_tokenizer, beta=divergence.beta, loss_temperature=divergence.loss_temperature
        )
        teacher_tok = plan_cross_tokenizer(
            plan,
            tokenizer,
            teacher_tokenizer,
            cross,
            owner=type(self),
            seq_kd=seq_kd,
            sparse_loss=divergence.sparse_loss,
        )
        if loss is None and teacher_tok is None:  # GKD's usual loss: refuse what it would not read
            unread_cross_tokenizer_settings(
                cross_tokenizer, beta=divergence.beta, loss_temperature=divergence.loss_temperature
            )
            refuse_unread_settings(plan, divergence, owner=type(self).__name__)
        super().__init__(
            student,
            plan,
            tokenizer,
            lmbda=lmbda,
            seq_kd=seq_kd,
            sampling=sampling,
            divergence=divergence,
            rollout=rollout,
            asynchronous=asynchronous,
            training=training,
            validation=validation,
            same_vocab=teacher_tok is None,
        )
        #: The cross-tokenizer settings as used (nulls resolved to ``divergence``'s).
        self.cross_tokenizer = cross
        #: The loss object ``distillation_loss`` calls (``lightning_gkd.losses``), chosen once here.
        self.loss: DistillationLoss
        if loss is not None:
            self.loss = self._user_loss(loss)
        elif teacher_tok is not None:
            self.loss = CrossTokenizerDistillation(
                self.teacher_source,
                self.tokenizer,
                teacher_tok,
                cross,
                student=self.student,
                max_new_tokens=self.sampling.max_new_tokens,
                lean=self.lean_path,
            )
        else:
            self.loss = self.divergence_loss()
        self.save_settings("student", "teacher", "tokenizer", "teacher_tokenizer", "loss", *ENGINE_ARGUMENTS)

    def settings_groups(self) -> dict[str, Any]:
        return {**super().settings_groups(), "cross_tokenizer": self.cross_tokenizer.as_dict()}

    def _user_loss(self, loss: Any) -> DistillationLoss:
        """``loss`` itself, or what a factory (a class, a ``functools.partial``) makes with the teacher; TypeError for
        anything but a ``DistillationLoss``."""
        if isinstance(loss, (type, partial)):
            if self.teacher_source is None:
                raise ValueError(
                    "A loss factory (GKDModule(loss=<class or partial>), Hydra method.loss with _partial_: true) is "
                    "called with the one teacher, and teacher.kind=multi has several: pass a built loss object, or "
                    "use one teacher."
                )
            loss = loss(teacher=self.teacher_source)
        if not isinstance(loss, DistillationLoss):
            raise TypeError(
                f"GKDModule(loss=...) takes a lightning_gkd.losses.DistillationLoss (or a factory of one), got "
                f"{type(loss).__name__}: subclass DistillationLoss and implement __call__(student, batch) -> "
                "LossOutput (its check_datamodule and close do nothing unless overridden)."
            )
        return loss

    def distillation_loss(self, batch: dict[str, Any]) -> LossOutput:
        """GKD's loss hook: ``self.loss`` on ``batch`` (``input_ids``, ``attention_mask``, ``labels``: dataset
        completions or samples). Override it for another objective (docs/customization.md); ``training_step`` and
        validation both call it."""
        return self.loss(self.student, batch)

    def training_loss(self, batch: dict[str, Any]) -> LossOutput:
        return self.distillation_loss(batch)

    def completion_loss(self, batch: dict[str, Any]) -> LossOutput:
        return self.distillation_loss(batch)
