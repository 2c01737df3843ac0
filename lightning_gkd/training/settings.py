"""``TrainingSettings``: how every method trains its model besides its loss (the ``training`` group of every
method; Hydra ``method.training.*``, with ``optimizer`` and ``scheduler`` from the top-level ``optimizer=`` and
``scheduler=`` groups)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import nn

from lightning_gkd.models.precision import check_frozen_dtype
from lightning_gkd.training.nonfinite import NonFinitePolicy
from lightning_gkd.training.normalization import LossNormalization

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass(frozen=True)
class TrainingSettings:
    """The optimizer and scheduler factories, the seed of the method's random choices, and what happens to the
    trained and the frozen models. Checked when made, before any model loads."""

    #: Called with the trainable parameters (``functools.partial(torch.optim.AdamW, lr=1e-4)``; Hydra
    #: ``_partial_: true``). None: fused AdamW at TRL's learning rate 5e-5.
    optimizer: OptimizerFactory | None = None
    #: Called with the optimizer, stepped every optimizer step. None: a constant learning rate.
    scheduler: SchedulerFactory | None = None
    #: The seed of the method's random choices (the λ coin, the samplers' seeds), with the step and batch index.
    seed: int = 0
    #: On a non-finite training loss: ``"raise"`` (stop, naming the step and the model with non-finite logits) or
    #: ``"skip"`` (skip the batch with a warning; one process only).
    nonfinite: NonFinitePolicy = "raise"
    #: Token-mean losses over the whole optimizer step (``"step"``: micro-batches and ranks) or per micro-batch.
    loss_normalization: LossNormalization = "step"
    #: dtype of the frozen models (teacher, reference) unless their source chose one: ``"auto"`` or a floating dtype
    #: name (``lightning_gkd.models.precision``).
    frozen_dtype: str = "auto"
    #: Set every dropout probability of the trained model to 0 (TRL's ``disable_dropout``).
    disable_dropout: bool = True
    #: Recompute activations in the backward pass (sampling keeps its KV cache).
    gradient_checkpointing: bool = False
    #: A vision-language model's vision tower and projector take no gradient (only its language model trains;
    #: ``lightning_gkd.models.vision``). Nothing to freeze in a text model.
    freeze_vision: bool = True
    #: Allow the models' own code from the hub when they load.
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        for name in ("optimizer", "scheduler"):
            factory = getattr(self, name)
            if factory is not None and not callable(factory):
                raise TypeError(
                    f"training.{name} must be a factory (a class or functools.partial; Hydra: _partial_: true) or "
                    f"None, got {factory!r}."
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"training.seed must be an integer, got {self.seed!r}.")
        _check_choice(
            "nonfinite",
            self.nonfinite,
            get_args(NonFinitePolicy),
            "raise: stop naming the step and the model with non-finite logits; skip: skip such batches with a "
            "warning, one process only",
        )
        _check_choice(
            "loss_normalization",
            self.loss_normalization,
            get_args(LossNormalization),
            "step: the mean over the whole optimizer step's tokens; micro_batch: each micro-batch's own mean",
        )
        check_frozen_dtype(self.frozen_dtype, where="training.")
        for name in ("disable_dropout", "gradient_checkpointing", "freeze_vision", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"training.{name} must be true or false, got {getattr(self, name)!r}.")


def _check_choice(name: str, value: Any, choices: tuple[str, ...], meaning: str) -> None:
    if value not in choices:
        raise ValueError(
            f"training.{name} must be {' or '.join(repr(choice) for choice in choices)}, got {value!r} ({meaning})."
        )
