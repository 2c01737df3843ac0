"""Grouped generation batches: one sampling call covers ``k`` training micro-batches.

On-policy distillation spends most of a step sampling. With ``steps_per_generation = k`` the training loader reads
``k * batch_size`` prompts at a time (a *group*); the module samples completions for the whole group in one call,
shuffles the result and trains ``k`` micro-batches on it, one optimizer (or accumulation) step each.

The loader owns its sharding: every rank gets distinct rows, whole groups, and the same number of micro-batches, so
no group is split across ranks (Lightning's distributed sampler wrapping would split it). It is resumable: its
state (epoch and micro-batches consumed) lives in Lightning checkpoints, and a resumed run continues with the very
next micro-batch of the same shuffled order."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader, Dataset, Sampler

#: Keys of a grouped micro-batch besides the collated rows: the whole group's batch (for the one sampling call),
#: which micro-batch of the group this is, the micro-batch size the group is cut into, and the group's id.
GENERATION_GROUP = "generation_group"
GROUP_STEP = "group_step"
MICRO_BATCH_SIZE = "micro_batch_size"
GROUP_ID = "group_id"
#: Key of a batch from a loader that looks ahead (``GroupedBatches(ahead=k)``): the batches that became visible with
#: it, as ``[(offset, batch), ...]``, ``offset`` batches after this one (asynchronous rollouts sample them early).
UPCOMING = "upcoming"

# Batch keys padded on the left (or trimmed on both sides) with their attention mask, by the mask that governs them.
_MASK_OF = {
    "input_ids": "attention_mask",
    "attention_mask": "attention_mask",
    "labels": "attention_mask",
    "sampled_logprobs": "attention_mask",  # the samplers' log-prob of each token, at its own column
    "prompts": "prompt_attention_mask",
    "prompt_attention_mask": "prompt_attention_mask",
}


def resolve_steps_per_generation(
    batch_size: int, steps_per_generation: int | None, generation_batch_size: int | None
) -> int:
    """``k`` from either ``steps_per_generation`` or ``generation_batch_size`` (= ``k * batch_size``)."""
    if steps_per_generation is not None and generation_batch_size is not None:
        raise ValueError(
            f"Set steps_per_generation ({steps_per_generation}) or generation_batch_size "
            f"({generation_batch_size}), not both: generation_batch_size = steps_per_generation * "
            "batch_size."
        )
    if generation_batch_size is not None:
        if generation_batch_size < 1 or generation_batch_size % batch_size:
            suggested = batch_size * max(1, round(generation_batch_size / batch_size))
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}) must be a positive multiple of "
                f"batch_size ({batch_size}): each group is split into micro-batches of batch_size "
                f"rows. Use e.g. generation_batch_size={suggested}."
            )
        return generation_batch_size // batch_size
    k = 1 if steps_per_generation is None else steps_per_generation
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"steps_per_generation must be an integer >= 1, got {steps_per_generation!r}.")
    return k


def rank_groups(
    num_rows: int, *, group_size: int, epoch: int, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1
) -> list[list[int]]:
    """Row indices of the groups ``rank`` trains on in ``epoch``.

    The rows are permuted with a generator seeded by ``(seed, epoch)`` (identity when ``shuffle`` is False) and cut
    into global groups of ``world_size * group_size`` rows; rank ``r`` takes the ``r``-th slice of ``group_size``
    of each. Rows left over (fewer than a global group) are split evenly across ranks as one smaller last group
    (fewer than ``world_size`` rows are dropped), so every rank sees the same number of rows.
    """
    if shuffle:
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    else:
        order = list(range(num_rows))
    span = world_size * group_size
    full = num_rows // span
    groups = [order[g * span + rank * group_size : g * span + (rank + 1) * group_size] for g in range(full)]
    tail = order[full * span :]
    per_rank = len(tail) // world_size
    if per_rank:
        groups.append(tail[rank * per_rank : (rank + 1) * per_rank])
    return groups


def select_rows(batch: Mapping[str, Any], rows: torch.Tensor | Sequence[int]) -> dict[str, Any]:
    """The given rows of a left-padded (or prompt-left, completion-right padded) batch, with columns that are
    padding in every selected row trimmed away.

    Args:
        batch: ``input_ids``/``attention_mask``/``labels`` (and a sampled batch's ``sampled_logprobs``) ``(B, L)``
            and optionally ``prompts``/``prompt_attention_mask`` ``(B, P)``; other tensors with first dimension
            ``B`` and lists of length ``B`` are row-selected; anything else is kept as is.
        rows: indices of the rows to keep, in that order.

    Returns:
        The same keys; tensors governed by a mask are cut to the columns where any selected row has a 1.
    """
    index = torch.as_tensor(rows, dtype=torch.long)
    size = batch["input_ids"].shape[0] if "input_ids" in batch else None
    spans: dict[str, slice] = {}
    for mask_key in ("attention_mask", "prompt_attention_mask"):
        if mask_key in batch:
            used = batch[mask_key].index_select(0, index.to(batch[mask_key].device)).any(dim=0).nonzero()
            spans[mask_key] = slice(int(used[0]), int(used[-1]) + 1) if len(used) else slice(0, 0)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == size:
            value = value.index_select(0, index.to(value.device))
            if key in _MASK_OF and _MASK_OF[key] in spans:
                value = value[:, spans[_MASK_OF[key]]]
        elif isinstance(value, list) and len(value) == size:  # a carried column (ChatMLCollator's columns)
            value = [value[row] for row in index.tolist()]
        out[key] = value
    return out


def micro_batch_rows(group_rows: int, batch_size: int) -> list[range]:
    """Positions within a group of each of its micro-batches: consecutive runs of ``batch_size`` (the last may be
    shorter)."""
    return [range(start, min(start + batch_size, group_rows)) for start in range(0, group_rows, batch_size)]


@dataclass(frozen=True)
class GroupSlot:
    """Where a grouped micro-batch sits: its whole group's batch, the group's id ``[epoch, index]``, this
    micro-batch's index in the group and the micro-batch size the group is cut into."""

    group: dict[str, Any]
    group_id: list[int]
    step: int
    micro_batch_size: int


def group_slot(batch: Mapping[str, Any]) -> GroupSlot | None:
    """The slot of a micro-batch from ``GroupedBatches`` with ``steps_per_generation > 1``; None for a plain batch
    (its own group)."""
    group = batch.get(GENERATION_GROUP)
    if group is None:
        return None
    return GroupSlot(
        group=group,
        group_id=[int(v) for v in batch[GROUP_ID].tolist()],
        step=int(batch[GROUP_STEP]),
        micro_batch_size=int(batch[MICRO_BATCH_SIZE]),
    )


@dataclass
class GenerationGroup:
    """A method's plan for a group under grouped generation: where its completions come from (``source``, e.g.
    "dataset" or "student") and, when sampled, the shuffled micro-batches cut from the one sampling call. Saved in
    checkpoints (``state``) so a run resumed inside a group trains on the same samples."""

    group_id: list[int]
    source: str
    micro_batches: list[dict[str, Any]] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        """A checkpointable copy (tensors on the CPU); ``GenerationGroup(**state)`` restores it."""
        return {
            "group_id": list(self.group_id),
            "source": self.source,
            "micro_batches": [move_data_to_device(micro, "cpu") for micro in self.micro_batches],
        }


def shuffled_micro_batches(
    group: Mapping[str, Any], micro_batch_size: int, seed: int, *, parts: int | None = None
) -> list[dict[str, Any]]:
    """A (sampled) group batch cut into micro-batches of ``micro_batch_size`` rows after a permutation of its rows
    seeded by ``seed``; each micro-batch trimmed to its own columns (``select_rows``). ``parts``: the number of
    micro-batches the group must give (its training steps); a group with more rows than that many micro-batches of
    ``micro_batch_size`` hold (a rollout's transcripts split into segments) is cut into ``parts`` near-equal ones."""
    rows = group["input_ids"].shape[0]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    spans = micro_batch_rows(rows, micro_batch_size)
    if parts is not None and len(spans) != parts:
        sizes = [rows // parts + (index < rows % parts) for index in range(parts)]
        starts = [sum(sizes[:index]) for index in range(parts)]
        spans = [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    return [select_rows(group, order[list(span)]) for span in spans]


class _GroupIndexSampler(Sampler[list[int]]):
    """Yields each group's row indices (a batch sampler for ``DataLoader``), starting at ``start_group``."""

    def __init__(self, groups: list[list[int]], start_group: int) -> None:
        self.groups, self.start_group = groups, start_group

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.groups[self.start_group :]

    def __len__(self) -> int:
        return len(self.groups) - self.start_group


class GroupedBatches:
    """The training loader of grouped generation: micro-batches of ``batch_size`` rows, in groups of
    ``steps_per_generation``.

    Each item is the collated micro-batch (``input_ids``, ``attention_mask``, ``labels``, ``prompts``,
    ``prompt_attention_mask``) and, when ``steps_per_generation > 1``, also ``generation_group`` (the whole group's
    collated batch, on which a module samples once), ``group_step`` (0-based index of this micro-batch in its
    group), ``micro_batch_size`` (the loader's ``batch_size``) and ``group_id`` (``[epoch, group index]``). With
    ``steps_per_generation == 1`` an item is just the collated batch.

    Args:
        dataset: indexable rows (``RowDataset``).
        collate_fn: rows -> batch (``ChatMLCollator``).
        batch_size: rows per micro-batch (per rank).
        steps_per_generation: micro-batches per group.
        shuffle, seed: the row order of epoch ``e`` is a permutation seeded by ``(seed, e)``.
        rank, world_size: this process's share (see :func:`rank_groups`).
        num_workers: DataLoader workers that collate whole groups.
        ahead: how many batches ahead each batch announces (``UPCOMING``): the first batch of a pass carries the next
            ``ahead`` batches, each later one the batch ``ahead`` after it (none past the pass's end); 0: none.
            Only with ``steps_per_generation == 1``.
        epoch_fn: returns the current epoch (the trainer's); without it the loader counts its own passes.
        consumed_fn: returns how many micro-batches of the current epoch training has consumed, for
            ``state_dict`` (the trainer's progress; a loader's own count runs ahead by what is prefetched).
    """

    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Mapping[str, Any]],
        *,
        batch_size: int,
        steps_per_generation: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        ahead: int = 0,
        epoch_fn: Callable[[], int] | None = None,
        consumed_fn: Callable[[], int] | None = None,
    ) -> None:
        if ahead < 0 or (ahead and steps_per_generation > 1):
            raise ValueError(
                f"A loader looks ahead by ahead >= 0 batches, and only without grouped generation; got ahead={ahead} "
                f"with steps_per_generation={steps_per_generation}."
            )
        self.ahead = ahead
        self.dataset, self.collate_fn = dataset, collate_fn
        self.batch_size, self.steps_per_generation = batch_size, steps_per_generation
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.num_workers = num_workers
        self.epoch_fn, self.consumed_fn = epoch_fn, consumed_fn
        self.group_size = batch_size * steps_per_generation
        # Map-style datasets define __len__; torch's Dataset type does not declare it.
        self.num_rows: int = len(dataset)  # type: ignore[arg-type]
        if self.num_rows < world_size:
            raise ValueError(f"{self.num_rows} training rows cannot be shared by {world_size} processes.")
        self._passes = 0
        self._yielded = 0
        self._epoch: int | None = None
        self._resume: dict[str, int] | None = None

    def groups(self, epoch: int) -> list[list[int]]:
        """This rank's groups (row indices) in ``epoch``."""
        return rank_groups(
            self.num_rows,
            group_size=self.group_size,
            epoch=epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            rank=self.rank,
            world_size=self.world_size,
        )

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (the same in every epoch)."""
        return sum(len(micro_batch_rows(len(group), self.batch_size)) for group in self.groups(0))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.ahead:
            yield from self._batches()
            return
        batches = self._batches()
        window = deque(itertools.islice(batches, self.ahead + 1))  # this batch and the next `ahead`
        upcoming = list(enumerate(list(window)[1:], start=1))
        while window:
            yield {**window.popleft(), UPCOMING: upcoming}
            later = next(batches, None)
            upcoming = [] if later is None else [(self.ahead, later)]  # `ahead` after the next batch
            if later is not None:
                window.append(later)

    def _batches(self) -> Iterator[dict[str, Any]]:
        epoch = self.epoch_fn() if self.epoch_fn is not None else self._passes
        self._passes += 1
        skip = 0
        if self._resume is not None:
            if self._resume["epoch"] == epoch:
                skip = self._resume["consumed"]
            self._resume = None
        self._epoch, self._yielded = epoch, skip
        groups = self.groups(epoch)
        # Whole groups already consumed are not even collated; the rest of a partly consumed group is.
        start_group, consumed_in_group = 0, skip
        while start_group < len(groups):
            steps = len(micro_batch_rows(len(groups[start_group]), self.batch_size))
            if consumed_in_group < steps:
                break
            consumed_in_group -= steps
            start_group += 1
        loader = DataLoader(
            self.dataset,
            batch_sampler=_GroupIndexSampler(groups, start_group),
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
        )
        for group_index, group in enumerate(loader, start=start_group):
            micro = micro_batch_rows(len(groups[group_index]), self.batch_size)
            for step, rows in enumerate(micro):
                if group_index == start_group and step < consumed_in_group:
                    continue
                self._yielded += 1
                if self.steps_per_generation == 1:
                    yield group
                    continue
                yield {
                    **select_rows(group, list(rows)),
                    GENERATION_GROUP: group,
                    GROUP_STEP: step,
                    MICRO_BATCH_SIZE: self.batch_size,
                    GROUP_ID: torch.tensor([epoch, group_index]),
                }

    def every_row(self) -> GroupedBatches:
        """A plain loader over every row once, in order, on any rank (for passes over the whole dataset, such as
        precomputing reference log-probs), with no training state."""
        return GroupedBatches(
            self.dataset, self.collate_fn, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )

    # Lightning stores these in its checkpoints (fit loop "combined_loader" state) and restores them on resume.
    def state_dict(self) -> dict[str, int]:
        consumed = self.consumed_fn() if self.consumed_fn is not None else self._yielded
        return {"epoch": self._epoch if self._epoch is not None else 0, "consumed": int(consumed)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._resume = {"epoch": int(state["epoch"]), "consumed": int(state["consumed"])}


def trainer_loader(
    dataset: Dataset,
    collate_fn: Callable[[list[Any]], Mapping[str, Any]],
    trainer: Any,
    *,
    batch_size: int,
    steps_per_generation: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    ahead: int = 0,
) -> GroupedBatches:
    """A ``GroupedBatches`` training loader tied to ``trainer`` (``None`` outside one): this process's rank and
    the world size, the trainer's epoch, and the batches its fit loop has consumed (for resumable state)."""
    tied: dict[str, Any] = {}
    if trainer is not None:
        tied = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "epoch_fn": lambda: trainer.current_epoch,
            # batches whose step has run: a checkpoint taken now resumes after them (the loader itself runs ahead
            # by what the fit loop has prefetched)
            "consumed_fn": lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed,
        }
    return GroupedBatches(
        dataset,
        collate_fn,
        batch_size=batch_size,
        steps_per_generation=steps_per_generation,
        shuffle=shuffle,
        seed=seed,
        num_workers=num_workers,
        ahead=ahead,
        **tied,
    )
