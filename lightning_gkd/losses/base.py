"""The contract every distillation loss object keeps, and the one policy for reading a model's final hidden states.

A loss object is built once (``lightning_gkd.losses.plan.build_distillation_loss``, from the run's teacher plan) and
called per batch: ``loss(student, batch) -> LossOutput``. The batch holds ``input_ids``, ``attention_mask`` and
``labels`` ``(B, L)`` (left-padded, labels -100 off the completions), plus whatever its teacher needs (a routing
column, the rows' prompt messages, the sampler's log-probs). The loss holds its teacher signal; the method never
asks which kind it is.

A batch whose completions the trained student sampled itself carries ``STUDENT_SAMPLES: True`` (set by the on-policy
step); a loss then also reports figures of those samples (``sample_figures``, ``sample_figure_logs``): the teacher's
top-1 agreement with the sampled tokens, the teacher's mass on the student's top-k, the student's entropy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from lightning_gkd.ops.divergence.sample_figures import SampleFigures
from lightning_gkd.ops.hf.heads import LeanForwardUnsupported

Reduce = Literal["mean", "sum", "max"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Logged:
    """One value a loss reports: logged as ``<train|val>/<name>``, averaged over a run's batches weighted by
    ``weight`` (``reduce="mean"``), summed, or the largest."""

    value: torch.Tensor | float
    weight: float = 1.0
    reduce: Reduce = "mean"


#: The batch key (a bool) that says the completions are the trained student's own samples (``OnPolicyModule``).
STUDENT_SAMPLES = "student_samples"
#: The logged names of ``SampleFigures``' figures (``<train|val>/<name>``), by figure.
SAMPLE_FIGURE_NAMES = {
    "agreement": "teacher_top1_agreement",
    "mass": "teacher_mass_on_student_top{k}",
    "entropy": "student_entropy",
}


def sample_figures(
    batch: Mapping[str, Any], tokens: torch.Tensor, teacher_top1: torch.Tensor | None = None
) -> SampleFigures | None:
    """An empty ``SampleFigures`` for the sampled next ``tokens`` ``(N,)`` of a batch of the student's own samples
    (``batch[STUDENT_SAMPLES]``; ``teacher_top1``: a top-k teacher's most likely tokens); None for any other batch
    (dataset completions, teacher samples, validation), where the figures would not describe the student's samples."""
    return SampleFigures(tokens, teacher_top1=teacher_top1) if batch.get(STUDENT_SAMPLES) else None


def sample_figure_logs(figures: SampleFigures | None) -> dict[str, Logged]:
    """The figures ``figures`` gathered, as logs named by ``SAMPLE_FIGURE_NAMES``, each weighted by its positions."""
    if figures is None:
        return {}
    return {
        SAMPLE_FIGURE_NAMES[name].format(k=figures.k): Logged(value, float(count))
        for name, (value, count) in figures.means().items()
    }


def finite_flag(values: torch.Tensor) -> torch.Tensor:
    """0-dim bool: whether every entry of ``values`` is finite (one fused reduction, no host sync)."""
    return torch.isfinite(values.detach().sum(dtype=torch.float32))


@dataclass(frozen=True)
class LossOutput:
    """One batch's loss.

    ``loss``: 0-dim, the mean over ``count`` units (supervised tokens; aligned groups for the cross-tokenizer loss;
    pairs for DPO). ``count``: how many units that is: the optimizer step's token-mean normaliser weighs each
    micro-batch by it (``lightning_gkd.training.normalization``). ``logs``: further values, by name without the
    stage prefix. ``finite``: role (``"student"``, ``"teacher"``) -> whether that model's outputs the loss read
    were finite, for the non-finite guard's message (a path that never forms logits reports its hidden states)."""

    loss: torch.Tensor
    count: torch.Tensor
    logs: Mapping[str, Logged] = field(default_factory=dict)
    finite: Mapping[str, torch.Tensor] = field(default_factory=dict)


class DistillationLoss(ABC):
    """A distillation loss with its teacher signal inside: ``loss(student, batch) -> LossOutput``.

    The method also calls, each doing nothing here: ``check_datamodule(datamodule)`` before fitting (what the loss
    needs from the rows: a routing column, the prompt messages), ``use_tools(schemas)`` before fitting with
    multi-turn rollouts, and ``close()`` at teardown."""

    @abstractmethod
    def __call__(self, student: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        """The loss of ``batch`` (``input_ids``, ``attention_mask``, ``labels`` ``(B, L)``) for ``student``."""

    def check_datamodule(self, datamodule: Any) -> None:
        """Raise for training data this loss cannot read; ask the datamodule for the columns it needs."""

    def use_tools(self, tools: list[dict] | None, *, max_context_tokens: int | None) -> None:
        """The student acts with tools (their schemas, None for an environment without any) in contexts of up to
        ``max_context_tokens`` tokens (None: unknown): a loss whose teacher renders each context itself renders the
        schemas too, and sizes its inputs for those contexts."""

    def close(self) -> None:
        """Release what the loss holds."""


def combine(parts: list[LossOutput]) -> LossOutput:
    """Several losses over disjoint rows as one: the ``count``-weighted mean of their losses; logs merged by their
    own reductions (``mean``: weighted by each part's ``weight``); ``finite`` flags and-ed per role."""
    if not parts:
        raise ValueError("combine: no parts (an empty batch).")
    counts = [part.count.to(torch.float32) for part in parts]
    total = torch.stack(counts).sum()
    loss = torch.stack([part.loss * count for part, count in zip(parts, counts, strict=True)]).sum() / total.clamp(
        min=1.0
    )
    logs: dict[str, Logged] = {}
    for name in dict.fromkeys(name for part in parts for name in part.logs):
        entries = [part.logs[name] for part in parts if name in part.logs]
        reduce = entries[0].reduce
        values = [torch.as_tensor(entry.value, dtype=torch.float32) for entry in entries]
        weight = sum(entry.weight for entry in entries)
        if reduce == "max":
            logs[name] = Logged(torch.stack(values).max(), weight, "max")
        elif reduce == "sum":
            logs[name] = Logged(torch.stack(values).sum(), weight, "sum")
        else:
            weighted = torch.stack([value * entry.weight for value, entry in zip(values, entries, strict=True)]).sum()
            logs[name] = Logged(weighted / max(weight, 1e-12), weight)
    finite: dict[str, torch.Tensor] = {}
    for part in parts:
        for role, flag in part.finite.items():
            finite[role] = flag if role not in finite else finite[role] & flag
    return LossOutput(loss, total.to(torch.long), logs, finite)


class LeanPath:
    """Whether losses read final hidden states and the model's head (``lean``: only the supervised positions are
    projected to logits, a chunk at a time) or full ``(B, L, V)`` logits, and the one fallback policy for a model
    whose head the lean path cannot describe (``LeanForwardUnsupported``, from ``ops.hf.hidden_states_and_head``):
    a loss with a full-logits form warns once and uses full logits from then on (``enabled`` turns False); a loss
    without one raises a ValueError naming the model and what to use instead."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def run(self, lean: Callable[[], _T], full: Callable[[], _T] | None, *, loss_name: str) -> _T:
        """``lean()`` while enabled, else (or once it raises ``LeanForwardUnsupported``) ``full()``."""
        if self.enabled or full is None:
            try:
                return lean()
            except LeanForwardUnsupported as reason:
                if full is None:
                    raise ValueError(
                        f"The {loss_name} loss reads each model's final hidden states and head, and {reason}; it has "
                        "no full-logits path: use models whose heads the lean path describes (Llama, Qwen, Mistral, "
                        "Gemma, ...; tests/ops/hf/test_heads.py), or a teacher whose loss has one (an in-process "
                        "teacher without top_k)."
                    ) from reason
                from lightning.pytorch.utilities import rank_zero_warn

                rank_zero_warn(f"lean_loss: {reason}; computing the {loss_name} loss from full logits instead.")
                self.enabled = False
        return full()
