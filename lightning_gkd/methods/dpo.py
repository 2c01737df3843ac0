"""DPOModule: direct preference optimisation (and its variants) of a policy against a frozen reference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.evaluation.settings import ValidationSettings
from lightning_gkd.losses.base import Logged, LossOutput
from lightning_gkd.methods.base import CausalLMModule, Group, settings_group
from lightning_gkd.models.loading import ModelSource, limit_output_rows, shared_vocab_rows, vocab_size
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.divergence.preference import (
    check_preference_args,
    preference_loss,
    sequence_logps,
    unused_label_smoothing,
)
from lightning_gkd.ops.hf.forward import accepts_logits_to_keep, eval_mode, is_peft_model
from lightning_gkd.ops.hf.model_inputs import lm_inputs
from lightning_gkd.training.settings import TrainingSettings

_BATCH_KEYS = ("input_ids", "attention_mask", "labels")
_CHECKPOINT_KEY = "dpo_reference_logps"


class DPOModule(CausalLMModule):
    """Train a policy (``self.model``) on preference pairs against a frozen reference (Rafailov et al., DPO).

    Each batch holds ``B`` pairs as ``2B`` sequences, ``[prompt+chosen; prompt+rejected]`` (``PreferenceDataModule``
    builds it); one policy forward covers both halves. The loss is ``preference_loss`` averaged over the pairs:
    ``loss_type`` ``"sigmoid"`` (DPO), ``"hinge"``, ``"ipo"``, ``"robust"``, ``"exo_pair"`` (TRL 1.16's losses and
    values) or ``"cdpo"`` (conservative DPO). ``label_smoothing`` ε is read by ``cdpo``, ``robust`` and ``exo_pair``
    only, as in TRL 1.16 (a warning says so when it is set for another loss). Override ``pair_loss`` for a new
    objective.

    The reference, in order of precedence:

    - ``reference``: an ``nn.Module``, folder, hub id or spec mapping
      (``lightning_gkd.models.loading.load_causal_lm``), e.g. the policy's starting checkpoint, possibly
      quantized; frozen, in eval mode, never in checkpoints.
    - ``reference=None`` and a PEFT policy: the same model with its adapters disabled.
    - ``reference=None`` and ``precompute_ref_logps=True``: the policy itself at the start of training.

    With ``precompute_ref_logps=True`` the reference log-probs of every train and validation row are computed once
    when ``trainer.fit`` starts (keyed by the ``index`` the batch carries), kept with the checkpoints, and the
    reference model is then dropped. Rows may also bring their own ``ref_chosen_logps``/``ref_rejected_logps``.

    Logs ``{train,val}/loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, where rewards are ``beta * (logps - ref_logps)``,
    and ``val/<name>`` for each generation metric (greedy completions scored against the chosen completions).

    ``training`` (``TrainingSettings``) and ``validation`` (``ValidationSettings``): as ``GKDModule``'s; the loss is
    each micro-batch's mean over its pairs, so ``training.loss_normalization`` other than ``"step"`` is refused (it
    is read by the token-mean losses only).
    """

    model_role = "policy"
    data_format = "preference"  # prompt/chosen/rejected pairs (PreferenceDataModule)

    def __init__(
        self,
        model: ModelSource,
        tokenizer: PreTrainedTokenizerBase | str,
        reference: ModelSource | None = None,
        *,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        precompute_ref_logps: bool = False,
        training: Group[TrainingSettings] = None,
        validation: Group[ValidationSettings] = None,
    ) -> None:
        check_preference_args(beta, loss_type, label_smoothing)
        if note := unused_label_smoothing(loss_type, label_smoothing):
            rank_zero_warn(note)
        training = settings_group(training, self.default_training, "training")
        if training.loss_normalization != "step":
            raise ValueError(
                f"DPOModule(training.loss_normalization={training.loss_normalization!r}): the DPO loss is each "
                "micro-batch's mean over its pairs, and loss_normalization is read by the token-mean losses (GKD, "
                "OPD, SFT) only. Leave it 'step' (Hydra: drop method.training.loss_normalization)."
            )
        if isinstance(model, nn.Module) and reference is model:
            raise ValueError(
                "reference is the policy object itself, so freezing it would freeze the policy. Pass a "
                "copy (copy.deepcopy(model)), or reference=None with precompute_ref_logps=True to use "
                "the policy's starting weights without a second model."
            )
        super().__init__(model, tokenizer, training=training, validation=validation)
        if reference is not None:
            self.reference = self.load_frozen(reference, role="reference")
            self._share_vocabulary(reference)
            self.frozen_names = ("reference",)
            self.reference_source = "model"
        elif is_peft_model(self.model):
            self.reference_source = "peft"
        elif precompute_ref_logps:
            self.reference_source = "initial_policy"
        else:
            raise ValueError(
                "DPOModule needs a reference: pass reference=<model, folder, hub id or spec> (usually the "
                "policy's starting checkpoint), use a PEFT policy (the reference is then the model with "
                "adapters disabled), or set precompute_ref_logps=True (the policy's log-probs at the "
                "start of training are the reference)."
            )
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.precompute_ref_logps = precompute_ref_logps
        self.reference_logps_cache: dict[str, torch.Tensor] = {}  # split -> (num_rows, 2); NaN where not computed
        self._precomputing = False
        self.save_settings("model", "reference", "tokenizer")

    def _share_vocabulary(self, reference: ModelSource) -> None:
        """The policy and the reference compare log-probs over the vocabulary rows both have (one tokenizer, padded
        differently: ``teachers.spec.share_vocabulary``); a reference of another row count must name the policy's
        tokenizer (tokenizer files in its folder)."""
        from lightning_gkd.teachers.spec import TeacherEntry, names_same_tokenizer

        policy_rows, reference_rows = vocab_size(self.model), vocab_size(self.reference)
        if policy_rows == reference_rows or None in (policy_rows, reference_rows):
            return
        if names_same_tokenizer(TeacherEntry("local", {"model": reference}), self.tokenizer) is not True:
            raise ValueError(
                f"The policy's vocabulary has {policy_rows} rows and the reference's {reference_rows}, and the "
                "reference's tokenizer is not known to be the policy's (its folder holds no tokenizer files, or "
                "another tokenizer). DPO compares both models' log-probs of the same token ids: use a reference "
                "from the policy's family (its folder with its tokenizer), or the policy itself (reference=null)."
            )
        shared = shared_vocab_rows(self.tokenizer, {"policy": policy_rows, "reference": reference_rows})
        assert shared is not None
        limit_output_rows(self.model, shared)
        limit_output_rows(self.reference, shared)

    @property
    def policy(self) -> nn.Module:
        """The trainable model (``self.model``)."""
        return self.model

    # -- the objective: override pair_loss for a new one -------------------------------------------------------
    def pair_loss(
        self,
        chosen_logps: torch.Tensor,
        rejected_logps: torch.Tensor,
        ref_chosen_logps: torch.Tensor,
        ref_rejected_logps: torch.Tensor,
        chosen_lengths: torch.Tensor,
        rejected_lengths: torch.Tensor,
    ) -> torch.Tensor:
        """Per-pair losses ``(B,)`` from sequence log-probs ``(B,)`` and completion lengths ``(B,)``."""
        return preference_loss(
            chosen_logps,
            rejected_logps,
            ref_chosen_logps,
            ref_rejected_logps,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths,
        )

    # -- log-probs ----------------------------------------------------------------------------------------------
    def completion_logps(self, model: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence log-probs ``(2B,)`` of the completions (labels != -100) under ``model``, and their lengths."""
        labels, mask = batch["labels"], batch["attention_mask"]
        completion = labels != IGNORE_INDEX
        width = labels.shape[1]
        # Rows are left-padded, so completions sit at the right end: logits are needed only from one position
        # before the earliest completion token (saves the (2B, L, V) logits of long prompts).
        first = torch.where(completion.any(dim=1), completion.int().argmax(dim=1), width).min().item()
        keep = width - int(first) + 1
        kwargs: dict[str, Any] = {}
        if keep < width and accepts_logits_to_keep(model):
            kwargs["logits_to_keep"] = keep
        else:
            keep = width
        inputs = lm_inputs(model, batch["input_ids"], mask, batch.get("vision"))
        logits = model(**inputs, use_cache=False, **kwargs).logits
        return sequence_logps(logits[:, :-1], labels[:, width - keep + 1 :]), completion.sum(dim=1)

    @torch.no_grad()
    def reference_logps(
        self, batch: Mapping[str, torch.Tensor], split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference log-probs ``(B,)`` of the chosen and rejected completions of ``batch``: given in the batch,
        cached for ``split`` (``"train"``/``"val"``), or computed now."""
        if "ref_chosen_logps" in batch and "ref_rejected_logps" in batch:
            return batch["ref_chosen_logps"].float(), batch["ref_rejected_logps"].float()
        if split in self.reference_logps_cache:
            return self._cached(batch, split)
        return self._live_reference_logps(batch)

    def _live_reference_logps(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reference_source == "model":
            logps, _ = self.completion_logps(self.reference, batch)
        elif self.reference_source == "peft":
            with self.model.disable_adapter():  # type: ignore[operator]  # PEFT's, checked by is_peft_model
                logps, _ = self.completion_logps(self.model, batch)
        elif self.reference_source == "initial_policy" and self._precomputing:
            logps, _ = self.completion_logps(self.model, batch)  # at fit start, before any update
        else:
            raise RuntimeError(
                "No reference log-probs for this batch: precompute_ref_logps=True computes them when "
                "trainer.fit starts, for the train and validation data of its datamodule only."
            )
        return _halves(logps)

    def _cached(self, batch: Mapping[str, torch.Tensor], split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if "index" not in batch:
            raise ValueError(
                "Cached reference log-probs are looked up by row index, but the batch has no 'index'. "
                "Use PreferenceDataModule, or make your collator emit 'index' (B,) from each row's "
                "'row_index'."
            )
        cache, index = self.reference_logps_cache[split], batch["index"].cpu()
        if index.numel() and int(index.max()) >= cache.shape[0]:
            raise RuntimeError(
                f"Row {int(index.max())} of the {split} data has no cached reference log-probs "
                f"({cache.shape[0]} rows were precomputed); did the dataset change since?"
            )
        values = cache[index]
        if torch.isnan(values).any():
            raise RuntimeError(f"Some {split} rows of this batch have no cached reference log-probs.")
        values = values.to(self.device)
        return values[:, 0], values[:, 1]

    # -- precomputed reference ----------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        if not self.precompute_ref_logps:
            return
        datamodule = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        if datamodule is None:
            raise ValueError(
                "precompute_ref_logps=True reads the data from the datamodule: call "
                "trainer.fit(module, datamodule=PreferenceDataModule(...))."
            )
        missing = {}
        for split in ("train", "val"):
            if split in self.reference_logps_cache:
                continue
            loader = datamodule.train_dataloader() if split == "train" else datamodule.val_dataloader()
            if hasattr(loader, "every_row"):  # the training loader holds only this rank's share of the rows
                loader = loader.every_row()
            if isinstance(loader, (list, tuple)):
                if len(loader) > 1:
                    raise ValueError(
                        f"precompute_ref_logps=True supports one validation dataloader, got {len(loader)}."
                    )
                if not loader:
                    continue  # no validation data: nothing to precompute
                loader = loader[0]
            missing[split] = loader
        if missing and self.reference_source == "initial_policy" and self.trainer.ckpt_path:
            raise RuntimeError(
                "Resuming with precompute_ref_logps=True and no reference model, but the checkpoint "
                f"holds no reference log-probs for the {' and '.join(missing)} data, and the policy "
                "has moved from its starting weights. Pass reference=<the starting checkpoint> to "
                "recompute them."
            )
        for split, loader in missing.items():
            self.reference_logps_cache[split] = self.precompute_reference_logps(loader)
        if self.reference_source == "model":
            del self.reference  # no longer needed: free its memory
            self.frozen_names = ()
        self.reference_source = "cache"

    @torch.no_grad()
    def precompute_reference_logps(self, dataloader: Any) -> torch.Tensor:
        """``(num_rows, 2)`` reference log-probs (chosen, rejected) of every row of ``dataloader``, by row index."""
        rows: dict[int, tuple[float, float]] = {}
        self._precomputing = True
        try:
            with eval_mode(self.model):
                for batch in dataloader:
                    if "index" not in batch:
                        raise ValueError(
                            "precompute_ref_logps=True keys the cache by row index, but the batch has no "
                            "'index'. Use PreferenceDataModule, or make your collator emit 'index' (B,) "
                            "from each row's 'row_index'."
                        )
                    batch = move_data_to_device(batch, self.device)
                    with self.trainer.precision_plugin.val_step_context():
                        chosen, rejected = self._live_reference_logps(batch)
                    for i, c, r in zip(batch["index"].tolist(), chosen.tolist(), rejected.tolist(), strict=True):
                        rows[i] = (c, r)
        finally:
            self._precomputing = False
        cache = torch.full((max(rows, default=-1) + 1, 2), float("nan"))
        for i, values in rows.items():
            cache[i] = torch.tensor(values)
        return cache

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.reference_logps_cache:
            checkpoint[_CHECKPOINT_KEY] = dict(self.reference_logps_cache)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if _CHECKPOINT_KEY in checkpoint:
            self.reference_logps_cache = dict(checkpoint[_CHECKPOINT_KEY])

    # -- steps --------------------------------------------------------------------------------------------------
    def preference_step(self, batch: Mapping[str, torch.Tensor], split: str = "train") -> dict[str, torch.Tensor]:
        """The mean loss over the pairs of ``batch`` and the reward / log-prob statistics."""
        _check_batch(batch)
        pairs = batch["input_ids"].shape[0] // 2
        logps, lengths = self.completion_logps(self.model, batch)
        chosen, rejected = _halves(logps)
        ref_chosen, ref_rejected = self.reference_logps(batch, split)
        losses = self.pair_loss(chosen, rejected, ref_chosen, ref_rejected, lengths[:pairs], lengths[pairs:])
        chosen_rewards = self.beta * (chosen.detach() - ref_chosen)
        rejected_rewards = self.beta * (rejected.detach() - ref_rejected)
        return {
            "loss": losses.mean(),
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": chosen.detach().mean(),
            "logps/rejected": rejected.detach().mean(),
        }

    def completion_loss(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        """The preference loss of a batch of pairs (a mean over its pairs), with ``preference_step``'s reward and
        log-prob statistics as logs."""
        stats = self.preference_step(batch, "val")
        pairs = batch["input_ids"].shape[0] // 2
        loss = stats.pop("loss")
        return LossOutput(loss, torch.tensor(pairs), {name: Logged(value, pairs) for name, value in stats.items()})

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        stats = self.preference_step(batch, "train")
        if self.skip_nonfinite(stats["loss"]):
            return None
        self.count_trained_tokens(batch["labels"])
        pairs = batch["input_ids"].shape[0] // 2
        for name, value in stats.items():
            self.log(f"train/{name}", value, prog_bar=name in ("loss", "rewards/accuracies"), batch_size=pairs)
        return stats["loss"]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        stats = self.preference_step(batch, "val")
        pairs = batch["input_ids"].shape[0] // 2
        prefix = self.val_prefix(dataloader_idx)  # val/, or val/<name>/ for named validation sets
        for name, value in stats.items():
            self.log(
                f"{prefix}{name}",
                value,
                prog_bar=name in ("loss", "rewards/accuracies"),
                sync_dist=True,
                batch_size=pairs,
                add_dataloader_idx=self.val_names() is None,
            )
        # greedy completions of the prompts, scored against the chosen completions (the first half's labels); the
        # prompts' images are the first half's too (``vision`` holds one entry per sequence)
        prompts = {**batch, "labels": batch["labels"][:pairs]}
        if batch.get("vision") is not None:
            prompts["vision"] = batch["vision"][:pairs]
        self.collect_generations(prompts, dataloader_idx)
        return stats["loss"]


def _halves(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = values.shape[0] // 2
    return values[:pairs], values[pairs:]


def _check_batch(batch: Mapping[str, Any]) -> None:
    missing = [key for key in _BATCH_KEYS if key not in batch]
    if missing:
        raise ValueError(
            f"The preference batch has no {missing} (keys: {sorted(batch)}). DPOModule expects "
            "'input_ids', 'attention_mask', 'labels' of shape (2B, L), chosen rows first, as "
            "PreferenceCollator builds them; a custom collator must emit these too."
        )
    rows = batch["input_ids"].shape[0]
    if "prompts" in batch and batch["prompts"].shape[0] == rows:
        raise ValueError(
            "This looks like a chat batch (one sequence per prompt, as ChatDataModule builds), not "
            "preference pairs. DPOModule needs PreferenceDataModule (Hydra: data=toy_preference or "
            "data=preference_files)."
        )
    if rows % 2:
        raise ValueError(
            f"The preference batch has {rows} sequences; it must hold 2B: B prompt+chosen rows, then "
            "B prompt+rejected rows."
        )
