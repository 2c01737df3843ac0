r"""Speculative knowledge distillation's sampling (SKD; Xu et al., 2024): the student proposes each token and the
teacher keeps it when it is among the teacher's top-``K`` at that position, else replaces it with a token drawn from
the teacher. Pure functions over two causal LMs (Hugging Face ``forward`` convention); no Lightning.

Block-wise verification, as in speculative decoding: the student drafts ``n`` tokens with its KV cache, one teacher
forward over the drafts (with the teacher's KV cache) gives the teacher's distribution before each of them, and the
batch keeps the drafts up to the first position ``m`` where any row's draft is rejected; at ``m`` the rejecting rows
take the teacher's token and the others keep their (accepted) draft. Both caches are cropped to the kept tokens and
the rest is drafted again. Every random draw is tied to its row and completion position (one uniform stream for the
student's proposals, one for the teacher's replacements), so a re-drafted position draws the same token: block
verification gives the same sequences as token-by-token verification (``draft_tokens=1``), and with ``K`` at least
the vocabulary size every proposal is kept and the result equals ``generate_completions``' samples for the same seed.

The probability that the procedure emits token ``x`` at a position is

    P(x) = q_S(x) · 1[x ∈ top-K(p_T)] + (Σ_{y ∉ top-K(p_T)} q_S(y)) · q_T(x)

where ``q_S``, ``q_T`` are the student's and the teacher's sampling distributions (temperature, top-k, top-p
applied) and top-K ranks the teacher's logits; ``log P(x)`` is what the batch's ``sampled_logprobs`` hold (the
distribution each token was drawn from, for OPD's importance weights).

The teacher's side goes through a ``BlockVerifier``: it reads the prompts (``begin``), gives the teacher's
log-probs before each draft of a block (``verify``) and takes the decided tokens (``advance``). ``ModelVerifier`` runs
an in-process teacher model with its KV cache (every log-prob known); a served top-k teacher
(``teachers.server.ServerBlockVerifier``) knows, per position, its top-``k`` and the draft's own log-prob and gives
−inf elsewhere. With ``K <= k`` the accept/reject decisions are exact (the top-``K`` is known, ties included); the
replacement is drawn from ``q_T`` restricted to the known tokens and renormalised, which is ``q_T`` itself whenever
``q_T``'s support lies among them (sampling ``top_k`` between 1 and ``k``; or ``k`` covering the vocabulary), and
otherwise misses ``q_T``'s mass outside the known tokens. ``log P(x)`` is computed from the same restricted ``q_T``,
so ``sampled_logprobs`` stay the log-probs of the distribution actually sampled from.

Shapes: ``B`` batch size, ``P`` left-padded prompt length, ``N <= max_new_tokens`` generated tokens, ``V``
vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from lightning_gkd.ops.decoding.kv_decoders import returned_cache
from lightning_gkd.ops.decoding.sampling import (
    completion_batch,
    completion_mask,
    eos_tensor,
    inverse_cdf_pick,
    sampling_logits,
    uniform_draws,
    validate_sampling_args,
)
from lightning_gkd.ops.hf.forward import (
    EosTokenId,
    accepts_logits_to_keep,
    cache_keyword,
    eval_mode,
    is_sharded,
    position_ids_from_mask,
)

__all__ = [
    "BlockVerifier",
    "ModelVerifier",
    "SpeculativeSample",
    "check_speculative_settings",
    "speculative_completions",
    "speculative_tokens",
]


@dataclass(frozen=True)
class SpeculativeSample:
    """What :func:`speculative_tokens` produced: ``tokens`` ``(B, N)`` (pad after a row's EOS), ``logprobs``
    ``(B, N)`` (``log P(x)`` of the module docstring; 0 after EOS), ``replaced`` ``(B, N)`` (True where the teacher's
    token replaced the student's proposal), and the work done: ``student_tokens`` and ``teacher_tokens`` (token
    positions each model ran a forward over, prompts included), ``blocks`` (verification rounds)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    replaced: torch.Tensor
    student_tokens: int
    teacher_tokens: int
    blocks: int


class _Decoder:
    """One model's incremental decoding state over the shared attention mask: its KV cache and the logits that
    predict the next token."""

    def __init__(self, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        self.model, self.keyword = model, cache_keyword(model)
        keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        out = model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids_from_mask(prompt_mask),
            use_cache=True,
            **keep,
        )
        self.cache, self.next_logits = returned_cache(out), out.logits[:, -1].float()
        self.tokens_read = int(prompt_ids.numel())

    def feed(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` ``(B, T)`` through the model after its cache; returns their ``(B, T, V)`` float logits
        (the last one becomes ``next_logits``)."""
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.keyword: self.cache},
        )
        self.cache = returned_cache(out)
        self.tokens_read += int(tokens.numel())
        logits = out.logits.float()
        self.next_logits = logits[:, -1]
        return logits

    def drop_last(self, count: int) -> None:
        """Forget the cache's last ``count`` tokens (a negative ``crop``: the number to remove in transformers 5.x
        and the length from the end in older versions)."""
        crop = getattr(self.cache, "crop", None)
        if not callable(crop):
            raise ValueError(
                f"{type(self.model).__name__}'s KV cache ({type(self.cache).__name__}) cannot be cropped, which "
                "block verification needs after a rejected draft: use draft_tokens=1 (token-by-token "
                "verification never crops)."
            )
        crop(-count)


class BlockVerifier(Protocol):
    """The teacher's side of block verification (module docstring). One verifier serves one decoding call:
    ``begin``, then per block ``verify`` and ``advance``, then ``finish``. ``tokens_read``: token positions the
    teacher ran over (prompts included; a server: the tokens sent)."""

    tokens_read: int

    def begin(self, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor, *, max_new_tokens: int) -> None:
        """Read the left-padded prompts ``(B, P)`` (1 on real tokens in the mask); up to ``max_new_tokens`` follow."""
        ...

    def verify(self, drafts: torch.Tensor, finished: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``(B, n, V)`` float32, ``V = vocab_size`` (the student's): the teacher's log-probs (or logits: any
        per-position shift) of the next token before each of the ``n`` ``drafts`` ``(B, n)``, after the tokens decided
        so far; −inf for a token the verifier does not know. Every known set must hold the teacher's top-``K``
        (``accept_top_k``) and the draft itself. Rows ``finished`` ``(B,)`` (past their EOS) may be anything finite."""
        ...

    def advance(self, tokens: torch.Tensor, drafted: int, more: bool) -> None:
        """The block decided ``tokens`` ``(B, length)``, of the ``drafted`` drafts verified (the first ``length - 1``
        were drafts kept as they are); ``more``: another block follows."""
        ...

    def finish(self) -> None:
        """The decoding call is over (restore what ``begin`` changed)."""
        ...


class ModelVerifier:
    """A ``BlockVerifier`` over an in-process causal LM (Hugging Face ``forward``), decoding with its KV cache in eval
    mode (its flag restored by ``finish``): every log-prob is known, so SKD's decisions and replacements are exact."""

    def __init__(self, model: nn.Module) -> None:
        if is_sharded(model):
            raise ValueError(
                "Speculative KD sampling runs a different number of forwards on each rank, which a sharded (FSDP) "
                "model cannot do: use sampler=hf or sampler=vllm with sharded models."
            )
        self.model = model
        self.tokens_read = 0
        self._decoder: _Decoder | None = None
        self._training: bool | None = None

    def begin(self, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor, *, max_new_tokens: int) -> None:
        self._training = self.model.training
        self.model.eval()
        batch, self._prompt_len = prompt_ids.shape
        self._mask = torch.ones(batch, self._prompt_len + max_new_tokens, dtype=torch.long, device=prompt_ids.device)
        self._mask[:, : self._prompt_len] = prompt_attention_mask
        self._first_position = prompt_attention_mask.long().sum(dim=-1, keepdim=True)
        self._done = 0
        self._decoder = _Decoder(self.model, prompt_ids, self._mask[:, : self._prompt_len])
        self.tokens_read = self._decoder.tokens_read

    def _state(self) -> _Decoder:
        if self._decoder is None:
            raise RuntimeError("ModelVerifier: call begin(prompts) before verify/advance.")
        return self._decoder

    def verify(self, drafts: torch.Tensor, finished: torch.Tensor, vocab_size: int) -> torch.Tensor:
        decoder = self._state()
        if decoder.next_logits.shape[-1] != vocab_size:
            raise ValueError(
                f"The student's vocabulary ({vocab_size}) and the teacher's ({decoder.next_logits.shape[-1]}) differ: "
                "speculative KD compares token ids, so both must share one."
            )
        n = drafts.shape[1]
        logits = [decoder.next_logits]
        if n > 1:  # one forward over drafts 0..n-2: the distributions before drafts 1..n-1
            column = self._prompt_len + self._done
            offsets = torch.arange(n - 1, device=drafts.device)
            fed = decoder.feed(
                drafts[:, :-1], self._mask[:, : column + n - 1], self._first_position + self._done + offsets
            )
            logits.extend(fed.unbind(dim=1))
            self.tokens_read = decoder.tokens_read
        return torch.stack(logits, dim=1)

    def advance(self, tokens: torch.Tensor, drafted: int, more: bool) -> None:
        decoder = self._state()
        length = tokens.shape[1]
        if length < drafted:  # it read drafted - 1 drafts and keeps length - 1 of them
            decoder.drop_last(drafted - length)
        self._done += length
        if more:  # read the last decided token: its logits predict the next block's first draft
            positions = self._first_position + self._done - 1
            decoder.feed(tokens[:, -1:], self._mask[:, : self._prompt_len + self._done], positions)
        self.tokens_read = decoder.tokens_read

    def finish(self) -> None:
        if self._training is not None:
            self.model.train(self._training)
        self._decoder, self._training = None, None


def _proposal_logprobs(
    tokens: torch.Tensor,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    in_top: torch.Tensor,
    **options: Any,
) -> torch.Tensor:
    """``(B,)`` ``log P(x)`` (module docstring) of ``tokens`` from the sampling logits of both models ``(B, V)``
    and the teacher's top-K membership ``in_top`` ``(B, V)``."""
    student = sampling_logits(student_logits, **options).softmax(dim=-1)
    teacher = sampling_logits(teacher_logits, **options).softmax(dim=-1)
    outside = student.masked_fill(in_top, 0.0).sum(dim=-1, keepdim=True)
    mixture = student.masked_fill(~in_top, 0.0) + outside * teacher
    return mixture.gather(-1, tokens[:, None]).squeeze(-1).log()


@torch.no_grad()
def speculative_tokens(
    student: nn.Module,
    teacher: nn.Module | BlockVerifier,
    prompt_ids: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    *,
    accept_top_k: int,
    draft_tokens: int,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_id: EosTokenId,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> SpeculativeSample:
    """Decode up to ``max_new_tokens`` tokens per left-padded prompt with SKD (module docstring).

    Args:
        student: a causal LM (the caller chooses its train/eval mode).
        teacher: a causal LM over the student's vocabulary (verified by a ``ModelVerifier``, in eval mode), or a
            ``BlockVerifier`` (a served teacher's: its known tokens must hold its top-``accept_top_k``).
        prompt_ids: ``(B, P)`` left-padded prompts; ``prompt_attention_mask`` ``(B, P)`` 1 on real tokens.
        accept_top_k: ``K`` (>= 1): a proposal is kept when the teacher ranks it among its ``K`` most likely tokens
            (ties with the K-th are kept); ``K >= V`` keeps every proposal.
        draft_tokens: ``n`` (>= 1): tokens the student drafts per teacher verification.
        max_new_tokens, pad_token_id, eos_token_id: as ``sample_tokens``.
        temperature, top_k, top_p: both models' sampling options (the student's proposals, the teacher's
            replacements).
        seed: the two random streams' seed.

    Returns:
        ``SpeculativeSample``; a batch stops when every row has produced an EOS.
    """
    validate_sampling_args(max_new_tokens, temperature, top_k, top_p)
    check_speculative_settings(accept_top_k, draft_tokens)
    if is_sharded(student):
        raise ValueError(
            "Speculative KD sampling runs a different number of forwards on each rank, which a sharded (FSDP) "
            "model cannot do: use sampler=hf or sampler=vllm with sharded models."
        )
    verifier: BlockVerifier = ModelVerifier(teacher) if isinstance(teacher, nn.Module) else teacher
    verifier.begin(prompt_ids, prompt_attention_mask, max_new_tokens=max_new_tokens)
    try:
        return _speculative_loop(
            student,
            verifier,
            prompt_ids,
            prompt_attention_mask,
            accept_top_k=accept_top_k,
            draft_tokens=draft_tokens,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            options={"temperature": temperature, "top_k": top_k, "top_p": top_p},
            seed=seed,
        )
    finally:
        verifier.finish()


def _speculative_loop(
    student: nn.Module,
    verifier: BlockVerifier,
    prompt_ids: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    *,
    accept_top_k: int,
    draft_tokens: int,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_id: EosTokenId,
    options: dict[str, Any],
    seed: int,
) -> SpeculativeSample:
    """``speculative_tokens``' decoding, the verifier begun."""
    batch, prompt_len = prompt_ids.shape
    device = prompt_ids.device
    # one uniform per row and completion position for each stream: a re-drafted position draws the same token
    student_stream = torch.Generator(device=device).manual_seed(seed)
    teacher_stream = torch.Generator(device=device).manual_seed(seed ^ 0x5DEECE66D)
    student_draws = [uniform_draws(batch, student_stream, device) for _ in range(max_new_tokens)]
    teacher_draws = [uniform_draws(batch, teacher_stream, device) for _ in range(max_new_tokens)]
    eos = eos_tensor(eos_token_id, device)

    mask = torch.ones(batch, prompt_len + max_new_tokens, dtype=torch.long, device=device)
    mask[:, :prompt_len] = prompt_attention_mask
    first_position = prompt_attention_mask.long().sum(dim=-1, keepdim=True)
    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
    replaced = torch.zeros(batch, max_new_tokens, dtype=torch.bool, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)

    drafter = _Decoder(student, prompt_ids, mask[:, :prompt_len])
    vocab = drafter.next_logits.shape[-1]
    done, blocks = 0, 0  # completion tokens decided so far (the same for every row)
    while done < max_new_tokens and not bool(finished.all()):
        blocks += 1
        n = min(draft_tokens, max_new_tokens - done)
        # the student drafts n tokens; rows past their EOS draft padding
        drafts, draft_logits, stopped = [], [drafter.next_logits], finished.clone()
        for i in range(n):
            probs = sampling_logits(draft_logits[i], **options).softmax(dim=-1)
            token = inverse_cdf_pick(probs, student_draws[done + i]).masked_fill(stopped, pad_token_id)
            drafts.append(token)
            if eos is not None:
                stopped = stopped | torch.isin(token, eos)
            if i + 1 < n:
                column = prompt_len + done + i
                draft_logits.append(
                    drafter.feed(token[:, None], mask[:, : column + 1], first_position + done + i)[:, -1]
                )
        drafted = torch.stack(drafts, dim=1)  # (B, n)
        verify = verifier.verify(drafted, finished, vocab).to(device=device, dtype=torch.float32)  # (B, n, V)
        if accept_top_k < verify.shape[-1]:
            in_top = verify >= verify.topk(accept_top_k, dim=-1).values[..., -1:]  # (B, n, V)
        else:
            in_top = torch.ones_like(verify, dtype=torch.bool)
        # rows past their EOS (before the block or at an earlier draft) accept whatever follows
        kept = (
            in_top.gather(-1, drafted[..., None]).squeeze(-1)
            | finished[:, None]
            | (completion_mask(drafted, eos_token_id) == 0)
        )
        rejected = ~kept
        no_rejection = torch.full_like(drafted[:, 0], n)
        first_rejection = torch.where(rejected.any(dim=1), rejected.long().argmax(dim=1), no_rejection)
        stop = int(first_rejection.min())  # the first position any row rejects (n: none does)
        length = min(stop + 1, n)  # tokens this block decides
        tokens = drafted[:, :length].clone()
        swap = torch.zeros_like(tokens, dtype=torch.bool)
        if stop < n:
            swap[:, stop] = first_rejection == stop
            teacher_probs = sampling_logits(verify[:, stop], **options).softmax(dim=-1)
            teacher_token = inverse_cdf_pick(teacher_probs, teacher_draws[done + stop])
            tokens[:, stop] = torch.where(swap[:, stop], teacher_token, tokens[:, stop])
        dead = finished[:, None] | (completion_mask(tokens, eos_token_id) == 0)  # padding: not part of a completion
        for i in range(length):
            token_logprobs = _proposal_logprobs(tokens[:, i], draft_logits[i], verify[:, i], in_top[:, i], **options)
            logprobs[:, done + i] = token_logprobs.masked_fill(dead[:, i], 0.0)
        tokens = tokens.masked_fill(dead, pad_token_id)
        out[:, done : done + length] = tokens
        replaced[:, done : done + length] = swap & ~dead
        if eos is not None:
            finished |= torch.isin(tokens, eos).any(dim=1)
        # both models keep the decided tokens before the last one, then read the last one
        if length < n:  # the student read n - 1 drafts and keeps length - 1 of them
            drafter.drop_last(n - length)
        done += length
        more = done < max_new_tokens and not bool(finished.all())
        verifier.advance(tokens, n, more)
        if more:
            drafter.feed(tokens[:, -1:], mask[:, : prompt_len + done], first_position + done - 1)
    return SpeculativeSample(
        out[:, :done], logprobs[:, :done], replaced[:, :done], drafter.tokens_read, verifier.tokens_read, blocks
    )


def check_speculative_settings(accept_top_k: Any, draft_tokens: Any) -> None:
    """ValueError naming the option and its value."""
    if isinstance(accept_top_k, bool) or not isinstance(accept_top_k, int) or accept_top_k < 1:
        raise ValueError(
            f"accept_top_k must be an integer >= 1 (the teacher's top-K that keeps a proposal), got {accept_top_k!r}."
        )
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(
            f"draft_tokens must be an integer >= 1 (tokens drafted per verification), got {draft_tokens!r}."
        )


def speculative_completions(
    student: nn.Module,
    teacher: nn.Module | BlockVerifier,
    prompt_ids: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    **settings: Any,
) -> tuple[dict[str, torch.Tensor], SpeculativeSample]:
    """SKD samples as a training batch (``completion_batch``: ``input_ids``, ``attention_mask``, ``labels``,
    ``sampled_logprobs``, each ``(B, P + N)``) and the ``SpeculativeSample`` they came from; the student runs in eval
    mode (its flag restored), as does an in-process teacher (``ModelVerifier``). ``teacher``: a model or a
    ``BlockVerifier``; ``settings``: :func:`speculative_tokens`' keywords."""
    with eval_mode(student):
        sample = speculative_tokens(student, teacher, prompt_ids, prompt_attention_mask, **settings)
    batch = completion_batch(
        prompt_ids, prompt_attention_mask, sample.tokens, settings.get("eos_token_id"), sample.logprobs
    )
    return batch, sample


def check_verifiable(accept_top_k: int, top_k: int | None, where: str = "the teacher server") -> None:
    """ValueError unless speculative KD's ``accept_top_k`` (K) fits a served teacher's ``top_k`` (k): deciding
    whether a draft is among the teacher's top-K needs all K of them."""
    k = 20 if top_k is None else top_k  # ServerTeacher's default
    if accept_top_k > k:
        raise ValueError(
            f"sampler.accept_top_k={accept_top_k} is above the served teacher's top_k={k} ({where}): speculative "
            f"KD keeps a draft when it is among the teacher's top-{accept_top_k}, and the server returns only its "
            f"top-{k}. "
            f"Lower sampler.accept_top_k to {k} or less, or raise teacher.top_k to {accept_top_k} (and the server's "
            "--max-logprobs with it)."
        )
