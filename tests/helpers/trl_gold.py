"""TRL 1.16's GOLD ``ULDLoss`` (trl.experimental.gold) as a test-only oracle for
lightning_gkd.ops.cross_tokenizer.aligned_row_loss.

``trl_uld_loss`` builds TRL's loss from a real ``GOLDConfig`` mapped from our ``CrossTokenizerLoss`` (CPU, fp32) and
stand-in tokenizers that only expose ``get_vocab`` (all TRL reads of them). ``trl_row_loss`` lays one row out the
way TRL's trainer hands it over (a prompt, then the completion; labels -100 on the prompt; byte offsets (0, 0) on the
prompt) and returns TRL's row loss. Our logits are *shifted* (row k is the distribution for completion token k); TRL
reads the completion's logits one position earlier for ``"bayesian"`` (the same convention) but at the completion
positions themselves for ``"observed"``, so ours are placed one position later there to make TRL's slice equal ours.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import CrossTokenizerLoss

PROMPT = 2  # prompt positions before each completion in TRL's layout


def _import_gold() -> tuple[Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRLExperimentalWarning, transformers' FutureWarnings
        from trl.experimental.gold.gold_config import GOLDConfig
        from trl.experimental.gold.gold_trainer import ULDLoss
    return GOLDConfig, ULDLoss


def trl_uld_loss(
    settings: CrossTokenizerLoss,
    *,
    student_vocab: Mapping[str, int],
    teacher_vocab: Mapping[str, int],
    output_dir: Path,
) -> Any:
    """TRL's ``ULDLoss`` configured as ``settings`` (distillation weight 1, no cross-entropy term)."""
    gold_config, uld_loss = _import_gold()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = gold_config(
            output_dir=str(output_dir),
            use_cpu=True,
            bf16=False,
            report_to=[],
            use_uld_loss=True,
            use_extended_uld=settings.alignment == "bytes",
            uld_token_merge_strategy=settings.merge,
            uld_use_hybrid_loss=settings.loss == "hybrid",
            uld_hybrid_matched_weight=settings.matched_weight,
            uld_hybrid_unmatched_weight=settings.unmatched_weight,
            beta=settings.beta,
            uld_student_temperature=settings.student_temperature,
            uld_teacher_temperature=settings.teacher_temperature,
            uld_skip_student_eos=settings.skip_student_eos,
            uld_skip_teacher_eos=settings.skip_teacher_eos,
            uld_crossentropy_weight=0.0,
            uld_distillation_weight=1.0,
        )
    student = SimpleNamespace(get_vocab=lambda: dict(student_vocab))
    teacher = SimpleNamespace(get_vocab=lambda: dict(teacher_vocab))
    return uld_loss(config, student_tokenizer=student, teacher_tokenizer=teacher)


def _trl_layout(
    logits: torch.Tensor, ids: Sequence[int], spans: Sequence[Sequence[int]], merge: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [1, P+N, V], labels [1, P+N], input_ids [1, P+N], byte_offsets [1, P+N, 2])`` for one row."""
    n, vocab = logits.shape
    filler = torch.zeros(1, vocab, dtype=logits.dtype)
    if merge == "bayesian":  # TRL reads rows [P-1, P+N-1)
        rows = [filler.expand(PROMPT - 1, vocab), logits, filler]
    else:  # TRL reads rows [P, P+N)
        rows = [filler.expand(PROMPT, vocab), logits]
    layout = torch.cat(rows).unsqueeze(0)
    completion = torch.tensor(list(ids), dtype=torch.long).reshape(n)
    labels = torch.cat([torch.full((PROMPT,), -100), completion]).unsqueeze(0)
    input_ids = torch.cat([torch.full((PROMPT,), 1), completion]).unsqueeze(0)
    offsets = torch.tensor([(0, 0)] * PROMPT + [tuple(s) for s in spans], dtype=torch.long).reshape(1, PROMPT + n, 2)
    return layout, labels, input_ids, offsets


def trl_row_loss(
    uld: Any,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_ids: Sequence[int],
    teacher_ids: Sequence[int],
    student_spans: Sequence[Sequence[int]],
    teacher_spans: Sequence[Sequence[int]],
) -> torch.Tensor:
    """TRL's distillation loss of one row (the mean over its aligned groups), differentiable with respect to our
    ``[N, V]`` shifted logits."""
    merge = uld.token_merge_strategy
    s_logits, s_labels, s_input, s_offsets = _trl_layout(student_logits, student_ids, student_spans, merge)
    t_logits, t_labels, t_input, t_offsets = _trl_layout(teacher_logits, teacher_ids, teacher_spans, merge)
    return uld._compute_distillation_loss(
        s_logits,
        t_logits,
        s_labels,
        t_labels,
        s_input,
        t_input,
        student_byte_offsets=s_offsets,
        teacher_byte_offsets=t_offsets,
    )
