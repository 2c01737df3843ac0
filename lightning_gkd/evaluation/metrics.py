"""Generation-based evaluation: greedy completions of held-out prompts, decoded and scored against references."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.vision_chat import VisionChatCollator
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.sampling import complete_prompts, completion_lengths
from lightning_gkd.ops.hf.forward import EosTokenId, resolve_eos_token_id
from lightning_gkd.ops.hf.model_inputs import has_images

# A metric scores a whole evaluation set: predictions and references are decoded completion texts.
GenerationMetric = Callable[[Sequence[str], Sequence[str]], float]


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of predictions equal to their reference (surrounding whitespace ignored)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references.")
    if not predictions:
        return 0.0
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True)) / len(predictions)


def gap_closed(after: float, before: float, teacher: float) -> float | None:
    """The recovered fraction of the teacher–student gap on a score where higher is better (an accuracy):
    ``(after − before) / (teacher − before)``. 1: the student reached its teacher; 0: no change from its start
    (``before``); below 0: worse than its start; above 1: past its teacher.

    None when the teacher is not better than the start (``teacher <= before``, or either is NaN): there is no gap
    to close, and the ratio would be meaningless (a division by zero, or a sign that flips). Reports show it as
    ``n/a``."""
    if not teacher > before:
        return None
    return (after - before) / (teacher - before)


def gaps_closed(
    after: Mapping[str, float], before: Mapping[str, float], teacher: Mapping[str, float]
) -> dict[str, float | None]:
    """``gap_closed`` per metric, for each metric name all three score mappings have (``{name: value}``)."""
    return {
        name: gap_closed(after[name], before[name], teacher[name])
        for name in after
        if name in before and name in teacher
    }


def decode_until_eos(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[Sequence[int]], eos_token_id: EosTokenId
) -> list[str]:
    """Decode each row up to (not including) its first EOS, without special tokens."""
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    cut_rows = []
    for row in rows:
        ids = list(row)
        cut = next((i for i, token in enumerate(ids) if token in eos), len(ids))
        cut_rows.append(ids[:cut])
    return tokenizer.batch_decode(cut_rows, skip_special_tokens=True)


def reference_texts(
    tokenizer: PreTrainedTokenizerBase, batch: Mapping[str, torch.Tensor], eos_token_id: EosTokenId
) -> list[str]:
    """The dataset completions of a collated batch (its label positions), decoded up to EOS."""
    labels = batch["labels"]
    return decode_until_eos(tokenizer, [row[row != IGNORE_INDEX].tolist() for row in labels], eos_token_id)


@torch.no_grad()
def greedy_completions(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    batch: Mapping[str, Any],
    *,
    max_new_tokens: int,
    eos_token_id: EosTokenId | None = None,
    sampler: Any = None,
) -> torch.Tensor:
    """The greedy completion tokens ``(B, N)`` of the batch prompts, ``N <= max_new_tokens`` (after a row's first
    EOS: padding); through ``sampler.greedy`` (a ``lightning_gkd.samplers.Sampler``) when it decodes (a serving
    engine) and the prompts hold no images, else our KV-cache decoder (with the batch's images, ``vision``)."""
    prompts, mask, vision = batch["prompts"], batch["prompt_attention_mask"], batch.get("vision")
    engine = sampler is not None and not has_images(vision)  # prompts with images decode in process
    out = sampler.greedy(model, prompts, mask, max_new_tokens=max_new_tokens) if engine else None
    if out is None:
        out = complete_prompts(
            model, tokenizer, prompts, mask, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, vision=vision
        )
    return out["input_ids"][:, prompts.shape[1] :]


def evaluate_generations(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    *,
    metrics: Mapping[str, GenerationMetric] | None = None,
    batch_size: int = 64,
    max_new_tokens: int = 32,
    max_length: int = 1024,
    sampler: Any = None,
    processor: Any = None,
) -> dict[str, float]:
    """Greedy-decode the prompts of ``rows`` (chat rows whose last turn is the reference answer) and score them;
    through ``sampler.greedy`` when the sampler decodes (see ``greedy_completions``).

    Rows with images need their model's ``processor`` (``data.vision_chat``).
    Returns ``{name: metric(predictions, references)}``; the default metric is ``{"accuracy": exact_match}``.
    """
    metrics = metrics or {"accuracy": exact_match}
    collator = (
        ChatMLCollator(tokenizer, max_length=max_length)
        if processor is None
        else VisionChatCollator(processor, max_length=max_length, name="test_data")
    )
    eos = resolve_eos_token_id(model, tokenizer)
    device = next(model.parameters()).device
    predictions: list[str] = []
    references: list[str] = []
    for start in range(0, len(rows), batch_size):
        chunk = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
        batch = move_data_to_device(collator(chunk), device)
        completions = greedy_completions(
            model, tokenizer, batch, max_new_tokens=max_new_tokens, eos_token_id=eos, sampler=sampler
        )
        predictions += decode_until_eos(tokenizer, completions.tolist(), eos)
        references += reference_texts(tokenizer, batch, eos)
    return {name: float(metric(predictions, references)) for name, metric in metrics.items()}


class GenerationScores:
    """Greedy completions and their references, collected per validation loader during an epoch and scored at its
    end (gathered over every process first)."""

    def __init__(self) -> None:
        self._texts: dict[int, tuple[list[str], list[str]]] = {}

    def add(self, dataloader_idx: int, predictions: Sequence[str], references: Sequence[str]) -> None:
        preds, refs = self._texts.setdefault(dataloader_idx, ([], []))
        preds.extend(predictions)
        refs.extend(references)

    def compute(self, metrics: Mapping[str, GenerationMetric], names: Sequence[str] | None = None) -> dict[str, float]:
        """``{key: value}`` for every metric and loader, then forget the texts. Keys: ``val/<set name>/<metric>``
        with named sets, ``val/<metric>/dataloader_idx_<i>`` with several unnamed loaders, else ``val/<metric>``.
        A collective under ``torch.distributed``: every process must call it."""
        texts, self._texts = self._texts, {}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, texts)
            texts = {}
            for part in gathered:
                for idx, (preds, refs) in part.items():
                    into = texts.setdefault(idx, ([], []))
                    into[0].extend(preds)
                    into[1].extend(refs)
        values = {}
        for idx in sorted(texts):
            predictions, references = texts[idx]
            for name, metric in metrics.items():
                if names:
                    key = f"val/{names[idx]}/{name}"
                elif len(texts) > 1:
                    key = f"val/{name}/dataloader_idx_{idx}"
                else:
                    key = f"val/{name}"
                values[key] = float(metric(predictions, references))
        return values


@dataclass
class CompletionLengths:
    """Running sums over completions (``add``): their tokens up to and including the first EOS
    (``ops.sampling.completion_lengths``), rows, and rows that emitted an EOS. Sums, so that ranks reduce exactly
    (``reduced``): the mean length is ``tokens / rows`` over every rank's rows, not a mean of per-rank means."""

    tokens: int = 0
    rows: int = 0
    stopped: int = 0

    def add(self, completion_ids: torch.Tensor, eos_token_id: EosTokenId) -> None:
        """Count generated tokens ``(B, N)`` (padding after a row's first EOS is not counted)."""
        lengths, stopped = completion_lengths(completion_ids, eos_token_id)
        self.tokens += int(lengths.sum())
        self.rows += int(lengths.numel())
        self.stopped += int(stopped.sum())

    def reduced(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> CompletionLengths:
        """The sums over every process: ``reduce_sum`` adds a tensor over them (e.g. ``trainer.strategy.reduce(t,
        reduce_op="sum")``; a collective, every process must call it)."""
        totals = reduce_sum(torch.tensor([self.tokens, self.rows, self.stopped], dtype=torch.long, device=device))
        tokens, rows, stopped = (int(value) for value in totals.tolist())
        return CompletionLengths(tokens, rows, stopped)

    @property
    def mean_length(self) -> float:
        """Mean completion tokens per row, EOS included (0 without rows)."""
        return self.tokens / self.rows if self.rows else 0.0

    @property
    def eos_rate(self) -> float:
        """The share of rows that emitted an EOS within the token budget (0 without rows)."""
        return self.stopped / self.rows if self.rows else 0.0
