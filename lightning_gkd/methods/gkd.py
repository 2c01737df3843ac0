"""GKDModule: generalized knowledge distillation (on-policy, supervised and sequence-level KD)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.metrics import GenerationMetric
from lightning_gkd.methods.base import CausalLMModule, NonFinitePolicy, OptimizerFactory, SchedulerFactory
from lightning_gkd.methods.cross_tokenizer import cross_tokenizer_loss, cross_tokenizer_step
from lightning_gkd.methods.cross_tokenizer_plan import cross_tokenizer_settings, plan_cross_tokenizer
from lightning_gkd.methods.gkd_teachers import (
    SparseLoss,
    TeacherSource,
    build_teachers,
    check_teacher_settings,
    routed_loss,
    server_sampler,
    sparse_teacher_loss,
)
from lightning_gkd.methods.grouped_generation import GroupedGeneration, Source
from lightning_gkd.models.loading import ModelSource
from lightning_gkd.ops.chunked_jsd import projected_jsd_loss
from lightning_gkd.ops.hf import LeanForwardUnsupported, check_output_head, final_hidden_states, output_head
from lightning_gkd.ops.losses import IGNORE_INDEX, generalized_jsd_loss
from lightning_gkd.ops.sampling import validate_sampling_args
from lightning_gkd.samplers import KVCacheSampler, Sampler, SamplerFactory, build_sampler, check_sampler_available
from lightning_gkd.teachers import LocalTeacher, Teacher, supervised_positions
from lightning_gkd.teachers.spec import teacher_plan
from lightning_gkd.training.normalization import LossNormalization
from lightning_gkd.training.sampler_shutdown import SamplerShutdown
from lightning_gkd.training.teacher_outage import TeacherOutage

_COIN = 0  # the coin flip's salt (the sampler's and the shuffle's: lightning_gkd.methods.grouped_generation)
# objects, not settings: kept out of checkpoints' hyper_parameters
_NOT_HYPERPARAMETERS = "student teacher tokenizer teacher_tokenizer optimizer scheduler metrics sampler"


class GKDModule(GroupedGeneration, CausalLMModule):
    """Distil a frozen ``teacher`` into a trainable ``student`` with the generalized JSD (Agarwal et al., GKD).

    Each training batch: with probability ``lmbda`` the student samples completions for the batch prompts
    (on-policy); otherwise, if ``seq_kd``, the teacher samples them; otherwise the dataset completions are used.
    The loss is ``generalized_jsd_loss(beta)`` between student and teacher next-token distributions at every
    completion position, at ``loss_temperature``. Sampling uses ``temperature``, ``top_k``, ``top_p`` and at most
    ``max_new_tokens`` new tokens, always with the KV cache. The coin flip and the sampler's seed are functions of
    (``seed``, global step, batch index), so every rank flips the same coin and a resumed run repeats them.

    Grouped generation (``ChatDataModule(steps_per_generation=k)``): the coin is flipped once per group of ``k``
    micro-batches; when it says sample, one sampling call covers the group's ``k * batch_size`` prompts, the result
    is shuffled (seeded like the sampler) and cut into ``k`` micro-batches, one training step each. The pending
    micro-batches are saved in checkpoints, so a run resumed in the middle of a group trains on the same samples.

    The loss is computed from final hidden states (``lean_loss``, default on): only the supervised positions are
    projected to logits, ``loss_chunk_size`` positions at a time (``projected_jsd_loss``), so full B × T × V
    logits never exist. Models without a bias-free ``lm_head``/``logits_to_keep`` fall back to full logits.

    ``student``/``teacher``: an ``nn.Module``, a local folder or hub id, or a spec mapping (see
    ``lightning_gkd.models.loading.load_causal_lm``). ``optimizer``/``scheduler``: factories such as
    ``functools.partial(torch.optim.AdamW, lr=1e-4)`` (Hydra: ``_partial_: true``); the scheduler steps every
    optimizer step. ``nonfinite``: ``"raise"`` (default) stops on a non-finite loss naming the step and the model
    with non-finite logits; ``"skip"`` skips such batches with a warning. ``frozen_dtype``: the teacher's dtype
    ("auto": bfloat16 where the hardware multiplies bf16 fast, unless the teacher's dtype was chosen; see
    ``lightning_gkd.models.precision``).

    A teacher with another tokenizer (``teacher_tokenizer``, or the teacher spec's ``tokenizer``; Hydra
    ``model.teacher.tokenizer``) takes the cross-tokenizer path when ``cross_tokenizer`` allows it (default
    ``enabled: auto``): ``distillation_weight`` times the projected chunk loss (default), chunk likelihoods, GOLD's
    hybrid or ULD on byte-aligned groups, plus
    ``crossentropy_weight`` times the student's cross-entropy (``lightning_gkd.methods.cross_tokenizer``).
    """

    cross_tokenizer_supported = True  # whether a teacher with another tokenizer is (OPDModule: no)
    frozen_names = ("teacher",)
    model_role = "student"
    loss_hook = "distillation_loss"

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
        sparse_loss: SparseLoss = "topk",
        teacher_tokenizer: PreTrainedTokenizerBase | str | None = None,
        cross_tokenizer: Mapping[str, Any] | Any = None,
        crossentropy_weight: float = 0.0,
        distillation_weight: float = 1.0,
    ) -> None:
        check_sampler_available(sampler)  # before any model loads
        plan = teacher_plan(teacher)
        check_teacher_settings(
            plan, lmbda=lmbda, beta=beta, seq_kd=seq_kd, loss_temperature=loss_temperature, sparse_loss=sparse_loss
        )
        _check_range("lmbda", lmbda, 0.0, 1.0)
        if loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be >= 1, got {loss_chunk_size}.")
        _check_range("beta", beta, 0.0, 1.0)
        if not loss_temperature > 0:
            raise ValueError(f"loss_temperature must be > 0, got {loss_temperature}.")
        validate_sampling_args(max_new_tokens, temperature, top_k, top_p)
        tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        cross = cross_tokenizer_settings(cross_tokenizer, beta=beta, loss_temperature=loss_temperature)
        teacher_tok = plan_cross_tokenizer(
            plan, tokenizer, teacher_tokenizer, cross, owner=type(self), seq_kd=seq_kd, sparse_loss=sparse_loss
        )
        _check_range("crossentropy_weight", crossentropy_weight, 0.0, float("inf"))
        _check_range("distillation_weight", distillation_weight, 0.0, float("inf"))
        super().__init__(
            student,
            tokenizer,
            optimizer=optimizer,
            scheduler=scheduler,
            disable_dropout=disable_dropout,
            gradient_checkpointing=gradient_checkpointing,
            trust_remote_code=trust_remote_code,
            seed=seed,
            metrics=metrics,
            eval_max_new_tokens=eval_max_new_tokens,
            nonfinite=nonfinite,
            loss_normalization=loss_normalization,
            frozen_dtype=frozen_dtype,
        )
        #: Where the loss reads each teacher's signal (``lightning_gkd.teachers``), by name (``""``: the only one).
        self.teacher_sources, models = build_teachers(
            plan,
            lambda source, role: self.load_frozen(source, role=role, trust_remote_code=trust_remote_code),
            self.student,
            self.tokenizer,
            same_vocab=teacher_tok is None,
        )
        self.teacher_column = plan.column
        #: The in-process teacher model (an ``nn.ModuleDict`` by name under ``multi``; None without one).
        self.teacher: torch.nn.Module | None = torch.nn.ModuleDict(models) if plan.routed else models.get("")
        if plan.routed and any(role.startswith("teacher.") for role in self._frozen_dtype_open):
            self._frozen_dtype_open.add("teacher")
        #: The only teacher's source (None under ``multi``: see ``teacher_sources``).
        self.teacher_source: Teacher | Any = None if plan.routed else self.teacher_sources[""]
        self.sparse_loss = sparse_loss
        #: The cross-tokenizer loss (None: GKD's usual path, one tokenizer), its weights and last group count.
        self.cross_tokenizer = cross_tokenizer_step(self.tokenizer, teacher_tok, cross, self.student, models, lean_loss)
        self.crossentropy_weight, self.distillation_weight = crossentropy_weight, distillation_weight
        self.cross_tokenizer_groups = 0
        #: seq_kd with a served teacher: the server writes the teacher's completions (None: ``sampler`` does).
        self.teacher_sampler: Sampler | None = None
        if seq_kd and self.teacher is None:
            self.teacher_sampler = server_sampler(
                self.teacher_source,
                self.student,
                self.tokenizer,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
            )
        #: How completions are sampled (``lightning_gkd.samplers``): our KV-cache decoder unless one is given; a
        #: factory (Hydra ``sampler=hf|vllm``) is called with the tokenizer and the sampling options above.
        self.sampler: Sampler = build_sampler(
            sampler or KVCacheSampler,
            self.tokenizer,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        self.lmbda, self.beta, self.seq_kd = lmbda, beta, seq_kd
        self.temperature, self.loss_temperature = temperature, loss_temperature
        self.max_new_tokens, self.top_k, self.top_p = max_new_tokens, top_k, top_p
        self.lean_loss, self.loss_chunk_size = lean_loss, loss_chunk_size
        self._batches = self._on_policy_batches = 0
        self._group = None
        self.sampling_calls = 0  # sampling calls in this process's current fit
        cross_tokenizer = cross.as_dict()  # saved as used (nulls resolved), plain values: weights-only checkpoints
        self.save_hyperparameters(ignore=_NOT_HYPERPARAMETERS.split())

    @property
    def student(self) -> torch.nn.Module:
        """The trainable model (``self.model``)."""
        return self.model

    def completion_requirement(self) -> str | None:
        if self.lmbda >= 1 or self.seq_kd:
            return None
        return (
            f"GKDModule(lmbda={self.lmbda}, seq_kd=False) trains on the dataset completions in about "
            f"{1 - self.lmbda:.0%} of the steps. End every training row with an assistant message, or train "
            "without dataset completions: lmbda=1.0 (student samples only; Hydra: method.lmbda=1.0) or "
            "seq_kd=True (teacher samples; method.seq_kd=true)."
        )

    def on_train_start(self) -> None:
        super().on_train_start()
        self._batches = self._on_policy_batches = self.sampling_calls = 0

    # -- the sampling engine's lifecycle (a serving engine such as VLLMSampler; KVCacheSampler has none) ---------
    def setup(self, stage: str) -> None:
        super().setup(stage)
        start = getattr(self.sampler, "start", None)
        if callable(start):  # the engines' length, before callbacks (held-out evaluation) first use them
            max_length = getattr(getattr(self._trainer, "datamodule", None), "max_length", None)
            start(
                {},
                max_model_len=max_length + max(self.max_new_tokens, self.eval_max_new_tokens) if max_length else None,
            )

    def on_fit_start(self) -> None:
        super().on_fit_start()
        start = getattr(self.sampler, "start", None)
        if callable(start):  # engines start from the weights as fitting starts (after a checkpoint restore)
            start({"student": self.student, **({"teacher": self.teacher} if self.seq_kd and self.teacher else {})})

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        weights_updated = getattr(self.sampler, "weights_updated", None)
        if callable(weights_updated):  # the step about to run changes the student: its engine re-syncs when due
            weights_updated()

    def configure_callbacks(self) -> list[L.Callback]:
        # an interrupted fit calls no module hook: this callback stops the engines then (SIGTERM, errors)
        callbacks: list[L.Callback] = [SamplerShutdown()] if callable(getattr(self.sampler, "close", None)) else []
        if any(not isinstance(source, LocalTeacher) for source in self.teacher_sources.values()):
            callbacks.append(TeacherOutage())  # a teacher server that stays down: checkpoint, resume hint
        return callbacks

    def check_datamodule(self, datamodule: L.LightningDataModule) -> None:
        super().check_datamodule(datamodule)
        if self.teacher_column is not None:
            carry = getattr(datamodule, "carry_columns", None)
            if not callable(carry):
                raise TypeError(
                    f"teacher.kind=multi routes rows by their {self.teacher_column!r} column: use a datamodule "
                    f"with carry_columns (ChatDataModule), not {type(datamodule).__name__}."
                )
            carry([self.teacher_column])
        if self.cross_tokenizer is not None:  # the teacher renders each row's prompt messages with its own template
            self.cross_tokenizer.check_datamodule(datamodule, self.max_new_tokens)
        for source in self.teacher_sources.values():
            check = getattr(source, "check_datamodule", None)
            if callable(check):  # a cache made from these rows, at this max_length
                check(datamodule)

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        for engine in (self.sampler, self.teacher_sampler, *self.teacher_sources.values()):
            close = getattr(engine, "close", None)
            if callable(close):
                close()

    # -- the GKD step -------------------------------------------------------------------------------------------
    def choose_source(self, batch_idx: int) -> Source:
        """The λ coin flip: "student" (on-policy) with probability lmbda, else "teacher" if seq_kd, else "dataset"."""
        coin = torch.Generator().manual_seed(self.step_seed(batch_idx, _COIN))
        if torch.rand((), generator=coin).item() < self.lmbda:
            return "student"
        return "teacher" if self.seq_kd else "dataset"

    def sample_batch(self, model: torch.nn.Module | None, batch: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
        """Replace the batch completions by ``model``'s samples for its prompts (through ``self.sampler``, or the
        teacher server's sampler for a served teacher's samples)."""
        self.sampling_calls += 1
        sampler = self.teacher_sampler if model is self.teacher and self.teacher_sampler is not None else self.sampler
        # a server's sampler ignores the model (its weights are the served teacher's)
        sampled = sampler.sample(
            cast(torch.nn.Module, model), batch["prompts"], batch["prompt_attention_mask"], seed=seed
        )
        return {**batch, **sampled}

    def completion_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.distillation_loss(batch)

    def distillation_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """GKD's loss hook: the generalized JSD (``beta``, ``loss_temperature``) between student and teacher at
        every completion position of ``batch`` (``input_ids``, ``attention_mask``, ``labels``: dataset completions
        or samples). Override it for another objective (docs/customization.md); ``training_step`` and validation
        both call it.

        A sparse teacher (cache, server, a local one with ``top_k``) gives the ``sparse_loss`` instead. Under
        ``teacher.kind=multi`` each teacher scores its own rows; the loss is the token mean over all of them, and
        ``<train|val>/teacher/<name>/loss`` and ``.../tokens`` are logged per teacher."""
        if self.cross_tokenizer is not None:
            return cross_tokenizer_loss(self, batch)
        if self.teacher_column is None:
            return self.teacher_loss(batch, self.teacher_source)
        stage = "train" if self.training else "val"
        loss, per_teacher = routed_loss(batch, self.teacher_column, self.teacher_sources, self.teacher_loss)
        for name, (part_loss, tokens) in per_teacher.items():
            self.log(f"{stage}/teacher/{name}/loss", part_loss, batch_size=tokens, add_dataloader_idx=False)
            self.log(f"{stage}/teacher/{name}/tokens", float(tokens), reduce_fx="sum", add_dataloader_idx=False)
        return loss

    def teacher_loss(self, batch: dict[str, torch.Tensor], teacher: Any) -> torch.Tensor:
        """The loss of ``batch`` against one teacher source: dense (an in-process model without ``top_k``) or
        sparse (``sparse_loss`` on its top-k signal)."""
        if not isinstance(teacher, LocalTeacher) or teacher.top_k is not None:
            loss, hidden = sparse_teacher_loss(
                self.student,
                teacher,
                batch,
                sparse_loss=self.sparse_loss,
                beta=self.beta,
                chunk_size=self.loss_chunk_size,
            )
            self.nonfinite_guard.record(self.model_role, hidden)
            return loss
        if self.lean_loss:
            try:
                return self._lean_loss(batch, teacher)
            except LeanForwardUnsupported as reason:
                rank_zero_warn(f"lean_loss: {reason}; computing the loss from full logits instead.")
                self.lean_loss = False
        student_logits = self.causal_lm_logits(self.student, batch)
        teacher_logits = teacher.logits(batch)
        return generalized_jsd_loss(
            student_logits[:, :-1],
            teacher_logits[:, :-1],
            labels=batch["labels"][:, 1:],
            beta=self.beta,
            temperature=self.loss_temperature,
        )

    def _lean_loss(self, batch: dict[str, torch.Tensor], teacher: Teacher) -> torch.Tensor:
        positions = supervised_positions(batch["labels"])
        ids, mask = batch["input_ids"], batch["attention_mask"]
        check_output_head(self.student, ids, mask)  # the head description gives its own logits (once per model)
        student_hidden = final_hidden_states(self.student, ids, mask, positions)
        student_head = output_head(self.student)  # after the forward: FSDP2 has gathered the root unit
        teacher_hidden, teacher_head = teacher.hidden_states(batch, positions)
        # the logits watch sees no logits on this path; record whether each model's hidden states are finite
        self.nonfinite_guard.record(self.model_role, student_hidden)
        self.nonfinite_guard.record("teacher", teacher_hidden)
        return projected_jsd_loss(
            student_hidden,
            student_head,
            teacher_hidden,
            teacher_head,
            beta=self.beta,
            temperature=self.loss_temperature,
            chunk_size=self.loss_chunk_size,
        )

    def _sampler_model(self, source: Source) -> torch.nn.Module | None:
        return self.student if source == "student" else self.teacher

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        source, batch = self.training_batch(batch, batch_idx)
        loss = self.distillation_loss(batch)
        if self.skip_nonfinite(loss):
            return None
        self.count_trained_tokens(batch["labels"])
        if self.cross_tokenizer is None:
            step_loss = self.step_loss(loss, batch["labels"])
        else:  # a mean over aligned groups: the step's normaliser counts groups
            step_loss = self.token_normalizer.micro_batch_loss(loss, torch.tensor(self.cross_tokenizer_groups))
        self._batches += 1
        self._on_policy_batches += source == "student"
        completion_tokens = (batch["labels"] != IGNORE_INDEX).sum(dim=1).float()
        size = batch["input_ids"].shape[0]
        if not self.token_normalizer.per_step:  # else logged once per optimizer step, as the step's token mean
            self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/on_policy", float(source == "student"), batch_size=size)
        # the share of on-policy batches so far in this fit (train/on_policy is this batch's 0 or 1)
        self.log("train/on_policy_fraction", self._on_policy_batches / self._batches, prog_bar=True, batch_size=size)
        self.log("train/completion_length", completion_tokens.mean(), batch_size=size)
        return step_loss


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}.")
