"""Grouped generation for a method that samples its completions (``GKDModule``): one sampling call per group of
``steps_per_generation`` micro-batches (``ChatDataModule(steps_per_generation=k)``), shuffled and cut into the
group's micro-batches; the pending micro-batches are saved in checkpoints, so a run resumed inside a group trains
on the same samples."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_gkd.data.loader import GenerationGroup, group_slot, shuffled_micro_batches

Source = Literal["dataset", "student", "teacher"]  # where a batch's completions come from
_SAMPLE, _SHUFFLE = 1, 2  # salts that keep the sampler's and the shuffle's streams apart (the coin flip's is 0)


class GroupedGeneration:
    """Mixin: ``training_batch`` and the group's checkpointed plan. The method defines ``choose_source`` (the coin
    flip), ``sample_batch`` and ``_sampler_model`` (which model samples for a source)."""

    _group: GenerationGroup | None = None
    global_rank: int
    device: torch.device

    if TYPE_CHECKING:  # provided by the method (and CausalLMModule's step_seed); stubs here would shadow them

        def choose_source(self, batch_idx: int) -> Source: ...

        def sample_batch(self, model: torch.nn.Module | None, batch: dict[str, Any], seed: int) -> dict[str, Any]: ...

        def _sampler_model(self, source: Source) -> torch.nn.Module | None: ...

        def step_seed(self, batch_idx: int, *salt: int) -> int: ...

    def training_batch(self, batch: dict[str, Any], batch_idx: int) -> tuple[Source, dict[str, torch.Tensor]]:
        """The batch this step trains on and where its completions come from.

        A plain batch is its own group. A grouped micro-batch (``lightning_gkd.data.loader.group_slot``) uses its
        group's plan, made at the group's first micro-batch: the dataset micro-batch itself, or its share of the
        group's shuffled samples."""
        slot = group_slot(batch)
        if slot is None:
            source = self.choose_source(batch_idx)
            if source != "dataset":
                batch = self.sample_batch(
                    self._sampler_model(source), batch, seed=self.step_seed(batch_idx, _SAMPLE, self.global_rank)
                )
            return source, batch
        if self._group is None or self._group.group_id != slot.group_id:
            self._group = self.plan_group(slot.group, slot.group_id, slot.micro_batch_size, batch_idx)
        if self._group.source == "dataset":
            return "dataset", batch
        return cast(Source, self._group.source), move_data_to_device(self._group.micro_batches[slot.step], self.device)

    def plan_group(
        self, group: dict[str, torch.Tensor], group_id: list[int], micro_batch_size: int, batch_idx: int
    ) -> GenerationGroup:
        """Flip the group's coin; if it says sample, sample the whole group at once, shuffle and cut it."""
        source = self.choose_source(batch_idx)
        if source == "dataset":
            return GenerationGroup(group_id, source)
        sampled = self.sample_batch(
            self._sampler_model(source), group, seed=self.step_seed(batch_idx, _SAMPLE, self.global_rank)
        )
        seed = self.step_seed(batch_idx, _SHUFFLE, self.global_rank)
        return GenerationGroup(group_id, source, shuffled_micro_batches(sampled, micro_batch_size, seed))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]  # the LightningModule's, via the method
        if self._group is not None:  # a resumed run continues the group with the same samples
            checkpoint["generation_group"] = self._group.state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        plan = checkpoint.get("generation_group")
        self._group = GenerationGroup(**plan) if plan is not None else None
