r"""Figures of a batch of the student's own samples, gathered a chunk of positions at a time from the logits the
losses already form: how the teacher judges what the student sampled, and how sure the student was.

At each of the ``N`` positions (``x`` the sampled next token, ``p_S``/``p_T`` the student's and the teacher's
next-token distributions, softmax of their logits at temperature 1, whatever the loss's temperature):

* teacher top-1 agreement: ``[argmax_y p_T(y) = x]``, the share of sampled tokens the teacher would have picked
  greedily (ties: the lowest id, as ``torch.argmax``);
* teacher mass on the student's top-k: ``Σ_{y ∈ topk(p_S)} p_T(y)``, how much of the teacher's probability lies on
  the student's ``k`` likeliest tokens (``k`` = ``STUDENT_TOP_K`` unless given);
* student entropy: ``H(p_S) = −Σ_y p_S(y) log p_S(y)`` (nats).

Each is averaged over the positions. ``SampleFigures`` accumulates the sums chunk by chunk, so no ``(N, V)`` tensor
is formed: ``add`` from one chunk's ``(C, V)`` logits (before a loss overwrites them), ``add_log_probs`` from the
log-softmaxes a loss at temperature 1 has formed already, ``add_hidden`` with a chunked projection of its own (for a
loss whose chunks never hold both models' logits; it returns the teacher's log-prob of each token, so that such a
loss needs no second teacher pass), ``add_positions`` from full ``(B, L, V)`` logits a chunk of positions at a time.
With only the teacher's top-1 id (a sparse teacher's top-k signal), agreement and entropy are known but not the mass:
the teacher's probabilities of the student's top-k tokens outside its own top-k are not in the signal.
"""

from __future__ import annotations

import torch

from lightning_gkd.ops.hf.heads import LogitHead

__all__ = ["STUDENT_TOP_K", "SampleFigures"]

#: How many of the student's likeliest tokens the teacher-mass figure sums the teacher's probability over.
STUDENT_TOP_K = 5


class SampleFigures:
    """Running sums of the figures (module docstring) over the positions of a batch whose sampled next tokens are
    ``tokens`` ``(N,)``; ``means()`` gives the averages. Every ``add`` covers the rows ``rows`` of those positions.
    ``teacher_top1`` ``(N,)``: the teacher's most likely next token at each position, for a teacher known only by
    its top-k (teacher logits given to ``add`` supersede it).

    Nothing here takes part in autograd (the sums are detached), and nothing is copied to the host."""

    def __init__(
        self, tokens: torch.Tensor, *, teacher_top1: torch.Tensor | None = None, k: int = STUDENT_TOP_K
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(
                f"tokens must be (N,), the sampled next token of each position, got {tuple(tokens.shape)}."
            )
        if k < 1:
            raise ValueError(f"k (the student's top-k the teacher's mass is summed over) must be >= 1, got {k}.")
        self.tokens, self.k = tokens, k
        self.teacher_top1: torch.Tensor | None = None
        if teacher_top1 is not None:
            self.set_teacher_top1(teacher_top1)
        zero = torch.zeros((), dtype=torch.float32, device=tokens.device)
        self.sums = {"agreement": zero, "mass": zero.clone(), "entropy": zero.clone()}
        self.positions = {"agreement": 0, "mass": 0, "entropy": 0}

    def set_teacher_top1(self, teacher_top1: torch.Tensor) -> None:
        """The teacher's most likely next token ``(N,)`` at each position (once its signal is read)."""
        if teacher_top1.shape != self.tokens.shape:
            raise ValueError(f"teacher_top1 {tuple(teacher_top1.shape)} must match tokens {tuple(self.tokens.shape)}.")
        self.teacher_top1 = teacher_top1

    @torch.no_grad()
    def add(self, rows: slice, student_logits: torch.Tensor, teacher_logits: torch.Tensor | None = None) -> None:
        """Add the positions ``rows`` from their student logits ``(C, V)`` and the teacher's logits ``(C, V)`` (all
        three figures); without teacher logits, agreement from ``teacher_top1`` (if given) and the entropy."""
        count = student_logits.shape[0]
        if count == 0:
            return
        s = torch.log_softmax(student_logits.float(), dim=-1)
        if teacher_logits is not None:
            self.add_log_probs(rows, s, torch.log_softmax(teacher_logits.float(), dim=-1))
            return
        self._add_student(rows, s)

    def _add_student(self, rows: slice, s: torch.Tensor) -> None:
        """The entropy from the student's log-softmax ``s`` ``(C, V)``, and the agreement from ``teacher_top1``."""
        count = s.shape[0]
        tokens = self._tokens(rows, count, s.device)
        self._add("entropy", -torch.dot(s.exp().flatten(), s.flatten()), count)
        if self.teacher_top1 is not None:
            agree = self.teacher_top1[rows].to(tokens.device) == tokens
            self._add("agreement", agree.sum(dtype=torch.float32), count)

    @torch.no_grad()
    def add_log_probs(
        self,
        rows: slice,
        student_log_probs: torch.Tensor,
        teacher_log_probs: torch.Tensor,
        student_probs: torch.Tensor | None = None,
    ) -> None:
        """Add the positions ``rows`` from both models' log-softmaxes at temperature 1 ``(C, V)`` (and the student's
        softmax, if at hand): what ``add`` does from logits, for a loss that has formed them already."""
        count = student_log_probs.shape[0]
        if count == 0:
            return
        tokens = self._tokens(rows, count, student_log_probs.device)
        probs = student_log_probs.exp() if student_probs is None else student_probs
        self._add("entropy", -torch.dot(probs.flatten(), student_log_probs.flatten()), count)
        top = student_log_probs.topk(min(self.k, student_log_probs.shape[-1]), dim=-1).indices
        self._add("mass", teacher_log_probs.gather(-1, top).exp().sum(), count)
        agree = teacher_log_probs.argmax(dim=-1) == tokens
        self._add("agreement", agree.sum(dtype=torch.float32), count)

    @torch.no_grad()
    def add_hidden(
        self,
        student_hidden: torch.Tensor,
        student_head: LogitHead,
        *,
        teacher_hidden: torch.Tensor | None = None,
        teacher_head: LogitHead | None = None,
        chunk_size: int = 256,
    ) -> torch.Tensor | None:
        """Add every position from final hidden states ``(N, H)``, projecting ``chunk_size`` of them to logits at a
        time (extra memory O(``chunk_size`` × V)): the student's, and the teacher's when given (else its
        ``teacher_top1``). Returns, with the teacher's, its log-prob of each token ``(N,)`` (``log_softmax`` of its
        logits, as ``ops.topk.topk_log_probs`` computes it): a loss that needs it has no second teacher pass to make.
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
        teacher = teacher_hidden is not None and teacher_head is not None
        picked = []
        for start in range(0, student_hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            s = torch.log_softmax(student_head.logits(student_hidden[rows]).float(), dim=-1)
            if not teacher:
                self._add_student(rows, s)
                continue
            assert teacher_hidden is not None and teacher_head is not None
            t = torch.log_softmax(teacher_head.logits(teacher_hidden[rows]).float(), dim=-1)
            self.add_log_probs(rows, s, t)
            picked.append(t.gather(-1, self.tokens[rows, None].to(t.device)).squeeze(-1))
        if not teacher:
            return None
        return torch.cat(picked) if picked else student_hidden.new_zeros(0, dtype=torch.float32)

    @torch.no_grad()
    def add_positions(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor | None,
        positions: torch.Tensor,
        *,
        chunk_size: int = 256,
    ) -> None:
        """Add every True position of ``positions`` ``(B, L)`` (row-major, as ``tokens`` lists them) from full
        ``(B, L, V)`` logits, gathering ``chunk_size`` positions' rows at a time."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
        batch_rows, columns = positions.nonzero(as_tuple=True)
        for start in range(0, batch_rows.numel(), chunk_size):
            rows = slice(start, start + chunk_size)
            at = (batch_rows[rows], columns[rows])
            self.add(rows, student_logits[at], None if teacher_logits is None else teacher_logits[at])

    def means(self) -> dict[str, tuple[torch.Tensor, int]]:
        """``{figure: (mean over its positions, positions)}`` for the figures that were added: ``agreement``,
        ``mass`` (with teacher logits) and ``entropy``."""
        return {name: (self.sums[name] / count, count) for name, count in self.positions.items() if count > 0}

    def _tokens(self, rows: slice, count: int, device: torch.device) -> torch.Tensor:
        tokens = self.tokens[rows].to(device)
        if tokens.shape[0] != count:
            raise ValueError(f"{count} rows of student logits for {tokens.shape[0]} tokens in rows {rows}.")
        return tokens

    def _add(self, name: str, value: torch.Tensor, count: int) -> None:
        self.sums[name] = self.sums[name] + value
        self.positions[name] += count
