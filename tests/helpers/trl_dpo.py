"""TRL 1.16's DPO as a test-only oracle: its loss on given sequence log-probs, and its tokenization + truncation.

Both call TRL's own code: ``DPOTrainer._compute_loss`` with a minimal stand-in ``self`` and a stand-in model that
returns the per-token log-probs TRL's fused head would (so its sums are the sequence log-probs we pass), and
``DPOTrainer._prepare_dataset`` + ``DataCollatorForPreference`` for the token ids. Building a real ``DPOTrainer``
would need a model TRL can patch with its fused head and an ``accelerate`` state; neither changes these numbers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch


class _PerTokenLogps(torch.nn.Module):
    """Stands in for a policy under TRL's fused LM head: per-token log-probs that sum to given sequence log-probs
    over each row's completion positions (0 elsewhere, as the fused head gives for label -100)."""

    def __init__(self, logps: torch.Tensor) -> None:
        super().__init__()
        self.logps = logps

    def forward(self, *, labels: torch.Tensor, **_: Any) -> SimpleNamespace:
        completion = (labels[:, 1:] != -100).to(self.logps.dtype)
        per_token = completion * (self.logps / completion.sum(1)).unsqueeze(1)
        zeros = torch.zeros_like(per_token)
        return SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def trl_dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    loss_type: str,
    beta: float,
    label_smoothing: float,
    chosen_lengths: Sequence[int],
    rejected_lengths: Sequence[int],
) -> torch.Tensor:
    """TRL 1.16's DPO batch loss (the mean over pairs) for these sequence log-probs and completion lengths."""
    from trl.trainer.dpo_trainer import DPOTrainer

    pairs = len(chosen_lengths)
    lengths = [*chosen_lengths, *rejected_lengths]
    width = 2 + max(lengths)  # one prompt token, then the completion, then right padding
    completion_mask = torch.zeros(2 * pairs, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        completion_mask[row, 1 : 1 + length] = 1
    inputs = {
        "input_ids": torch.full((2 * pairs, width), 5),
        "attention_mask": torch.ones(2 * pairs, width, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    identity = lambda tensor: tensor  # noqa: E731  # one process: gathering is the identity
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=identity, gather_for_metrics=identity),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        args=SimpleNamespace(discopop_tau=0.05),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    model = _PerTokenLogps(torch.cat([chosen, rejected]))
    return DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)


def trl_preference_sequences(
    tokenizer: Any, rows: Sequence[Mapping[str, Any]], *, max_length: int, truncation_mode: str
) -> tuple[list[list[int]], list[list[int]]] | None:
    """TRL 1.16's ``(input ids, completion masks)`` of ``[prompt+chosen; prompt+rejected]`` for ``rows``, unpadded,
    after its tokenization and truncation; None when TRL drops every row (a prompt that fills ``max_length``)."""
    import warnings

    from datasets import Dataset
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL 1.16 deprecates keep_end
        args = DPOConfig(
            output_dir="unused",
            max_length=max_length,
            truncation_mode=truncation_mode,
            report_to=[],
            use_cpu=True,
            bf16=False,
        )
    stand_in = SimpleNamespace(_tokenizer=tokenizer)
    dataset = DPOTrainer._prepare_dataset(stand_in, Dataset.from_list(list(rows)), tokenizer, args, "train")
    if len(dataset) == 0:
        return None
    collate = DataCollatorForPreference(
        pad_token_id=tokenizer.pad_token_id, max_length=max_length, truncation_mode=truncation_mode
    )
    batch = collate([dict(example) for example in dataset])
    real = batch["attention_mask"].bool()
    ids = [row[mask].tolist() for row, mask in zip(batch["input_ids"], real, strict=True)]
    completion = [row[mask].tolist() for row, mask in zip(batch["completion_mask"], real, strict=True)]
    return ids, completion
