"""GKDModule: generalized knowledge distillation (on-policy, supervised and sequence-level KD)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.metrics import GenerationMetric
from lightning_gkd.losses.base import DistillationLoss, LossOutput
from lightning_gkd.losses.cross_tokenizer import CrossTokenizerDistillation
from lightning_gkd.losses.cross_tokenizer_plan import (
    cross_tokenizer_settings,
    plan_cross_tokenizer,
    unread_cross_tokenizer_settings,
)
from lightning_gkd.losses.plan import SparseLoss, check_teacher_settings, refuse_unread_settings
from lightning_gkd.methods.base import NonFinitePolicy, OptimizerFactory, SchedulerFactory
from lightning_gkd.methods.on_policy import OnPolicyModule, check_range
from lightning_gkd.models.loading import ModelSource
from lightning_gkd.rollouts import ToolCallParser
from lightning_gkd.samplers import Sampler, SamplerFactory
from lightning_gkd.teachers.spec import TeacherSource, teacher_plan
from lightning_gkd.training.normalization import LossNormalization

# objects, not settings: kept out of checkpoints' hyper_parameters
_NOT_HYPERPARAMETERS = (
    "student teacher tokenizer teacher_tokenizer optimizer scheduler metrics sampler loss tools environment tool_parser"
)


class GKDModule(OnPolicyModule):
    """Distil a frozen ``teacher`` into a trainable ``student`` with the generalized JSD (Agarwal et al., GKD).

    Each training batch: with probability ``lmbda`` the student samples completions for the batch prompts
    (on-policy); otherwise, if ``seq_kd``, the teacher samples them; otherwise the dataset completions are used (see
    ``OnPolicyModule`` for sampling, grouped generation and the engines). The loss, on training batches and on
    validation's dataset completions alike, is ``distillation_loss(batch)``: the loss object ``self.loss`` built
    once from the teacher plan (``lightning_gkd.losses``):

    - an in-process teacher: ``generalized_jsd_loss(beta)`` between student and teacher next-token distributions at
      every completion position, at ``loss_temperature`` (``DenseDistillation``). From final hidden states
      (``lean_loss``, default on): only the supervised positions are projected to logits, ``loss_chunk_size``
      positions at a time, so full B × T × V logits never exist; models whose head the lean path cannot describe
      fall back to full logits with a warning;
    - a sparse teacher (``teacher=cache|server``, or ``teacher.top_k``): ``sparse_loss`` on its top-k signal;
    - ``teacher.kind=multi``: each teacher scores its own rows; the loss is the token mean over all of them, and
      ``<train|val>/teacher/<name>/loss`` and ``.../tokens`` are logged per teacher;
    - a teacher with another tokenizer (``teacher_tokenizer``, or the teacher spec's ``tokenizer``; Hydra
      ``model.teacher.tokenizer``) when ``cross_tokenizer`` allows it (default ``enabled: auto``):
      ``distillation_weight`` times the projected chunk loss (default), chunk likelihoods, GOLD's hybrid or ULD on
      byte-aligned groups, plus ``crossentropy_weight`` times the student's cross-entropy
      (``CrossTokenizerDistillation``). Those two weights and non-default ``cross_tokenizer`` loss settings are
      refused on any other path, ``sparse_loss`` with only full-distribution teachers, ``lean_loss=False`` with
      only sparse ones: a setting the run would not read fails before any model loads.

    ``loss``: your own loss object instead (``loss(student, batch) -> LossOutput``, see
    ``lightning_gkd.losses.base.DistillationLoss``), or a factory (a class or ``functools.partial``; Hydra
    ``_partial_: true``) called with ``teacher=`` the teacher source (``LocalTeacher``, a cache or a server). GKD's
    own loss settings (``beta``, ``loss_temperature``, ``sparse_loss``, ``lean_loss``, ``cross_tokenizer`` and its
    weights) then do not apply.

    ``student``/``teacher``: an ``nn.Module``, a local folder or hub id, or a spec mapping (see
    ``lightning_gkd.models.loading.load_causal_lm`` and ``lightning_gkd.teachers.spec``). ``optimizer``/``scheduler``:
    factories such as ``functools.partial(torch.optim.AdamW, lr=1e-4)`` (Hydra: ``_partial_: true``); the scheduler
    steps every optimizer step. ``nonfinite``: ``"raise"`` (default) stops on a non-finite loss naming the step and
    the model with non-finite logits; ``"skip"`` skips such batches with a warning. ``frozen_dtype``: the teacher's
    dtype ("auto": bfloat16 where the hardware multiplies bf16 fast, unless the teacher's dtype was chosen: a spec's
    ``init_kwargs.dtype``, or an ``nn.Module`` not in float32; see ``lightning_gkd.models.precision``).
    """

    cross_tokenizer_supported = True  # a teacher with another tokenizer takes the cross-tokenizer loss

    def __init__(
        self,
        student: ModelSource,
        teacher: TeacherSource,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        lmbda: float = 0.5,
        beta: float = 0.5,
        temperature: float = 0.9,
        loss_temperature: float = 1.0,
        seq_kd: bool = False,
        max_new_tokens: int = 128,
        top_k: int = 0,
        top_p: float = 1.0,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        trust_remote_code: bool = False,
        seed: int = 0,
        metrics: Mapping[str, GenerationMetric] | None = None,
        eval_max_new_tokens: int = 32,
        nonfinite: NonFinitePolicy = "raise",
        loss_normalization: LossNormalization = "step",
        lean_loss: bool = True,
        loss_chunk_size: int = 64,
        sampler: Sampler | SamplerFactory | None = None,
        frozen_dtype: str = "auto",
        tools: Sequence[Callable[..., Any] | str] | None = None,
        environment: Callable[..., Any] | str | None = None,
        max_tool_calling_iterations: int = 5,
        tool_timeout: float = 10.0,
        max_transcript_tokens: int | None = None,
        tool_state_columns: Sequence[str] = (),
        tool_parser: ToolCallParser | None = None,
        sparse_loss: SparseLoss = "topk",
        teacher_tokenizer: PreTrainedTokenizerBase | str | None = None,
        cross_tokenizer: Mapping[str, Any] | Any = None,
        crossentropy_weight: float = 0.0,
        distillation_weight: float = 1.0,
        loss: DistillationLoss | Any = None,
    ) -> None:
        plan = teacher_plan(teacher)
        check_teacher_settings(
            plan, lmbda=lmbda, beta=beta, seq_kd=seq_kd, loss_temperature=loss_temperature, sparse_loss=sparse_loss
        )
        check_range("beta", beta, 0.0, 1.0)
        if not loss_temperature > 0:
            raise ValueError(f"loss_temperature must be > 0, got {loss_temperature}.")
        check_range("crossentropy_weight", crossentropy_weight, 0.0, float("inf"))
        check_range("distillation_weight", distillation_weight, 0.0, float("inf"))
        tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        cross = cross_tokenizer_settings(cross_tokenizer, beta=beta, loss_temperature=loss_temperature)
        teacher_tok = plan_cross_tokenizer(
            plan, tokenizer, teacher_tokenizer, cross, owner=type(self), seq_kd=seq_kd, sparse_loss=sparse_loss
        )
        if loss is None and teacher_tok is None:  # GKD's usual loss: refuse what it would not read
            unread_cross_tokenizer_settings(
                cross_tokenizer, distillation_weight=distillation_weight, crossentropy_weight=crossentropy_weight
            )
            refuse_unread_settings(plan, sparse_loss=sparse_loss, lean_loss=lean_loss, owner=type(self).__name__)
        super().__init__(
            student,
            plan,
            tokenizer,
            lmbda=lmbda,
            seq_kd=seq_kd,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            top_k=top_k,
            top_p=top_p,
            sampler=sampler,
            lean_loss=lean_loss,
            loss_chunk_size=loss_chunk_size,
            same_vocab=teacher_tok is None,
            trust_remote_code=trust_remote_code,
            optimizer=optimizer,
            scheduler=scheduler,
            disable_dropout=disable_dropout,
            gradient_checkpointing=gradient_checkpointing,
            seed=seed,
            metrics=metrics,
            eval_max_new_tokens=eval_max_new_tokens,
            nonfinite=nonfinite,
            loss_normalization=loss_normalization,
            frozen_dtype=frozen_dtype,
            tools=tools,
            environment=environment,
            max_tool_calling_iterations=max_tool_calling_iterations,
            tool_timeout=tool_timeout,
            max_transcript_tokens=max_transcript_tokens,
            tool_state_columns=tool_state_columns,
            tool_parser=tool_parser,
        )
        self.beta, self.loss_temperature, self.sparse_loss = beta, loss_temperature, sparse_loss
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
                distillation_weight=distillation_weight,
                crossentropy_weight=crossentropy_weight,
                max_new_tokens=max_new_tokens,
                lean=self.lean_path,
            )
        else:
            self.loss = self.divergence_loss(beta=beta, temperature=loss_temperature, sparse_loss=sparse_loss)
        cross_tokenizer = cross.as_dict()  # saved as used (nulls resolved), plain values: weights-only checkpoints
        self.save_hyperparameters(ignore=_NOT_HYPERPARAMETERS.split())

    def _user_loss(self, loss: Any) -> DistillationLoss:
        """``loss`` itself, or what a factory (a class, a ``functools.partial``) makes with the teacher."""
        if not isinstance(loss, (type, partial)):
            return loss
        if self.teacher_source is None:
            raise ValueError(
                "A loss factory (GKDModule(loss=<class or partial>), Hydra method.loss with _partial_: true) is "
                "called with the one teacher, and teacher.kind=multi has several: pass a built loss object, or use "
                "one teacher."
            )
        return loss(teacher=self.teacher_source)

    def distillation_loss(self, batch: dict[str, Any]) -> LossOutput:
        """GKD's loss hook: ``self.loss`` on ``batch`` (``input_ids``, ``attention_mask``, ``labels``: dataset
        completions or samples). Override it for another objective (docs/customization.md); ``training_step`` and
        validation both call it."""
        return self.loss(self.student, batch)

    def training_loss(self, batch: dict[str, Any]) -> LossOutput:
        return self.distillation_loss(batch)

    def completion_loss(self, batch: dict[str, Any]) -> LossOutput:
        return self.distillation_loss(batch)
