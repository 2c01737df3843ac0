"""The teacher protocols: what a distillation loss reads from a teacher for a batch.

A *dense* teacher (``Teacher``: the in-process model) gives full logits or final hidden states plus its head. A
*sparse* teacher (``SparseTeacher``: an offline top-k cache, a vLLM server) gives, at every supervised position,
its ``k`` most likely next tokens with their log-probs, and the log-prob of the token that actually follows
(``TopKSignal``); the mass outside the top-k is ``1 − Σ exp(logprobs)``.

Positions: hidden state ``i`` predicts token ``i + 1``, so a batch's supervised positions are
``supervised_positions(labels)``, True at ``i`` where ``labels[:, i + 1]`` is not -100; a signal lists them in
row-major order (the order of ``tensor[positions]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.hf.heads import LogitHead


class TeacherUnavailable(RuntimeError):
    """A teacher outside the process (a server) stayed unreachable after its retries. Raised from the training
    step before anything is trained on the batch; ``TeacherOutage`` then saves a checkpoint to resume from."""

    #: What was unavailable, and what to do before resuming (``TeacherOutage``'s message).
    service = "The teacher server"
    remedy = "Start the server again"


def supervised_positions(labels: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` bool: True at position ``i`` where the token ``i + 1`` is supervised (``labels`` ``(B, L)``)."""
    return F.pad(labels[:, 1:] != IGNORE_INDEX, (0, 1), value=False)


def next_tokens(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(N,)`` the token following each True position of ``positions`` ``(B, L)``, row-major."""
    return F.pad(input_ids[:, 1:], (0, 1), value=0)[positions]


@dataclass(frozen=True)
class TopKSignal:
    """A sparse teacher's view of a batch at its ``N`` supervised positions (row-major).

    ``ids`` ``(N, k)`` int64 and ``logprobs`` ``(N, k)`` float32: the teacher's ``k`` most likely next tokens and
    their log-probs under its full softmax at temperature 1, most likely first. ``next_logprobs`` ``(N,)``
    float32: the teacher's log-prob of the token that actually follows (a dataset completion's or a sample's),
    whether or not it is in the top-k; None when the source does not have it.

    A masked entry (id ``ops.divergence.sparse_kd.MASKED_ID`` = −1, log-prob −inf, after the kept ones) stands for a
    top-k token the student does not have (a served teacher padded past the student's vocabulary): the top-k losses
    leave it out, its mass staying in the tail bucket.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    next_logprobs: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return int(self.ids.shape[-1])

    def to(self, device: torch.device | str) -> TopKSignal:
        return TopKSignal(
            self.ids.to(device),
            self.logprobs.to(device),
            None if self.next_logprobs is None else self.next_logprobs.to(device),
        )


class TeacherBase:
    """What a method calls on every teacher source besides its signal, each doing nothing here: ``check(tokenizer,
    vocab_size)`` once the teachers are built, before training (raise an error naming what does not match the
    student: a server serving another tokenizer, a cache built with one); ``check_datamodule(datamodule)`` before
    fitting (what the source needs from the rows: a cache made from these rows); ``close()`` at teardown. One refuses
    by default: ``check_images(student)``, for rows with images. Every
    teacher source subclasses it (``LocalTeacher``, ``HiddenStateTeacher``, the caches, the servers), a user's own
    too."""

    def check(self, tokenizer: Any, vocab_size: int) -> None:
        """Raise for a student tokenizer (its ids compared over ``vocab_size`` rows) this teacher cannot serve."""

    def check_datamodule(self, datamodule: Any) -> None:
        """Raise for training data this teacher cannot serve."""

    def check_images(self, student: Any) -> None:
        """Raise when the rows hold images (a vision-language ``student``'s) and this teacher cannot read them: here
        always; an in-process vision-language teacher (``LocalTeacher``) reads them."""
        raise ValueError(
            f"The rows hold images, and {type(self).__name__} cannot read them yet: distil a vision-language student "
            "from an in-process vision-language teacher (Hydra: teacher=local with a teacher folder that has a "
            "processor)."
        )

    def close(self) -> None:
        """Release connections and files."""


@runtime_checkable
class Teacher(Protocol):
    """A dense teacher's view of a batch (``input_ids``, ``attention_mask`` ``(B, L)``, left-padded), without
    gradients."""

    def logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``(B, L, V)`` next-token logits at every position."""
        ...

    def hidden_states(
        self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor
    ) -> tuple[torch.Tensor, LogitHead]:
        """``(N, H)`` final hidden states at the ``N`` True ``positions`` ``(B, L)`` (row-major), and the head
        (``LogitHead``: projection, bias, scale, soft-cap) that turns them into exactly the teacher's logits. Raises
        ``LeanForwardUnsupported`` when the source cannot (the loss then falls back to ``logits``)."""
        ...


@runtime_checkable
class SparseTeacher(Protocol):
    """A teacher that gives top-k log-probs (``TopKSignal``) instead of logits (its checks and ``close``:
    ``TeacherBase``)."""

    #: how many tokens per position the signal carries
    top_k: int

    def topk(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> TopKSignal:
        """The signal at the True ``positions`` ``(B, L)`` of ``batch`` (``input_ids``, ``attention_mask``,
        ``labels`` ``(B, L)``, left-padded), on the batch's device."""
        ...
