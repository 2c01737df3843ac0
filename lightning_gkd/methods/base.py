"""The training-step contract every method builds on: a trainable causal LM (``self.model``), frozen helpers,
optimizers, and the hooks that wire in the shared plumbing (non-finite guard, throughput, validation metrics, FSDP2,
checkpoints, export), each of which lives in its own room."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeAlias, TypeVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.metrics import (
    CompletionLengths,
    GenerationScores,
    decode_until_eos,
    greedy_completions,
    reference_texts,
)
from lightning_gkd.evaluation.model_card import describe_source
from lightning_gkd.evaluation.settings import ValidationSettings
from lightning_gkd.losses.base import LossOutput
from lightning_gkd.models.loading import (
    ModelSource,
    check_tokenizer_fits,
    dtype_chosen,
    enable_gradient_checkpointing,
    load_causal_lm,
    load_frozen_causal_lm,
    vocab_size,
)
from lightning_gkd.models.loading import disable_dropout as disable_dropout_in
from lightning_gkd.models.precision import frozen_model_dtype, is_quantized
from lightning_gkd.models.tied_embedding import sparse_tied_embedding_gradient
from lightning_gkd.models.vision import freeze_vision
from lightning_gkd.ops.decoding.sampling import derive_seed
from lightning_gkd.ops.hf.forward import resolve_eos_token_id
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits
from lightning_gkd.samplers.base import Sampler
from lightning_gkd.training.checkpoint_io import drop_frozen_state, fill_frozen_state
from lightning_gkd.training.export import export_module
from lightning_gkd.training.nonfinite import MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteStop
from lightning_gkd.training.normalization import StepTokenNormalizer
from lightning_gkd.training.optimizers import adamw, amp_clipping, build_optimizer
from lightning_gkd.training.quiet import ignore_frozen_eval_warning, silence_known_noise
from lightning_gkd.training.settings import TrainingSettings
from lightning_gkd.training.throughput import TokenThroughput

silence_known_noise()  # Lightning's litlogger tip and a torch deprecation in Lightning's code: noise for any user

__all__ = [
    "MAX_CONSECUTIVE_SKIPS",
    "CausalLMModule",
    "check_data_format",
    "derive_seed",
    "Group",
    "plain_settings",
    "require_lm_module",
    "settings_group",
]

Settings = TypeVar("Settings")
#: A settings-group argument of a method: the settings themselves, a mapping of the fields to change from the
#: method's defaults (Hydra passes one), or None for those defaults (``settings_group``).
Group: TypeAlias = Settings | Mapping[str, Any] | None
_NOT_PLAIN = object()


def settings_group(value: Group[Settings], default: Settings, name: str) -> Settings:
    """A method's settings group from its argument ``name``: the settings themselves, a mapping of overrides applied
    onto the method's ``default`` (Hydra passes one), or None: ``default``. The overrides are checked as the
    settings class checks its fields; an unknown key is a ValueError naming the ones it takes."""
    if value is None:
        return default
    if isinstance(value, type(default)):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a {type(default).__name__}, a mapping of its fields or None, got {type(value).__name__}."
        )
    known = [f.name for f in fields(default)]  # type: ignore[arg-type]  # every settings class is a dataclass
    if unknown := sorted(str(key) for key in value if key not in known):
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; it takes {', '.join(known)}.")
    return replace(default, **value)  # type: ignore[type-var]


def _plain(value: Any) -> Any:
    """``value`` as plain data (None, bool, numbers, strings, lists and string-keyed dicts of them), or ``_NOT_PLAIN``
    for an object (a model, a factory, a callable)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        items = [_plain(item) for item in value]
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        entries = {key: _plain(item) for key, item in value.items()}
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in entries.values()) else entries
    return _NOT_PLAIN


def plain_settings(settings: Any) -> dict[str, Any]:
    """The fields of ``settings`` (a settings dataclass, or a mapping) whose values are plain data, by name: what a
    checkpoint records of a settings group (objects such as a sampler, an optimizer factory or the metrics stay
    out), and what the constructor takes back as a mapping."""
    values = (
        settings if isinstance(settings, Mapping) else {f.name: getattr(settings, f.name) for f in fields(settings)}
    )
    return {name: plain for name, value in values.items() if (plain := _plain(value)) is not _NOT_PLAIN}


_DATA_FORMATS = {
    "chat": "chat rows (ChatDataModule: 'messages', or 'prompt'/'completion'; Hydra: data=chat_files, data=hub)",
    "preference": "preference pairs (PreferenceDataModule: 'prompt', 'chosen', 'rejected'; Hydra: "
    "data=preference_files, data=toy_preference)",
}
_METHODS_FOR = {"chat": "method=gkd, method=opd or method=sft", "preference": "method=dpo"}


def check_data_format(method: Any, datamodule: Any) -> None:
    """The method (a module or its class) and the datamodule must agree on the kind of rows: ``data_format``
    ``"chat"`` (GKD, OPD, SFT) or ``"preference"`` (DPO). A datamodule that declares none is not checked.
    ValueError naming both and what to use instead: GKD would otherwise train on both sides of each preference pair,
    and DPO fail at its first step."""
    needed = getattr(method, "data_format", None)
    given = getattr(datamodule, "data_format", None)
    if needed is None or given is None or needed == given:
        return
    name = method.__name__ if isinstance(method, type) else type(method).__name__
    raise ValueError(
        f"{name} trains on {_DATA_FORMATS.get(needed, needed)}, but the datamodule "
        f"({type(datamodule).__name__}) holds {_DATA_FORMATS.get(given, given)}. Use {_METHODS_FOR.get(given, '')} "
        f"for this data, or data for {name}: {_DATA_FORMATS.get(needed, needed)}."
    )


def require_lm_module(pl_module: L.LightningModule, user: str) -> CausalLMModule:
    """``pl_module`` as a :class:`CausalLMModule`, or a TypeError naming ``user`` (a callback that needs its
    ``model`` and ``tokenizer``)."""
    if not isinstance(pl_module, CausalLMModule):
        raise TypeError(
            f"{user} works with lightning_gkd's modules (GKDModule, DPOModule, SFTModule or a subclass), "
            f"got {type(pl_module).__name__}."
        )
    return pl_module


class CausalLMModule(L.LightningModule):
    """Base LightningModule: a trainable causal LM (``self.model``) plus frozen models named in ``frozen_names``.

    Frozen models stay in eval mode whatever ``train()`` is called with, take no optimizer slot, and are kept out
    of checkpoints (they are re-inserted from the live module on load, so loading stays strict for the rest).

    The contract for a method: ``completion_loss(batch) -> LossOutput``, the loss on a batch's dataset completions
    (validation logs its ``loss`` as ``val/loss`` and its ``logs`` under ``val/``), and ``training_step``, which for a
    mean loss returns ``finish_training_step(out, batch)``: the non-finite check (``skip_nonfinite``), the trained
    token count (``train/tokens_per_sec``), ``train/<name>`` of ``out.logs``, and ``step_loss(out.loss, out.count)``
    (with ``training.loss_normalization="step"`` the optimizer step then trains on the mean over all its
    micro-batches' and ranks' units). ``validation.metrics`` (name -> ``fn(predictions, references) -> float``) score
    greedy completions of the validation prompts against the dataset completions once per validation epoch, logged
    as ``val/<name>``.

    Settings come in groups (``training``: ``TrainingSettings``, ``validation``: ``ValidationSettings``; a method
    adds its own): each argument takes the settings, a mapping of overrides applied onto the method's defaults (the
    class's ``default_<group>``; Hydra passes one), or None for those defaults (``settings_group``).

    Every training loss is checked (``lightning_gkd.training.nonfinite``): a non-finite one raises
    ``RuntimeError`` naming the global step and which model (``model_role`` or a frozen model) produced
    non-finite logits, before anything is updated with it, and ``NonFiniteStop`` saves ``last.ckpt``, the state before
    that step; under several processes every rank stops together, the error naming the rank(s). With
    ``training.nonfinite="skip"`` the batch is skipped with a warning instead (single process only).
    """

    frozen_names: tuple[str, ...] = ()
    model_role = "model"  # what errors call the trainable model ("student", "policy")
    #: The rows this method trains on, matched against a datamodule's ``data_format`` (``check_data_format``).
    data_format = "chat"
    causal_lm_logits = staticmethod(causal_lm_logits)
    #: The method's own defaults of its ``training`` and ``validation`` groups (a mapping given changes these).
    default_training: ClassVar[TrainingSettings] = TrainingSettings()
    default_validation: ClassVar[ValidationSettings] = ValidationSettings()
    #: The engine validation's greedy completions go through (``Sampler.greedy``); None: our KV-cache decoder.
    sampler: Sampler | None = None

    def __init__(
        self,
        model: ModelSource,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        training: Group[TrainingSettings] = None,
        validation: Group[ValidationSettings] = None,
    ) -> None:
        # checked before any model loads
        training = settings_group(training, self.default_training, "training")
        validation = settings_group(validation, self.default_validation, "validation")
        super().__init__()
        #: How the model trains (``TrainingSettings``; ``training`` is ``nn.Module``'s mode flag).
        self.training_settings = training
        #: What validation generates and scores besides the loss (``ValidationSettings``).
        self.validation = validation
        self.nonfinite_guard = NonFiniteGuard(training.nonfinite)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        # from_pretrained returns eval-mode models; Lightning keeps module modes as found, so set train mode here.
        self.model: nn.Module = load_causal_lm(
            model, trust_remote_code=training.trust_remote_code, role=self.model_role
        ).train()
        check_tokenizer_fits(self.tokenizer, vocab_size(self.model), role=self.model_role)
        if training.disable_dropout:
            disable_dropout_in(self.model)
        if training.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        if training.freeze_vision:
            freeze_vision(self.model)
        # a tied embedding's gradient: the rows looked up, added into the head's (no dense V x H zero-fill)
        sparse_tied_embedding_gradient(self.model)
        self.generation_scores = GenerationScores()  # greedy validation texts, scored at the epoch's end
        #: Set by a ``LengthGuard`` for a validation it measures: the greedy completions' lengths are counted there
        #: (made for it when no metric needs them). None: nothing counted.
        self.completion_lengths: CompletionLengths | None = None
        #: What each model was loaded from (hub id, folder, config type), for the model card.
        self.model_sources: dict[str, str | None] = {self.model_role: describe_source(model)}
        self.throughput = TokenThroughput()
        #: Token-mean losses: over the whole optimizer step ("step") or per micro-batch ("micro_batch").
        self.token_normalizer = StepTokenNormalizer(training.loss_normalization)
        self._checked_datamodule: L.LightningDataModule | None = None
        #: The data's vision-language processor (``ChatDataModule(processor=...)``), saved with an export; None: text.
        self.processor: Any = None
        self._frozen_dtype_open: set[str] = set()  # frozen models whose source did not choose a dtype
        self._full_state_dict: dict[str, torch.Tensor] | None = None  # a sharded model's weights at fit end

    def load_frozen(self, source: ModelSource, *, role: str) -> nn.Module:
        """Load a frozen helper model. Unless its dtype was chosen (a spec with ``init_kwargs.dtype`` other than
        ``auto``, or an ``nn.Module`` in another dtype than float32), it takes ``training.frozen_dtype``'s dtype when
        fitting starts: with "auto", the trainer's 16-bit precision, or bfloat16 under 32-bit where the hardware
        multiplies bf16 fast. A float32 ``nn.Module`` passed in is cast in place like a model loaded from a folder."""
        self.model_sources[role] = describe_source(source)
        if not dtype_chosen(source):
            self._frozen_dtype_open.add(role)
        return load_frozen_causal_lm(source, role=role, trust_remote_code=self.training_settings.trust_remote_code)

    def settings_groups(self) -> dict[str, Any]:
        """The method's settings groups by argument name (a subclass adds its own), as its hyper-parameters record
        them (``save_settings``)."""
        return {"training": self.training_settings, "validation": self.validation}

    def save_settings(self, *objects: str) -> None:
        """Save the constructor's arguments as hyper-parameters (a subclass's own arguments too: Lightning reads them
        from the constructors' frames) without the ``objects`` among them (models, the tokenizer, a loss object), and
        each settings group as its plain values (``plain_settings``): a checkpoint's hyper-parameters load
        weights-only, and ``load_from_checkpoint`` makes the same groups from them."""
        groups = self.settings_groups()
        self.save_hyperparameters(ignore=[*objects, *groups])
        self.save_hyperparameters({**self.hparams, **{name: plain_settings(value) for name, value in groups.items()}})

    def frozen_models(self) -> dict[str, nn.Module]:
        """name -> frozen model, for those present (DPO with cached reference log-probs has none)."""
        return {name: m for name in self.frozen_names if isinstance(m := getattr(self, name, None), nn.Module)}

    # -- the method's contract ------------------------------------------------------------------------------------
    def completion_loss(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        """The method's loss on the dataset completions of ``batch`` (``input_ids``, ``attention_mask``,
        ``labels``): what validation logs."""
        raise NotImplementedError

    def completion_requirement(self) -> str | None:
        """Why this run trains on the dataset completions (and how to do without), or None if it never does.
        A reason makes ``setup`` reject training rows that end without an assistant turn."""
        return None

    def step_seed(self, batch_idx: int, *salt: int) -> int:
        """Seed for this training batch: a function of (seed, epoch, batch index in the epoch, salt) only, so the seed
        of a batch ahead is known before its step (asynchronous rollouts sample it early)."""
        return derive_seed(self.training_settings.seed, self.current_epoch, batch_idx, *salt)

    def skip_nonfinite(self, loss: torch.Tensor) -> bool:
        """Check a training loss: True when the batch must be skipped (``nonfinite="skip"``), False when it is
        finite; raises ``NonFiniteLoss`` (a ``RuntimeError``) naming the step and the model with non-finite logits
        otherwise. Under several processes the ranks agree first (one all-reduce of a flag): every rank raises when
        any rank's loss is non-finite, naming the rank(s)."""
        trainer = getattr(self, "_trainer", None)  # None when called outside a fit
        if trainer is not None:
            self.nonfinite_guard.check_ranks(loss, self.global_step, trainer)
        return self.nonfinite_guard.check(loss, step=self.global_step)

    def step_loss(self, mean_loss: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
        """What ``training_step`` returns for ``mean_loss``, a mean over ``count`` units (tokens, aligned groups):
        with ``loss_normalization="step"`` (default) the optimizer step's update is the gradient of the mean over all
        its micro-batches' and ranks' units (``lightning_gkd.training.normalization``), and ``train/loss`` is logged
        once per step as that mean."""
        return self.token_normalizer.micro_batch_loss(mean_loss, torch.as_tensor(count))

    def finish_training_step(self, out: LossOutput, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """What ``training_step`` returns for ``out`` on ``batch``: None to skip a non-finite batch
        (``nonfinite="skip"``), else ``step_loss``; logs ``out.logs`` as ``train/<name>`` (and ``train/loss`` here
        with ``loss_normalization="micro_batch"``)."""
        for role, finite in out.finite.items():
            self.nonfinite_guard.record_flag(self.model_role if role == "student" else role, finite)
        if self.skip_nonfinite(out.loss):
            return None
        self.count_trained_tokens(batch["labels"])
        if not self.token_normalizer.per_step:  # else logged once per optimizer step, as the step's mean
            self.log("train/loss", out.loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log_values(out, "train/")
        return self.step_loss(out.loss, out.count)

    def log_values(self, out: LossOutput, prefix: str, **options: Any) -> None:
        """Log each of ``out.logs`` as ``<prefix><name>``, weighted and reduced as it says."""
        for name, value in out.logs.items():
            self.log(
                f"{prefix}{name}",
                value.value,
                batch_size=value.weight,  # type: ignore[arg-type]  # Lightning weighs by it; a float is fine
                reduce_fx=value.reduce,
                add_dataloader_idx=False,
                **options,
            )

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        mean = self.token_normalizer.finish_step(
            self.model.parameters(),
            accumulate=self.trainer.accumulate_grad_batches,
            world_size=self.trainer.world_size,
            reduce_sum=lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"),
        )
        if mean is not None:
            self.log("train/loss", mean, prog_bar=True, batch_size=1)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Free the gradients as soon as they are spent (Lightning zeroes them only after the next training_step,
        # so they would otherwise stay allocated through its sampling and forwards: 4 bytes a float32 parameter).
        # Lightning calls this hook only at real steps, never between accumulated micro-batches.
        optimizer.zero_grad(set_to_none=True)

    def count_trained_tokens(self, labels: torch.Tensor) -> None:
        """Record the completion tokens (labels != -100) this training step trains on."""
        self.throughput.count(labels)

    def configure_callbacks(self) -> list[L.Callback]:
        # a non-finite loss that stops the fit: a checkpoint of the state before that step, and where it is
        return [NonFiniteStop()]

    # -- modes, optimizers ------------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> CausalLMModule:
        super().train(mode)
        for model in self.frozen_models().values():
            model.eval()
        return self

    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        trainer = getattr(self, "_trainer", None)  # None when called outside a fit
        factory = self.training_settings.optimizer or partial(adamw, lr=5e-5)  # fused where torch can
        optimizer = build_optimizer(factory, params, allow_fused=trainer is None or not amp_clipping(trainer))
        scheduler = self.training_settings.scheduler
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler(optimizer), "interval": "step"}}

    # -- checks before training -----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        # The frozen models' dtype for every stage: trainer.validate/test score with the teacher training used.
        frozen_dtype = self.training_settings.frozen_dtype
        dtype = frozen_model_dtype(frozen_dtype, str(self.trainer.precision), self.trainer.strategy.root_device)
        for name, model in self.frozen_models().items():
            chosen = frozen_dtype == "auto" and name not in self._frozen_dtype_open
            if dtype is not None and not chosen and not is_quantized(model):
                self._log_frozen_cast(name, model, dtype)
                model.to(dtype)
        if stage != "fit":
            return
        self.nonfinite_guard.check_world_size(self.trainer.world_size)
        datamodule = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        if datamodule is not None:
            self.check_datamodule(datamodule)
        self.nonfinite_guard.watch({self.model_role: self.model, **self.frozen_models()})
        ignore_frozen_eval_warning(self)  # Lightning's "N module(s) in eval mode": exactly our frozen models' N

    def _log_frozen_cast(self, name: str, model: nn.Module, dtype: torch.dtype) -> None:
        """Say which dtype a frozen model runs in when that changes it, and how to keep its own (once: after the
        cast a later stage's setup finds it in ``dtype`` already)."""
        before = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if before == {dtype}:
            return
        was = ", ".join(sorted(str(d).removeprefix("torch.") for d in before))
        now = str(dtype).removeprefix("torch.")
        message = f"The {name} runs in {now} (its weights were {was}; it is never trained)"
        if self.training_settings.frozen_dtype != "auto":
            rank_zero_info(f"{message}: frozen_dtype={self.training_settings.frozen_dtype!r}.")
            return
        where = f"precision {self.trainer.precision!r} on {self.trainer.strategy.root_device}"
        keep = f" frozen_dtype='{was}' keeps it {was}." if len(before) == 1 else ""
        rank_zero_info(f"{message}: frozen_dtype='auto' under {where}.{keep}")

    def check_datamodule(self, datamodule: L.LightningDataModule) -> None:
        """The data checks that depend on this module's settings (a datamodule with ``check_completions``, as
        ``ChatDataModule``); ``setup`` runs them. Call it before ``trainer.fit`` to fail before the trainer creates
        any output."""
        if datamodule is self._checked_datamodule:
            return
        check_data_format(self, datamodule)
        # a vision-language model's processor (rows with images): exported with the model
        self.processor = getattr(datamodule, "processor", None)
        check = getattr(datamodule, "check_completions", None)
        if not callable(check):
            return
        datamodule.setup("fit")
        check(self.completion_requirement())
        self._checked_datamodule = datamodule

    def teardown(self, stage: str) -> None:
        self.nonfinite_guard.unwatch()

    # -- per training batch -----------------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        self.throughput.reset()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.nonfinite_guard.reset()
        self.throughput.start()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.throughput.stop()
        if step is not None:
            tokens, seconds = step
            per_second = tokens / max(seconds, 1e-9)
            self.log("train/tokens_per_sec", per_second, prog_bar=True, sync_dist=True, reduce_fx="sum", batch_size=1)

    @property
    def trained_tokens(self) -> int:
        """Completion tokens trained on in this process's current fit."""
        return self.throughput.trained_tokens

    def tokens_per_second(self) -> float:
        """Completion tokens trained per second of training step in this process's current fit."""
        return self.throughput.tokens_per_second()

    # -- validation: loss on dataset completions + generation metrics -----------------------------------------------
    def val_names(self) -> list[str] | None:
        """The attached datamodule's ``val_names`` (None without a trainer, a datamodule or named sets)."""
        trainer = getattr(self, "_trainer", None)
        names = getattr(getattr(trainer, "datamodule", None), "val_names", None)
        return list(names) if names else None

    def val_prefix(self, dataloader_idx: int = 0) -> str:
        """Where validation values of loader ``dataloader_idx`` are logged: ``val/`` for a single validation set,
        ``val/<name>/`` when the datamodule has named sets (``ChatDataModule(val_data={name: source})``)."""
        names = self.val_names()
        return f"val/{names[dataloader_idx]}/" if names else "val/"

    def validation_batch_loss(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        """The loss ``validation_step`` logs: ``completion_loss(batch)`` (a method whose teacher can fail makes the
        ranks agree here first)."""
        return self.completion_loss(batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        out = self.validation_batch_loss(batch)
        prefix = self.val_prefix(dataloader_idx)
        self.log(
            f"{prefix}loss",
            out.loss,
            prog_bar=True,
            sync_dist=True,
            batch_size=batch["input_ids"].shape[0],
            add_dataloader_idx=self.val_names() is None,
        )
        self.log_values(out, prefix, sync_dist=True)
        self.collect_generations(batch, dataloader_idx)
        return out.loss

    def collect_generations(self, batch: Mapping[str, torch.Tensor], dataloader_idx: int = 0) -> None:
        """With ``validation.metrics``: greedy completions of the batch prompts (through ``sampler.greedy`` where it
        decodes) and the batch's dataset completions (``labels``), scored at the end of the validation epoch. With
        ``completion_lengths``: their lengths counted."""
        if not self.validation.metrics and self.completion_lengths is None:
            return
        eos = resolve_eos_token_id(self.model, self.tokenizer)
        completions = greedy_completions(
            self.model,
            self.tokenizer,
            batch,
            eos_token_id=eos,
            max_new_tokens=self.validation.max_new_tokens,
            sampler=self.sampler,
        )
        if self.completion_lengths is not None:
            self.completion_lengths.add(completions, eos)
        if self.validation.metrics:
            predictions = decode_until_eos(self.tokenizer, completions.tolist(), eos)
            self.generation_scores.add(dataloader_idx, predictions, reference_texts(self.tokenizer, batch, eos))

    def on_validation_epoch_end(self) -> None:
        if self.validation.metrics:
            for key, value in self.generation_scores.compute(self.validation.metrics, self.val_names()).items():
                self.log(key, value, prog_bar=True, add_dataloader_idx=False)

    # -- sharding: FSDP2 under ModelParallelStrategy (trainer=fsdp) -------------------------------------------------
    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (``trainer=fsdp``): shard the trainable model and each frozen
        model as separate FSDP2 trees (``models.sharding.shard_for_training``); otherwise nothing. Checkpoints then
        hold the trainable model only (frozen models are filled in from the live module on load, so
        ``strict_loading`` is off: Lightning's sharded loader checks every parameter of the module)."""
        if self._device_mesh is None:
            return
        from lightning_gkd.models.sharding import shard_for_training

        precision = getattr(getattr(self, "_trainer", None), "precision", None)
        sharded = shard_for_training(
            self.model, self.frozen_models(), self._device_mesh, precision, owner=type(self).__name__
        )
        if sharded and self.frozen_names:
            self.register_state_dict_post_hook(
                lambda module, state, prefix, metadata: drop_frozen_state(state, module.frozen_names, prefix)
            )
            self.register_load_state_dict_pre_hook(
                lambda module, state, prefix, *args: fill_frozen_state(state, module.frozen_models(), prefix)
            )
            self.strict_loading = False

    def on_before_backward(self, loss: torch.Tensor) -> None:
        # A sharded frozen model keeps its root unit (embeddings, LM head) gathered after its forward, for the
        # memory-lean loss; nothing else frees it (no backward), so free it before the student's backward.
        if self._device_mesh is not None:
            from lightning_gkd.models.sharding import reshard

            for model in self.frozen_models().values():
                reshard(model)

    def on_fit_end(self) -> None:
        # A sharded model's full weights need every rank (a collective); export() runs on rank 0 only.
        from lightning_gkd.models.sharding import full_state_dict

        self._full_state_dict = full_state_dict(self.model)

    # -- checkpoints and export -------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        drop_frozen_state(checkpoint["state_dict"], self.frozen_names)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")
        if state is not None:  # ModelParallelStrategy loads the weights itself and hands over the rest
            fill_frozen_state(state, self.frozen_models())

    def export(
        self, path: str | Path, card_info: Mapping[str, Any] | None = None, *, merged_path: str | Path | None = None
    ) -> Path:
        """Write the trained model, tokenizer and a ``README.md`` model card to ``path`` (loadable with
        ``AutoModelForCausalLM.from_pretrained``), atomically; a LoRA model writes its adapter there and, with
        ``merged_path``, the merged full model too. See ``lightning_gkd.training.export.export_module``."""
        return export_module(self, path, card_info, merged_path=merged_path, full_state_dict=self._full_state_dict)
