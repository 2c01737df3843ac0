"""A model's own completions of held-out prompts, greedy or sampled, with the figures a study reads from them: the
task metric, the EOS rate, the mean length and the model's next-token entropy on what it wrote."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.evaluation.metrics import GenerationMetric, decode_until_eos
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.sampling import generate_completions
from lightning_gkd.ops.hf.forward import resolve_eos_token_id, resolve_pad_token_id

#: the seed of a sampled batch is ``sample_seed * SEED_STRIDE + its first row``: each batch its own stream
SEED_STRIDE = 1000


@dataclass(frozen=True)
class CompletionScores:
    """What ``score_completions`` measured: ``texts`` (decoded up to EOS, one per row), ``accuracy`` (the task
    metric against the rows' last message), ``eos_rate`` (share of rows that ended with EOS within the budget),
    ``mean_length`` (characters) and ``entropy`` (mean next-token entropy in nats over the completion tokens)."""

    texts: list[str]
    accuracy: float
    eos_rate: float
    mean_length: float
    entropy: float

    def figures(self) -> dict[str, float]:
        """The scalar figures (everything but the texts)."""
        return {key: value for key, value in asdict(self).items() if key != "texts"}


@torch.no_grad()
def score_completions(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    *,
    metric: GenerationMetric,
    max_length: int,
    max_new_tokens: int,
    sample_seed: int | None = None,
    batch_size: int = 256,
) -> CompletionScores:
    """Complete the prompts of ``rows`` greedily (``sample_seed`` None) or at temperature 1 (batch ``i`` seeded by
    ``sample_seed * SEED_STRIDE + i * batch_size``), and score them (``CompletionScores``). The model's training
    flag is restored afterwards."""
    collator = ChatMLCollator(tokenizer, max_length=max_length)
    eos = resolve_eos_token_id(model, tokenizer)
    eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos])
    texts: list[str] = []
    ended = 0
    entropy_sum, entropy_tokens = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(rows), batch_size):
            batch = collator(list(rows[start : start + batch_size]))
            out = generate_completions(
                model,
                batch["prompts"],
                batch["prompt_attention_mask"],
                max_new_tokens=max_new_tokens,
                pad_token_id=resolve_pad_token_id(tokenizer),
                eos_token_id=eos,
                do_sample=sample_seed is not None,
                temperature=1.0,
                seed=None if sample_seed is None else sample_seed * SEED_STRIDE + start,
            )
            new = out["input_ids"][:, batch["prompts"].shape[1] :]
            ended += int(torch.isin(new, eos_ids.to(new.device)).any(dim=1).sum())
            texts += decode_until_eos(tokenizer, new.tolist(), eos)
            logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits[:, :-1].float()
            supervised = out["labels"][:, 1:] != IGNORE_INDEX
            log_probs = torch.log_softmax(logits[supervised], dim=-1)
            entropy_sum += float(-(log_probs.exp() * log_probs).sum())
            entropy_tokens += int(supervised.sum())
    finally:
        model.train(was_training)
    references = [row["messages"][-1]["content"] for row in rows]
    return CompletionScores(
        texts=texts,
        accuracy=float(metric(texts, references)),
        eos_rate=ended / len(rows),
        mean_length=statistics.fmean(len(text) for text in texts),
        entropy=entropy_sum / max(entropy_tokens, 1),
    )
