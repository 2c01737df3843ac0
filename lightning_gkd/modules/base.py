"""Plumbing shared by every method: the trainable model, frozen helpers, optimizers, generation metrics,
checkpoints and export."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat_collator import IGNORE_INDEX
from lightning_gkd.data.datamodule import ChatDataModule
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.data.validation import check_completions, rows_without_completion
from lightning_gkd.evaluation import GenerationMetric, greedy_texts, reference_texts
from lightning_gkd.generation import position_ids_from_mask, resolve_eos_token_id
from lightning_gkd.model_card import describe_source, write_model_card
from lightning_gkd.models import ModelSource, freeze, load_causal_lm
from lightning_gkd.models import disable_dropout as disable_dropout_in

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
NonFinitePolicy = Literal["raise", "skip"]
#: With nonfinite="skip", this many non-finite batches in a row stop the run: the model is broken, not unlucky.
MAX_CONSECUTIVE_SKIPS = 16


#: The dtype a frozen model (teacher, reference) takes under each trainer precision, unless its dtype was chosen.
PRECISION_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "32-true": torch.float32,
    "64-true": torch.float64,
}


def _dtype_chosen(source: ModelSource) -> bool:
    """Whether a model source fixes its own dtype: a built module, or a spec with a dtype other than ``auto``."""
    if isinstance(source, nn.Module):
        return True
    if isinstance(source, Mapping):
        init_kwargs = source.get("init_kwargs") or {}
        dtype = init_kwargs.get("dtype", init_kwargs.get("torch_dtype"))
        return dtype is not None and str(dtype) != "auto"
    return False


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (run seed, step, ...): the same on every rank and after resume."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


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

    Subclasses implement ``training_step`` and ``dataset_loss(batch)`` (the validation loss on dataset
    completions). ``metrics`` (name -> ``fn(predictions, references) -> float``) score greedy completions of the
    validation prompts against the dataset completions once per validation epoch, logged as ``val/<name>``.

    Every training loss is checked: a non-finite one raises ``RuntimeError`` naming the global step and which
    model (``model_role`` or a frozen model) produced non-finite logits, before anything is updated with it; with
    ``nonfinite="skip"`` the batch is skipped with a warning instead (single process only). Subclasses call
    ``skip_nonfinite(loss)`` in ``training_step`` and ``count_trained_tokens(labels)`` for the throughput
    metric ``train/tokens_per_sec`` (completion tokens trained per second of training step).
    """

    frozen_names: tuple[str, ...] = ()
    model_role = "model"  # what errors call the trainable model ("student", "policy")

    def __init__(
        self,
        model: ModelSource,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        seed: int = 0,
        metrics: Mapping[str, GenerationMetric] | None = None,
        eval_max_new_tokens: int = 32,
        nonfinite: NonFinitePolicy = "raise",
    ) -> None:
        super().__init__()
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}.")
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        # from_pretrained returns eval-mode models; Lightning keeps module modes as found, so set train mode here.
        self.model: nn.Module = load_causal_lm(model, trust_remote_code=trust_remote_code, role=self.model_role).train()
        if disable_dropout:
            disable_dropout_in(self.model)
        if gradient_checkpointing:
            # transformers >= 5.2x renamed gradient_checkpointing_enable (now deprecated) to activation_*.
            name = "activation_checkpointing_enable"
            enable = getattr(self.model, name, None) or getattr(self.model, "gradient_checkpointing_enable", None)
            if not callable(enable):
                raise ValueError(
                    f"gradient_checkpointing=True needs a model with {name}() or gradient_checkpointing_enable() "
                    f"(a Hugging Face PreTrainedModel); {type(self.model).__name__} has neither."
                )
            enable({"use_reentrant": False})
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=5e-5)
        self.scheduler_factory = scheduler
        self.seed = seed
        self.metrics = dict(metrics or {})
        self.eval_max_new_tokens = eval_max_new_tokens
        self._predictions: list[str] = []  # single-set collection (kept for subclasses that fill it directly)
        self._references: list[str] = []
        self._generated: dict[int, tuple[list[str], list[str]]] = {}  # loader index -> (predictions, references)
        #: What each model was loaded from (hub id, folder, config type), for the model card.
        self.model_sources: dict[str, str | None] = {self.model_role: describe_source(model)}
        self.nonfinite = nonfinite
        self._logits_finite: dict[str, torch.Tensor] = {}  # role -> 0-dim bool of its latest forward
        self._watch_handles: list[Any] = []
        self._skipped_in_a_row = 0
        self._checked_datamodule: L.LightningDataModule | None = None
        self._step_tokens: torch.Tensor | None = None
        self._step_started: float | None = None
        self._frozen_follow_precision: set[str] = set()  # frozen models whose dtype follows trainer.precision
        self.trained_tokens = 0  # completion tokens trained on in this process's current fit
        self.train_seconds = 0.0  # time in training batches: sampling, forwards, backward, optimizer step

    def load_frozen(self, source: ModelSource, *, role: str, trust_remote_code: bool = False) -> nn.Module:
        """Load a frozen helper model. Unless its dtype was chosen (an ``nn.Module``, or a spec with
        ``init_kwargs.dtype`` other than ``auto``), it follows the trainer's precision when fitting starts."""
        self.model_sources[role] = describe_source(source)
        if not _dtype_chosen(source):
            self._frozen_follow_precision.add(role)
        if isinstance(source, Mapping) and source.get("lora"):
            # a spec shared with the trained model (DPO's `reference: ${model.student}`): a frozen model gets no
            # adapters, it is the base model
            source = {key: value for key, value in source.items() if key != "lora"}
        return freeze(load_causal_lm(source, trust_remote_code=trust_remote_code, role=role))

    # -- modes, optimizers --------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> CausalLMModule:
        super().train(mode)
        for name in self.frozen_names:
            getattr(self, name).eval()
        return self

    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"},
        }

    # -- forward ------------------------------------------------------------------------------------------------
    @staticmethod
    def causal_lm_logits(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Logits (B, L, V) of ``model`` on a left-padded batch, with positions counted from each row's first
        real token (the same positions the sampler uses)."""
        mask = batch["attention_mask"]
        return model(
            input_ids=batch["input_ids"],
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=False,
        ).logits

    def step_seed(self, batch_idx: int, *salt: int) -> int:
        """Seed for this training batch: a function of (seed, global step, batch index, salt) only."""
        return derive_seed(self.seed, self.global_step, batch_idx, *salt)

    # -- checks before training ----------------------------------------------------------------------------------
    def completion_requirement(self) -> str | None:
        """Why this run trains on the dataset completions (and how to do without), or None if it never does.
        A reason makes ``setup`` reject training rows that end without an assistant turn."""
        return None

    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        if self.nonfinite == "skip" and self.trainer.world_size > 1:
            raise ValueError(
                "nonfinite='skip' works in a single process only (a batch skipped on one rank would "
                f"leave the other {self.trainer.world_size - 1} waiting); use nonfinite='raise'."
            )
        datamodule = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        if datamodule is not None:
            self.check_datamodule(datamodule)
        dtype = PRECISION_DTYPES.get(str(self.trainer.precision))
        for name in self.frozen_names:
            if dtype is not None and name in self._frozen_follow_precision:
                getattr(self, name).to(dtype)
        self._watch_logits()

    def check_datamodule(self, datamodule: L.LightningDataModule) -> None:
        """The data checks that depend on this module's settings; ``setup`` runs them. Call it (after
        ``datamodule.setup("fit")``) before ``trainer.fit`` to fail before the trainer creates any output."""
        if not isinstance(datamodule, ChatDataModule) or datamodule is self._checked_datamodule:
            return
        datamodule.setup("fit")
        reason = self.completion_requirement()
        if reason is not None:
            check_completions(datamodule.train_rows or [], name="train_data", reason=reason)
        val_sets = datamodule.val_sets or ({"": datamodule.val_rows} if datamodule.val_rows is not None else {})
        for set_name, rows in val_sets.items():
            missing = rows_without_completion(rows)
            if missing:
                where = f"val_data[{set_name!r}]" if set_name else "val_data"
                rank_zero_warn(
                    f"{where}: {len(missing)} of {len(rows)} rows (first: row {missing[0]}) end "
                    "without an assistant turn; the validation loss and the generation metrics score "
                    "dataset completions, so those rows count for nothing there."
                )
        self._checked_datamodule = datamodule

    def _watch_logits(self) -> None:
        """Record, after each forward of each model, whether its logits were finite (one fused reduction and no
        host sync per forward); ``skip_nonfinite`` reads it only when a loss is non-finite."""
        if self._watch_handles:
            return
        models = {self.model_role: self.model, **{name: getattr(self, name) for name in self.frozen_names}}
        for role, model in models.items():

            def record(module: nn.Module, args: Any, output: Any, role: str = role) -> None:
                logits = getattr(output, "logits", None)
                if isinstance(logits, torch.Tensor):
                    self._logits_finite[role] = torch.isfinite(logits.detach().sum(dtype=torch.float32))

            self._watch_handles.append(model.register_forward_hook(record))

    def teardown(self, stage: str) -> None:
        for handle in self._watch_handles:
            handle.remove()
        self._watch_handles = []

    # -- guards and throughput in training ----------------------------------------------------------------------
    def skip_nonfinite(self, loss: torch.Tensor) -> bool:
        """Check a training loss: True when the batch must be skipped (``nonfinite="skip"``), False when it is
        finite; raises ``RuntimeError`` naming the step and the model with non-finite logits otherwise."""
        if bool(torch.isfinite(loss.detach()).all()):
            self._skipped_in_a_row = 0
            return False
        bad = [role for role, finite in self._logits_finite.items() if not bool(finite)]
        if bad:
            cause = f"the {' and the '.join(bad)} produced non-finite logits (NaN or inf)"
        else:
            checked = ", ".join(self._logits_finite) or "no model"
            cause = f"the logits ({checked}) are finite, so the loss computation itself overflowed"
        message = (
            f"Non-finite training loss ({loss.detach().float().mean().item()}) at global step "
            f"{self.global_step}: {cause}."
        )
        hint = (
            " Usual causes: a learning rate too high for these weights, fp16 overflow (use bf16 or 32-bit "
            "precision), or broken model weights."
        )
        if self.nonfinite == "raise":
            raise RuntimeError(
                message + " The model was not updated with it." + hint + " To skip such batches "
                "instead, set nonfinite='skip' (Hydra: method.nonfinite=skip)."
            )
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise RuntimeError(
                message + f" That is {self._skipped_in_a_row} skipped batches in a row, so the "
                "run is stopped: the model no longer produces usable outputs." + hint
            )
        rank_zero_warn(message + " Skipping this batch (nonfinite='skip').")
        return True

    def count_trained_tokens(self, labels: torch.Tensor) -> None:
        """Record the completion tokens (labels != -100) this training step trains on."""
        self._step_tokens = (labels != IGNORE_INDEX).sum()

    def on_train_start(self) -> None:
        self.trained_tokens, self.train_seconds = 0, 0.0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._logits_finite = {}
        self._step_tokens = None
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._step_tokens is None or self._step_started is None:
            return
        seconds = time.perf_counter() - self._step_started
        tokens = int(self._step_tokens)
        self.trained_tokens += tokens
        self.train_seconds += seconds
        self.log(
            "train/tokens_per_sec",
            tokens / max(seconds, 1e-9),
            prog_bar=True,
            sync_dist=True,
            reduce_fx="sum",
            batch_size=1,
        )

    def tokens_per_second(self) -> float:
        """Completion tokens trained per second of training step in this process's current fit."""
        return self.trained_tokens / self.train_seconds if self.train_seconds else 0.0

    # -- validation: loss on dataset completions + generation metrics -------------------------------------------
    def dataset_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def val_prefix(self, dataloader_idx: int = 0) -> str:
        """Where validation values of loader ``dataloader_idx`` are logged: ``val/`` for a single validation set,
        ``val/<name>/`` when the datamodule has named sets (``ChatDataModule(val_data={name: source})``)."""
        names = self.val_names()
        return f"val/{names[dataloader_idx]}/" if names else "val/"

    def val_names(self) -> list[str] | None:
        """The attached datamodule's ``val_names`` (None without a trainer, a datamodule or named sets)."""
        trainer = getattr(self, "_trainer", None)
        names = getattr(getattr(trainer, "datamodule", None), "val_names", None)
        return list(names) if names else None

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        loss = self.dataset_loss(batch)
        named = self.val_names() is not None
        self.log(
            f"{self.val_prefix(dataloader_idx)}loss",
            loss,
            prog_bar=True,
            sync_dist=True,
            batch_size=batch["input_ids"].shape[0],
            add_dataloader_idx=not named,
        )
        if self.metrics:
            eos = resolve_eos_token_id(self.model, self.tokenizer)
            predictions, references = self._generated.setdefault(dataloader_idx, ([], []))
            predictions += greedy_texts(
                self.model, self.tokenizer, batch, eos_token_id=eos, max_new_tokens=self.eval_max_new_tokens
            )
            references += reference_texts(self.tokenizer, batch, eos)
        return loss

    def on_validation_epoch_end(self) -> None:
        if not self.metrics:
            return
        generated = {idx: (list(preds), list(refs)) for idx, (preds, refs) in self._generated.items()}
        if self._predictions:  # subclasses that collect into the single-set lists (DPOModule)
            preds, refs = generated.setdefault(0, ([], []))
            preds += self._predictions
            refs += self._references
        self._generated, self._predictions, self._references = {}, [], []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, generated)
            generated = {}
            for part in gathered:
                for idx, (preds, refs) in part.items():
                    into = generated.setdefault(idx, ([], []))
                    into[0].extend(preds)
                    into[1].extend(refs)
        names = self.val_names()
        for idx in sorted(generated):
            predictions, references = generated[idx]
            for name, metric in self.metrics.items():
                if names:
                    key = f"val/{names[idx]}/{name}"
                elif len(generated) > 1:
                    key = f"val/{name}/dataloader_idx_{idx}"
                else:
                    key = f"val/{name}"
                self.log(key, float(metric(predictions, references)), prog_bar=True, add_dataloader_idx=False)

    # -- sharding: FSDP2 under ModelParallelStrategy (trainer=fsdp) ----------------------------------------------
    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (``trainer=fsdp``): shard the trainable model and each frozen
        model as separate FSDP2 trees over the data-parallel mesh, one unit per decoder layer
        (``lightning_gkd.sharding.shard_causal_lm``); ``trainer.precision=bf16-mixed`` becomes an FSDP2 mixed
        precision policy. Without a device mesh (every other strategy) and when already sharded, nothing happens.

        Checkpoints then hold the trainable model only: frozen models are left out of ``state_dict()`` and filled
        in from the live module by ``load_state_dict``; Lightning's loader for a single-file sharded checkpoint
        checks every parameter of the module, so ``strict_loading`` is turned off for frozen models' sake."""
        mesh = self._device_mesh
        if mesh is None:
            return
        from lightning_gkd.sharding import is_sharded, mixed_precision_policy, shard_causal_lm

        if is_sharded(self.model):
            return
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"{type(self).__name__} shards with FSDP only (no tensor parallelism): set the "
                "ModelParallelStrategy's data_parallel_size to the number of processes and "
                "tensor_parallel_size=1 (trainer=fsdp does)."
            )
        mesh = mesh["data_parallel"] if "data_parallel" in names else mesh
        trainer = getattr(self, "_trainer", None)
        policy = mixed_precision_policy(getattr(trainer, "precision", None))
        shard_causal_lm(self.model, mesh, mp_policy=policy)
        for name in self.frozen_names:
            frozen = getattr(self, name, None)
            if isinstance(frozen, nn.Module):
                shard_causal_lm(frozen, mesh, mp_policy=policy)
        if self.frozen_names:
            self.register_state_dict_post_hook(_drop_frozen_state)
            self.register_load_state_dict_pre_hook(_fill_frozen_state)
            self.strict_loading = False

    def on_before_backward(self, loss: torch.Tensor) -> None:
        # A sharded frozen model keeps its root unit (embeddings, LM head) gathered after its forward, for the
        # memory-lean loss; nothing else frees it (no backward), so free it before the student's backward.
        if self._device_mesh is not None:
            from lightning_gkd.sharding import reshard

            for name in self.frozen_names:
                frozen = getattr(self, name, None)
                if isinstance(frozen, nn.Module):
                    reshard(frozen)

    def on_fit_end(self) -> None:
        # A sharded model's full weights need every rank (a collective); export() runs on rank 0 only.
        from lightning_gkd.sharding import full_state_dict

        self._full_state_dict = full_state_dict(self.model)

    # -- checkpoints and export ---------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        prefixes = tuple(f"{name}." for name in self.frozen_names)
        if prefixes:
            state = checkpoint["state_dict"]
            for key in [k for k in state if k.startswith(prefixes)]:
                del state[key]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")
        if state is None:  # ModelParallelStrategy loads the weights itself and hands over the rest
            return
        for name in self.frozen_names:
            for key, value in getattr(self, name).state_dict().items():
                state.setdefault(f"{name}.{key}", value)

    def export(
        self, path: str | Path, card_info: Mapping[str, Any] | None = None, *, merged_path: str | Path | None = None
    ) -> Path:
        """Write the trained model and tokenizer with ``save_pretrained`` to ``path``, loadable with
        ``AutoModelForCausalLM.from_pretrained(path)``, and a ``README.md`` model card: base model(s), method and
        its hyperparameters, data, steps and final metrics (read from the attached trainer, if any), plus
        ``card_info`` (extra entries, e.g. held-out scores). Written beside ``path`` first and then renamed, so
        an interrupted export never replaces a good one with a half-written folder.

        A LoRA model (a ``peft.PeftModel``, e.g. from a spec with ``lora``) writes only its adapter to ``path``
        (``adapter_config.json`` + ``adapter_model.safetensors``; load with ``peft.AutoPeftModelForCausalLM`` or
        ``PeftModel.from_pretrained(base, path)``) and, when ``merged_path`` is given, the full model with the
        adapters merged into the base weights there (``merge_and_unload`` of a copy: the training model is left
        as it is). ``merged_path`` is ignored for a model without adapters. Returns ``path`` resolved."""
        from lightning_gkd.lora import is_peft_model

        peft = is_peft_model(self.model)
        info = dict(card_info or {})
        if peft:
            info.setdefault(
                "format",
                "LoRA adapter (peft): load with peft.AutoPeftModelForCausalLM.from_pretrained"
                "(<this folder>) or PeftModel.from_pretrained(<base model>, <this folder>)",
            )
        from lightning_gkd.sharding import is_sharded

        full_state = None
        if is_sharded(self.model):
            full_state = getattr(self, "_full_state_dict", None)
            if peft or not full_state:
                raise RuntimeError(
                    "export() of a sharded model (trainer=fsdp) writes the full weights gathered "
                    "when trainer.fit ended, on global rank 0 only (and not for LoRA models)."
                )
        target = self._write_folder(path, self.model, info, state_dict=full_state)
        if merged_path is not None and peft:
            import copy

            merged = copy.deepcopy(self.model).merge_and_unload()  # type: ignore[operator]  # PEFT's; a copy: self.model keeps its adapters
            merged.requires_grad_(False)
            info["format"] = "full model: the LoRA adapters merged into the base weights"
            self._write_folder(merged_path, merged, info)
            del merged
        return target

    def _write_folder(
        self,
        path: str | Path,
        model: nn.Module,
        card_info: Mapping[str, Any],
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """``model.save_pretrained`` + tokenizer + model card into a staging folder beside ``path``, renamed into
        place (an existing folder is replaced only once the new one is complete)."""
        target = Path(path).expanduser().resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            extra = {} if state_dict is None else {"state_dict": state_dict}
            model.save_pretrained(staging, **extra)  # type: ignore[operator]  # an HF or PEFT model's
            self.tokenizer.save_pretrained(staging)
            write_model_card(staging / "README.md", self, card_info)
            if target.exists():
                old = target.with_name(f".{target.name}-old")
                shutil.rmtree(old, ignore_errors=True)
                target.rename(old)
                staging.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target


def _drop_frozen_state(module: CausalLMModule, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` post-hook of a sharded module: leave the frozen models out (checkpoints never hold them)."""
    prefixes = tuple(f"{prefix}{name}." for name in module.frozen_names)
    for key in [k for k in state_dict if k.startswith(prefixes)]:
        del state_dict[key]


def _fill_frozen_state(module: CausalLMModule, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook of a sharded module: the frozen models keep their live weights."""
    for name in module.frozen_names:
        for key, value in getattr(module, name).state_dict().items():
            state_dict.setdefault(f"{prefix}{name}.{key}", value)
