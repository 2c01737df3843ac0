"""Dense teachers without a teacher model in the process: the teacher's final hidden states (after the final norm,
what its head multiplies) come from elsewhere (a vLLM pooling server, ``teachers.hidden_server``; an offline cache,
``teachers.offline``) and only its head (``LogitHead``: the ``V × H`` projection, bias, scale, soft-cap) lives here.

``z_T = softcap(scale · (h_T Wᵀ + b))`` is then exactly the teacher's logits, so every dense loss (any β, the
full-vocabulary reverse KL, OPD's ``kl_coef`` term) reads such a teacher as it reads the in-process model: through
``hidden_states(batch, positions) -> (hidden, head)`` (the ``Teacher`` protocol). Payload per token: ``H`` numbers
(2H bytes in bf16) against ``V`` logits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lightning_gkd.ops.hf.heads import LogitHead
from lightning_gkd.teachers.base import TeacherBase, supervised_positions


def head_on(head: LogitHead, device: torch.device | str) -> LogitHead:
    """``head`` with its tensors on ``device`` (the same object when they are there already)."""
    device = torch.device(device)
    if head.weight.device == device:
        return head
    bias = None if head.bias is None else head.bias.to(device)
    return LogitHead(head.weight.to(device), bias, head.scale, head.softcap)


class HiddenStateTeacher(TeacherBase):
    """A ``Teacher`` (dense) whose final hidden states come from ``read_states`` and whose logits come from ``head``.

    Subclasses implement ``read_states(batch, positions) -> (N, H)``: the teacher's final hidden states at the ``N``
    True ``positions`` ``(B, L)`` of ``batch`` (row-major), any float dtype, any device. They are cast to the head's
    dtype and moved to the batch's device here; the head is moved once per device. ``head`` None: ``load_head()``
    reads it on first use."""

    def __init__(self, head: LogitHead | None = None) -> None:
        self._head = head
        self._heads: dict[torch.device, LogitHead] = {}
        self._row_limit: int | None = None

    @property
    def head(self) -> LogitHead:
        if self._head is None:
            self._head = self.load_head()
        return self._head if self._row_limit is None else self._head.first_rows(self._row_limit)

    def limit_rows(self, rows: int) -> None:
        """Give logits for token ids ``[0, rows)`` only (the head's first ``rows`` rows): a student with fewer
        output rows over the same tokenizer (``teachers.spec.share_vocabulary``)."""
        self._row_limit = rows
        self._heads.clear()

    def load_head(self) -> LogitHead:
        raise NotImplementedError(f"{type(self).__name__} was built without a head and cannot load one.")

    @property
    def hidden_size(self) -> int:
        return int(self.head.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.head.weight.shape[0])

    def read_states(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head_on(self, device: torch.device) -> LogitHead:
        if device not in self._heads:
            self._heads[device] = head_on(self.head, device)
        return self._heads[device]

    @torch.no_grad()
    def hidden_states(
        self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor
    ) -> tuple[torch.Tensor, LogitHead]:
        device = batch["input_ids"].device
        head = self.head_on(device)
        states = self.read_states(batch, positions)
        expected = (int(positions.sum()), self.hidden_size)
        if tuple(states.shape) != expected:
            raise ValueError(
                f"{type(self).__name__}: got hidden states of shape {tuple(states.shape)} for {expected[0]} "
                f"positions, expected {expected} (the head takes {self.hidden_size} features)."
            )
        return states.to(device=device, dtype=head.weight.dtype), head

    @torch.no_grad()
    def logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``(B, L, V)`` float32: the teacher's logits at every position whose next token is supervised (what the
        full-logits losses read, ``labels[:, 1:] != -100``), zeros elsewhere (never read)."""
        positions = supervised_positions(batch["labels"])
        hidden, head = self.hidden_states(batch, positions)
        batch_size, length = positions.shape
        out = torch.zeros(batch_size, length, self.vocab_size, dtype=torch.float32, device=hidden.device)
        out[positions] = head.logits(hidden)
        return out
