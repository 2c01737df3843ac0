"""Evaluation: generation metrics (greedy decoding, exact match) and model cards."""

from lightning_gkd.evaluation.metrics import (
    GenerationMetric,
    decode_until_eos,
    evaluate_generations,
    exact_match,
    gap_closed,
    gaps_closed,
    reference_texts,
)
from lightning_gkd.evaluation.settings import ValidationSettings

__all__ = [
    "GenerationMetric",
    "ValidationSettings",
    "decode_until_eos",
    "evaluate_generations",
    "exact_match",
    "gap_closed",
    "gaps_closed",
    "reference_texts",
]
