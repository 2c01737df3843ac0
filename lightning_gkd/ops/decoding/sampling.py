"""On-policy sampling from causal LMs, as pure functions over a model (anything whose ``forward`` follows the
Hugging Face causal-LM convention): prompt tensors and sampling options in, plain tensors out; no Lightning.

Shapes: ``B`` batch size; ``P`` prompt length (prompts are **left**-padded, the prompt attention mask marks the
real tokens); ``N`` generated tokens, ``N <= max_new_tokens``; ``V`` vocabulary size.

The KV-cache keyword (``cache`` in transformers 5.x, ``past_key_values`` before, which still works but warns) is
detected once per :func:`sample_tokens` call from ``inspect.signature(model.forward)``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.kv_decoders import DecodedKV, DynamicKVDecoder, KVDecoder
from lightning_gkd.ops.decoding.turn_cache import PastKV
from lightning_gkd.ops.hf.forward import (
    EosTokenId,
    eval_mode,
    is_sharded,
    position_ids_from_mask,
    resolve_eos_token_id,
    resolve_pad_token_id,
)
from lightning_gkd.ops.hf.model_inputs import VisionRows, has_images, placeholder_token_ids

__all__ = [
    "complete_prompts",
    "completion_batch",
    "completion_lengths",
    "completion_mask",
    "derive_seed",
    "eos_ids",
    "generate_completions",
    "position_ids_from_mask",
    "resolve_eos_token_id",
    "sample_tokens",
    "validate_sampling_args",
]


# --------------------------------------------------------------------------- helpers


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (run seed, step, ...): the same on every rank and after resume."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


def eos_ids(eos_token_id: EosTokenId) -> list[int]:
    """EOS id(s) as a list of ints (an int, a sequence or a tensor); empty when there is no EOS."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    if isinstance(eos_token_id, torch.Tensor):
        return [int(i) for i in eos_token_id.reshape(-1).tolist()]
    return [int(i) for i in eos_token_id]


def eos_tensor(eos_token_id: EosTokenId, device: torch.device) -> torch.Tensor | None:
    """EOS id(s) as a 1-D long tensor on ``device``; ``None`` when there is no EOS."""
    ids = eos_ids(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def validate_sampling_args(
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, *, where: str = ""
) -> None:
    """The one check of the sampling options (the samplers, ``SamplingSettings``): ValueError naming the option
    (after ``where``, e.g. ``"sampling."``) and its value."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{where}max_new_tokens must be >= 1, got {max_new_tokens!r} (an integer)")
    if not temperature > 0:
        raise ValueError(f"{where}temperature must be > 0, got {temperature!r} (1: the model's own distribution)")
    if not 0 < top_p <= 1:
        raise ValueError(f"{where}top_p must be in (0, 1], got {top_p!r} (1: off)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{where}top_k must be >= 0 (an integer; 0 disables it), got {top_k!r}")


def _all_finished(finished: torch.Tensor, synced: bool) -> bool:
    """Whether decoding can stop: every row here has produced an EOS, and with ``synced`` every rank's rows."""
    done = finished.all()
    if synced:
        done = done.to(torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done)


class LaggedFlag:
    """A device boolean read on the host ``lag`` pushes after it was computed, without waiting for the device.

    Each ``push`` starts a non-blocking copy of this step's flag into a (pinned, on CUDA) host slot and returns the
    flag pushed ``lag`` pushes ago (False before then): by then its copy has long finished, so the host keeps
    queueing work ahead of the device instead of draining it every token. ``lag`` 0 reads the flag at once (a sync
    on a GPU; free on the CPU). Reads go through numpy: no tensor op, no ``.item()``."""

    def __init__(self, lag: int, device: torch.device) -> None:
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag!r}.")
        cuda = device.type == "cuda"
        self.lag, self.pushed = lag, 0
        self._host = torch.zeros(max(lag, 1), dtype=torch.bool, pin_memory=cuda)
        self._view = self._host.numpy()
        self._events = [torch.cuda.Event() for _ in range(max(lag, 1))] if cuda else []

    def push(self, flag: torch.Tensor) -> bool:
        slot = self.pushed % len(self._view)
        if self.lag and self.pushed >= self.lag:
            if self._events:
                self._events[slot].synchronize()
            late = bool(self._view[slot])
        else:
            late = False
        self._host[slot].copy_(flag, non_blocking=self.lag > 0)
        if self._events:
            self._events[slot].record()
        self.pushed += 1
        if self.lag == 0:
            if self._events:
                self._events[slot].synchronize()
            return bool(self._view[slot])
        return late


#: ``finished_lag`` by device type: how many tokens late ``sample_tokens`` reads "every row finished" (a GPU runs
#: ahead of the host only if the host never waits for it; on the CPU there is nothing to wait for).
DEFAULT_FINISHED_LAG = {"cuda": 4}


def _pick_tokens(
    logits: torch.Tensor,
    *,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` ``(B, V)``.

    Returns ``(B,)`` tokens and their ``(B,)`` float log-probabilities under the distribution they were picked
    from. Greedy (``do_sample`` False): ``argmax`` and ``log_softmax(logits)``. Sampling: a draw from
    ``softmax(logits / temperature)`` restricted to the top-k tokens (``top_k=0`` disables it) and then to the
    smallest nucleus whose probability reaches ``top_p`` (``top_p=1`` disables it), and its log-probability under
    that restricted, renormalised distribution.
    """
    if not do_sample:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.float().log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    logits = sampling_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = _inverse_cdf_sample(logits.softmax(dim=-1), generator)
    return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def sampling_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``(B, V)`` float logits of the sampling distribution: divided by ``temperature``, ``-inf`` outside the top-k
    tokens and then outside the smallest nucleus reaching ``top_p``."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the most likely
        # token is always kept.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` ``(B, V)``: the first index whose cumulative probability exceeds a uniform
    draw. Exact like ``torch.multinomial``, but draws B random numbers instead of B x V (multinomial's
    exponential draw over the whole vocabulary was a third of the decode time at V = 32000). The cumulative sum
    runs in float64 so that tiny probabilities keep their share."""
    return inverse_cdf_pick(probs, uniform_draws(probs.shape[0], generator, probs.device))


def uniform_draws(batch: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``(B, 1)`` float64 uniforms in [0, 1): the draw ``_inverse_cdf_sample`` takes per decoding step."""
    return torch.rand((batch, 1), generator=generator, device=device, dtype=torch.float64)


def inverse_cdf_pick(probs: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """``(B,)`` tokens: per row of ``probs`` ``(B, V)``, the first index whose float64 cumulative probability
    exceeds ``draw`` ``(B, 1)`` (uniforms in [0, 1)) times the row's total."""
    cdf = probs.double().cumsum(dim=-1)
    # zero-probability tokens (cut by top-k / top-p) add no width to the cdf, so they are never picked
    tokens = torch.searchsorted(cdf, draw.to(cdf.device) * cdf[:, -1:], right=True)
    return tokens.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


# --------------------------------------------------------------------------- sampling


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_id: EosTokenId,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    logprobs_out: list[torch.Tensor] | None = None,
    decoder: KVDecoder | None = None,
    finished_lag: int | None = None,
    vision: VisionRows | None = None,
    past: PastKV | None = None,
    kv_out: list[DecodedKV | None] | None = None,
) -> torch.Tensor:
    """Decode up to ``max_new_tokens`` tokens per prompt with a KV cache.

    One prefill forward runs over the left-padded prompts (with their attention mask and
    position ids derived from it), then one forward per new token feeds only that token,
    with the attention mask extended by ones and position ids continuing per row. Runs
    under ``torch.no_grad``; the caller chooses train/eval mode (see
    :func:`generate_completions`).

    Args:
        model: causal LM following the HF ``forward`` convention (``input_ids``,
            ``attention_mask``, ``position_ids``, ``cache``/``past_key_values``,
            ``use_cache``; returns ``.logits`` of shape ``(B, L, V)`` and the cache).
        prompt_ids: ``(B, P)`` long tensor, left-padded.
        prompt_attention_mask: ``(B, P)`` tensor, 1 on real prompt tokens.
        max_new_tokens: maximum number of tokens to generate (>= 1).
        pad_token_id: token emitted by rows after they produced an EOS.
        eos_token_id: EOS id or ids; ``None`` (or empty) disables stopping.
        do_sample: sample when True, greedy argmax when False.
        temperature: logits are divided by it before sampling (> 0).
        top_k: keep only the ``top_k`` most likely tokens; 0 disables it.
        top_p: nucleus sampling threshold in ``(0, 1]``; 1 disables it.
        generator: RNG for ``torch.multinomial``; ``None`` uses the global RNG.
        logprobs_out: when a list, a ``(B, N)`` float tensor is appended to it: each generated token's
            log-probability under the distribution it was picked from (see ``_pick_tokens``; 0 after EOS).
        decoder: runs the forwards (``ops.decoding.kv_decoders``); None: a ``DynamicKVDecoder`` (transformers'
            growing cache).
        finished_lag: read "every row has finished" this many tokens late, so the host never waits for the device
            (``LaggedFlag``); the decode then runs at most that many tokens past the last EOS, trimmed from the
            result, which equals a decode that stops at once. None: ``DEFAULT_FINISHED_LAG`` (4 on CUDA, 0 else).
        vision: the prompts' image inputs, one dict per row (``ops.hf.model_inputs``), fed to the prefill; a decoder
            that cannot take them (``KVDecoder.takes_images`` False: the static ones) is replaced by a
            ``DynamicKVDecoder`` for this decode. A vision-language model never samples its image (or video)
            placeholder tokens (``ops.hf.model_inputs.placeholder_token_ids``: their logits are ``-inf``, also in the
            returned log-probs' distribution).
        past: keys and values kept from an earlier decode that the prompts continue (``ops.decoding.turn_cache``:
            ``prompt_ids`` ``(B, S)`` are then each row's suffix after its ``past`` columns); needs a decoder that
            ``takes_past`` and no images.
        kv_out: when a list, the decode's cache (``decoder.kept()``: a ``DecodedKV``, or None where the decoder
            cannot hand it on) is appended to it before the decoder releases it.

    Returns:
        ``(B, N)`` long tensor of generated tokens, ``N <= max_new_tokens``; ``N`` is
        smaller when every row has produced an EOS before the limit. Positions after a
        row's first EOS hold ``pad_token_id``. When the model is sharded (FSDP2) across
        processes, each forward is a collective, so every rank decodes until all ranks'
        rows are finished (their ``N`` is the same).
    """
    validate_sampling_args(max_new_tokens, temperature, top_k, top_p)
    batch = prompt_ids.shape[0]
    device = prompt_ids.device
    eos = eos_tensor(eos_token_id, device)
    synced = is_sharded(model) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    pick = partial(
        _pick_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
    )
    if decoder is None or (has_images(vision) and not decoder.takes_images):
        decoder = DynamicKVDecoder()
    if past is not None and (not decoder.takes_past or has_images(vision)):
        raise ValueError(
            f"{type(decoder).__name__} cannot start from kept keys and values (past) here: only a decoder that "
            "takes_past does, for prompts without images; prefill the whole prompts instead."
        )
    prefill_options = {} if past is None else {"past": past}
    # a vision-language model's image placeholders are never text it writes: one sampled into a completion would
    # ask the next forward for an image the row does not have
    placeholders = torch.tensor(placeholder_token_ids(model), dtype=torch.long, device=device)
    lag = DEFAULT_FINISHED_LAG.get(device.type, 0) if finished_lag is None else finished_lag
    # sharded: every forward is a collective, so the ranks agree on the stop at once (as before)
    all_done = None if eos is None or synced else LaggedFlag(lag, device)

    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)

    try:
        logits = decoder.prefill(
            model, prompt_ids, prompt_attention_mask, max_new_tokens, vision=vision, **prefill_options
        )
        num_tokens = max_new_tokens
        for step in range(max_new_tokens):
            if len(placeholders):
                logits = logits.index_fill(-1, placeholders, float("-inf"))
            tokens, token_logprobs = pick(logits)
            if eos is not None:
                tokens = tokens.masked_fill(finished, pad_token_id)
                token_logprobs = token_logprobs.masked_fill(finished, 0.0)
                finished |= torch.isin(tokens, eos)
            out[:, step] = tokens
            logprobs[:, step] = token_logprobs
            if step + 1 == max_new_tokens:
                break
            if eos is not None and synced and _all_finished(finished, synced):
                num_tokens = step + 1
                break
            if all_done is not None and all_done.push(finished.all()):
                num_tokens = step + 1  # trimmed below to where the last row finished
                break
            logits = decoder.step(tokens, step)
        if kv_out is not None:
            kv_out.append(decoder.kept())
    finally:
        decoder.release()
    if all_done is not None and all_done.lag > 0:
        # read late: the decode may have run a few tokens past its last EOS (all padding); one read per decode
        lengths, stopped = completion_lengths(out[:, :num_tokens], eos_token_id)
        if bool(stopped.all()):
            num_tokens = int(lengths.max())
    if logprobs_out is not None:
        logprobs_out.append(logprobs[:, :num_tokens])
    return out[:, :num_tokens]


def completion_mask(completion_ids: torch.Tensor, eos_token_id: EosTokenId) -> torch.Tensor:
    """``(B, N)`` long mask of generated tokens ``(B, N)``: 1 up to and including each row's first EOS, 0 after it;
    all 1 for a row without EOS, or when ``eos_token_id`` is ``None`` (or empty). Padding is never found by the pad
    id (it often equals EOS)."""
    eos = eos_tensor(eos_token_id, completion_ids.device)
    if eos is None:
        return torch.ones_like(completion_ids, dtype=torch.long)
    is_eos = torch.isin(completion_ids, eos).long()
    # EOS tokens strictly before each column; > 0 means the column is past the first EOS.
    return (is_eos.cumsum(dim=1) - is_eos == 0).long()


def completion_lengths(completion_ids: torch.Tensor, eos_token_id: EosTokenId) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of generated tokens ``(B, N)``: its completion length ``(B,)`` long, ``L_b = sum_n m_bn`` with
    ``m = completion_mask`` (the tokens up to and including the first EOS; ``N`` for a row without one), and whether
    it emitted an EOS within the ``N`` tokens ``(B,)`` bool (all False when ``eos_token_id`` is ``None``)."""
    eos = eos_tensor(eos_token_id, completion_ids.device)
    stopped = (
        torch.isin(completion_ids, eos).any(dim=1)
        if eos is not None
        else torch.zeros(completion_ids.shape[0], dtype=torch.bool, device=completion_ids.device)
    )
    return completion_mask(completion_ids, eos_token_id).sum(dim=1), stopped


def completion_batch(
    prompt_ids: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    eos_token_id: EosTokenId,
    completion_logprobs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Join prompts and completions into a training batch.

    Padding is never found by matching the pad id (it often equals EOS): prompt padding
    comes from the prompt mask, completion padding is everything after the first EOS.

    Args:
        prompt_ids: ``(B, P)`` long tensor, left-padded prompts.
        prompt_attention_mask: ``(B, P)`` tensor, 1 on real prompt tokens.
        completion_ids: ``(B, N)`` long tensor of generated tokens.
        eos_token_id: EOS id or ids; ``None`` keeps every completion column.
        completion_logprobs: optional ``(B, N)`` log-probabilities of the completion tokens
            under the distribution they were sampled from.

    Returns:
        dict with

        * ``input_ids``: ``(B, P + N)``, prompt then completion.
        * ``attention_mask``: ``(B, P + N)`` long; prompt columns copy the prompt mask,
          completion columns are 1 up to and including the first EOS and 0 after it
          (all 1 when the row has no EOS or ``eos_token_id`` is ``None``).
        * ``labels``: ``(B, P + N)``; ``input_ids`` with ``-100`` on every prompt column
          and wherever the attention mask is 0.
        * with ``completion_logprobs``, ``sampled_logprobs``: ``(B, P + N)`` float32, the
          log-probabilities at the supervised columns and 0 wherever ``labels`` is ``-100``.
    """
    prompt_len = prompt_ids.shape[1]
    completion_ids = completion_ids.to(device=prompt_ids.device, dtype=torch.long)
    input_ids = torch.cat([prompt_ids.long(), completion_ids], dim=1)

    attention_mask = torch.cat([prompt_attention_mask.long(), completion_mask(completion_ids, eos_token_id)], dim=1)

    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :prompt_len] = IGNORE_INDEX
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if completion_logprobs is not None:
        logprobs = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        logprobs[:, prompt_len:] = completion_logprobs.to(device=input_ids.device, dtype=torch.float32)
        batch["sampled_logprobs"] = logprobs.masked_fill(labels == IGNORE_INDEX, 0.0)
    return batch


def generate_completions(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_id: EosTokenId,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    decoder: KVDecoder | None = None,
    finished_lag: int | None = None,
    vision: VisionRows | None = None,
    past: PastKV | None = None,
    kv_out: list[DecodedKV | None] | None = None,
) -> dict[str, Any]:
    """Sample completions for a batch of prompts and return a training batch.

    The model is switched to eval mode while sampling (so dropout is off and HF models
    keep their KV cache even with gradient checkpointing enabled); every submodule's
    ``training`` flag is restored afterwards, also when sampling raises. Sampling runs
    under ``torch.no_grad`` (not ``inference_mode``), so the returned tensors can feed a
    later training forward and backward.

    Args:
        model: causal LM (see :func:`sample_tokens`).
        prompt_ids: ``(B, P)`` long tensor, left-padded prompts.
        prompt_attention_mask: ``(B, P)`` tensor, 1 on real prompt tokens.
        max_new_tokens: maximum number of generated tokens (>= 1).
        pad_token_id: token placed after a row's first EOS.
        eos_token_id: EOS id or ids, or ``None``.
        do_sample, temperature, top_k, top_p: see :func:`sample_tokens`.
        seed: when given, sampling uses a fresh ``torch.Generator`` on the prompts'
            device seeded with it: results are reproducible and the global RNG is
            untouched. ``None`` uses the global RNG.
        decoder, finished_lag, vision, past, kv_out: see :func:`sample_tokens` (with ``past``, ``prompt_ids`` are
            the rows' suffixes, and so are the prompt columns of the returned batch).

    Returns:
        The dict of :func:`completion_batch`: ``input_ids``, ``attention_mask``,
        ``labels`` and ``sampled_logprobs``, each ``(B, P + N)`` with ``N <= max_new_tokens``; and ``vision``
        (the prompts' image inputs, the same rows) when given.

    Raises:
        ValueError: if ``max_new_tokens < 1``, ``temperature <= 0``, ``top_p`` is not in
            ``(0, 1]`` or ``top_k < 0``.
    """
    generator = None
    if seed is not None:
        generator = torch.Generator(device=prompt_ids.device)
        generator.manual_seed(seed)

    logprobs: list[torch.Tensor] = []
    with eval_mode(model):
        completion_ids = sample_tokens(
            model,
            prompt_ids,
            prompt_attention_mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            logprobs_out=logprobs,
            decoder=decoder,
            finished_lag=finished_lag,
            vision=vision,
            past=past,
            kv_out=kv_out,
        )
    batch: dict[str, Any] = completion_batch(
        prompt_ids, prompt_attention_mask, completion_ids, eos_token_id, logprobs[0]
    )
    if vision is not None:
        batch["vision"] = vision
    return batch


def complete_prompts(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: EosTokenId | None = None,
    vision: VisionRows | None = None,
) -> dict[str, Any]:
    """``generate_completions`` as the commands and evaluations ask for it: greedy at ``temperature`` 0 (``top_k``,
    ``top_p`` and ``seed`` then change nothing), else sampled at ``temperature``; padded with ``tokenizer``'s pad id
    and stopped at ``eos_token_id`` (None: ``resolve_eos_token_id(model, tokenizer)``); ``vision``: the prompts'
    image inputs."""
    return generate_completions(
        model,
        prompt_ids,
        prompt_attention_mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=resolve_pad_token_id(tokenizer),
        eos_token_id=resolve_eos_token_id(model, tokenizer) if eos_token_id is None else eos_token_id,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        vision=vision,
    )
