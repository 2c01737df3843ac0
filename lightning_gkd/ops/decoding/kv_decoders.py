"""How one decode runs its forwards: the KV cache, the attention mask and (optionally) a compiled, replayed step.

``sample_tokens`` owns the sampling loop (picking tokens, EOS, when to stop); a decoder owns the model calls:
``prefill`` runs the prompts and returns the last position's logits, ``step`` feeds one new token per row and returns
the next logits. Three decoders, chosen once per sampler:

* ``DynamicKVDecoder``: transformers' growing cache (``DynamicCache``), the attention mask grown by a slice per
  token. Works with any model following the Hugging Face causal-LM ``forward`` convention. On every decode forward
  transformers' mask creation reads the padding mask on the host (``padding_mask.all()``: a device sync per token).
  It can start from keys and values kept from an earlier decode (``past``, a multi-turn rollout's previous turn:
  ``ops.decoding.turn_cache``) and hand its cache on when done (``kept``): ``takes_past``.
* ``StaticKVDecoder``: transformers' ``StaticCache`` sized once for the whole decode (prompt + new tokens), one
  attention mask of that length for every forward. A compileable cache at one query token skips the mask check, so a
  decode forward reads nothing back to the host; the shapes of every decode forward are the same.
* ``StaticKVDecoder(compile=True)``: the decode forward compiled with ``torch.compile`` (on CUDA in
  ``reduce-overhead`` mode: captured once as a CUDA graph and replayed). Prompt lengths are left-padded up to a
  multiple of ``prompt_bucket`` and batches up to a power of two, so a run compiles a few shapes; the caches of the
  shapes seen are kept (a static address for the graph) and reset per decode.

Shapes: ``B`` rows, ``P`` prompt length (left-padded), ``N`` new tokens at most, ``V`` vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_gkd.ops.decoding.turn_cache import PastKV
from lightning_gkd.ops.hf.forward import accepts_logits_to_keep, cache_keyword, is_sharded, position_ids_from_mask
from lightning_gkd.ops.hf.model_inputs import (
    VisionRows,
    decode_step_inputs,
    has_images,
    lm_inputs,
    text_position_offsets,
)

#: decoder names (``KVCacheSampler(decode=...)``), ``auto`` resolved by ``resolve_decode``.
DECODE_MODES = ("auto", "dynamic", "static", "compiled")


def returned_cache(outputs: Any) -> Any:
    """The KV cache of a forward output, read from ``.cache`` or ``.past_key_values``.

    ``.cache`` is checked first: on transformers 5.x reading ``.past_key_values`` works
    but logs a deprecation warning.
    """
    cache = getattr(outputs, "cache", None)
    if cache is None:
        cache = getattr(outputs, "past_key_values", None)
    return cache


def supports_static_cache(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model whose family can decode with a static cache and be compiled whole
    (transformers' own ``_can_compile_fullgraph`` flag)."""
    return bool(getattr(model, "_can_compile_fullgraph", False)) and hasattr(model, "config")


def resolve_decode(decode: str, model: nn.Module, device: torch.device) -> str:
    """The decoder ``decode`` means for ``model`` on ``device``: ``auto`` is ``compiled`` on CUDA for a family that
    supports a static cache and a model that is not sharded (an FSDP2 forward is a collective per layer), else
    ``dynamic`` (the CPU default: nothing there is launch-bound, and compiling costs a minute). ``static`` and
    ``compiled`` on a family without static-cache support are refused."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}.")
    if decode == "auto":
        compiled = device.type == "cuda" and supports_static_cache(model) and not is_sharded(model)
        return "compiled" if compiled else "dynamic"
    if decode != "dynamic" and not supports_static_cache(model):
        raise ValueError(
            f"decode={decode} needs a transformers model whose family supports a static KV cache, but "
            f"{type(model).__name__} does not (transformers' _can_compile_fullgraph is False). Use decode=dynamic "
            "(or auto)."
        )
    return decode


@dataclass
class DecodedKV:
    """A finished decode's cache as ``DynamicKVDecoder.kept`` hands it on: per layer ``(B, H, Wc + fed, D)`` keys and
    values, ``context_mask`` ``(B, Wc)`` (the mask of the columns before the first decode step: reused and prefilled
    ones), ``fed`` (decode steps that fed a token) and ``window`` (the smallest sliding window among the layers;
    None: none)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    context_mask: torch.Tensor
    fed: int
    window: int | None


class KVDecoder(ABC):
    """Runs one decode's forwards (see the module docstring). ``prefill`` starts a decode; ``step`` continues it;
    ``release`` drops the references the decode holds (its cache, the model)."""

    #: whether ``prefill`` takes the prompts' images (``vision``); a decoder that does not is replaced for such a decode
    takes_images: bool = False
    #: whether ``prefill`` starts from kept keys and values (``past``) and ``kept`` hands the cache on
    takes_past: bool = False

    @abstractmethod
    def prefill(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        max_new_tokens: int,
        *,
        vision: VisionRows | None = None,
        past: PastKV | None = None,
    ) -> torch.Tensor:
        """``(B, V)`` logits after the prompts ``(B, P)`` (and their images, ``vision``: one dict per row, see
        ``ops.hf.model_inputs``); starts a decode of at most ``max_new_tokens`` tokens. With ``past`` (where
        ``takes_past``), the prompts continue those keys and values: ``(B, P)`` is only each row's suffix."""

    def kept(self) -> DecodedKV | None:
        """The finished decode's cache (before ``release``), or None where the decoder cannot hand it on."""
        return None

    @abstractmethod
    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """``(B, V)`` logits after feeding ``tokens`` ``(B,)``, the ``step``-th new token of each row (0-based)."""

    @abstractmethod
    def release(self) -> None:
        """Drop what the finished decode holds."""


class DynamicKVDecoder(KVDecoder):
    """transformers' growing cache; the attention mask grown by slicing one full-length mask. Takes images: they
    enter at the prefill; a model with multimodal positions (M-RoPE) continues from the positions its images left."""

    takes_images = True
    takes_past = True

    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._outputs: Any = None
        self._step_inputs: dict[str, torch.Tensor] = {}
        self._fed = 0

    def prefill(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        max_new_tokens: int,
        *,
        vision: VisionRows | None = None,
        past: PastKV | None = None,
    ) -> torch.Tensor:
        self._fed = 0
        if past is not None:
            return self._prefill_on(model, prompt_ids, prompt_attention_mask, max_new_tokens, past, vision)
        batch, prompt_len = prompt_ids.shape
        self._model, self._cache_kw, self._prompt_len = model, cache_keyword(model), prompt_len
        self._mask = torch.ones(batch, prompt_len + max_new_tokens, dtype=torch.long, device=prompt_ids.device)
        self._mask[:, :prompt_len] = prompt_attention_mask
        inputs = lm_inputs(model, prompt_ids, prompt_attention_mask, vision)
        # next position of each row = its number of real prompt tokens (+ what its images added, under M-RoPE)
        self._next_position = prompt_attention_mask.long().sum(dim=-1, keepdim=True) + text_position_offsets(
            model, inputs
        )
        self._step_inputs = decode_step_inputs(inputs)
        keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        self._outputs = model(**inputs, use_cache=True, **keep)
        return self._outputs.logits[:, -1, :]

    def _prefill_on(
        self,
        model: nn.Module,
        suffix_ids: torch.Tensor,
        suffix_mask: torch.Tensor,
        max_new_tokens: int,
        past: PastKV,
        vision: VisionRows | None,
    ) -> torch.Tensor:
        """The prefill of each row's suffix ``(B, S)`` after its kept keys and values ``past`` (width ``C``; see
        ``ops.decoding.turn_cache`` for the layout): mask ``(B, C + S)``, positions counted over it."""
        from transformers import DynamicCache

        if has_images(vision):
            raise ValueError("a prefill on kept keys and values takes text only: decode rows with images in full")
        if past.mask.shape[0] != suffix_ids.shape[0]:
            raise ValueError(f"past has {past.mask.shape[0]} rows, the suffixes {suffix_ids.shape[0]}")
        batch, span = suffix_ids.shape
        mask = torch.cat([past.mask.to(suffix_mask.device, torch.long), suffix_mask.long()], dim=1)
        self._model, self._cache_kw, self._prompt_len = model, cache_keyword(model), mask.shape[1]
        self._mask = torch.ones(batch, mask.shape[1] + max_new_tokens, dtype=torch.long, device=suffix_ids.device)
        self._mask[:, : mask.shape[1]] = mask
        self._next_position = mask.sum(dim=-1, keepdim=True)
        self._step_inputs = {}
        config = getattr(model, "config", None)  # its layer kinds (sliding-window layers), as the model's own cache
        cache = DynamicCache(ddp_cache_data=list(zip(past.keys, past.values, strict=True)), config=config)
        keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        self._outputs = model(
            input_ids=suffix_ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask)[:, -span:],
            use_cache=True,
            **{self._cache_kw: cache},
            **keep,
        )
        return self._outputs.logits[:, -1, :]

    def kept(self) -> DecodedKV | None:
        """The cache of the decode that just ran, when every layer is a plain (or not yet sliding) transformers
        ``DynamicCache`` layer holding all its columns; None otherwise (other cache kinds: recurrent, chunked,
        KV-sharing layers)."""
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        cache = returned_cache(self._outputs) if self._outputs is not None else None
        layers = getattr(cache, "layers", None)
        if not layers:
            return None
        width = self._prompt_len + self._fed
        keys, values, windows = [], [], []
        for layer in layers:
            if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) or layer.keys is None:
                return None
            if layer.keys.dim() != 4 or layer.keys.shape[2] != width or layer.values.shape[2] != width:
                return None
            if isinstance(layer, DynamicSlidingWindowLayer):
                windows.append(int(layer.sliding_window))
            keys.append(layer.keys)
            values.append(layer.values)
        return DecodedKV(keys, values, self._mask[:, : self._prompt_len], self._fed, min(windows, default=None))

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        assert self._model is not None, "prefill starts a decode"
        self._fed = step + 1
        self._outputs = self._model(
            input_ids=tokens[:, None],
            attention_mask=self._mask[:, : self._prompt_len + step + 1],
            position_ids=self._next_position + step,
            use_cache=True,
            **self._step_inputs,
            **{self._cache_kw: returned_cache(self._outputs)},
        )
        return self._outputs.logits[:, -1, :]

    def release(self) -> None:
        self._model = self._outputs = None
        self._step_inputs = {}


def _decode_forward(
    model: nn.Module,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
    cache_kw: str,
) -> torch.Tensor:
    """One decode forward on a static cache (passed as ``cache_kw``): ``(B, V)`` logits of ``tokens`` ``(B, 1)``."""
    outputs = model(
        input_ids=tokens, attention_mask=mask, position_ids=position_ids, use_cache=True, **{cache_kw: cache}
    )
    return outputs.logits[:, -1, :]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _next_power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()


class StaticKVDecoder(KVDecoder):
    """A static cache for the whole decode and one mask for every forward; with ``compile`` the decode forward is
    ``torch.compile``d (``backend``, ``mode``: None = inductor, and ``reduce-overhead`` on CUDA: CUDA graphs) over
    bucketed shapes (prompts left-padded to a multiple of ``prompt_bucket``, batches padded to a power of two with
    copies of the first row, whose samples are dropped). ``max_caches`` caches are kept, one per shape."""

    def __init__(
        self,
        *,
        compile: bool = False,
        backend: str | None = None,
        mode: str | None = None,
        prompt_bucket: int = 64,
        max_caches: int = 4,
    ) -> None:
        if prompt_bucket < 1:
            raise ValueError(f"prompt_bucket must be >= 1, got {prompt_bucket!r}.")
        self.compile, self.backend, self.mode = compile, backend, mode
        self.prompt_bucket = prompt_bucket if compile else 1
        self.max_caches = max_caches
        self._caches: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._compiled: Any = None
        self._model: nn.Module | None = None

    def _forward(self) -> Any:
        if not self.compile:
            return _decode_forward
        if self._compiled is None:
            mode = self.mode
            if mode is None and self._device.type == "cuda":
                mode = "reduce-overhead"
            self._compiled = torch.compile(_decode_forward, backend=self.backend or "inductor", mode=mode)
        return self._compiled

    def _cache(self, model: nn.Module, batch: int, length: int, device: torch.device) -> Any:
        from transformers import StaticCache

        key = (id(model), batch, length, device, torch.is_autocast_enabled(device.type))
        cache = self._caches.pop(key, None)
        if cache is None:
            cache = StaticCache(config=model.config, max_cache_len=length)  # type: ignore[arg-type]
        else:
            cache.reset()
        self._caches[key] = cache
        while len(self._caches) > self.max_caches:
            self._caches.popitem(last=False)
        return cache

    def prefill(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        max_new_tokens: int,
        *,
        vision: VisionRows | None = None,
        past: PastKV | None = None,
    ) -> torch.Tensor:
        if past is not None:
            raise ValueError("StaticKVDecoder does not start from kept keys and values (takes_past is False).")
        if has_images(vision):
            raise ValueError("StaticKVDecoder does not take images (takes_images is False): decode them dynamically.")
        batch, prompt_len = prompt_ids.shape
        self._device = device = prompt_ids.device
        padded_len = _round_up(prompt_len, self.prompt_bucket)
        padded_batch = _next_power_of_two(batch) if self.compile else batch
        ids = prompt_ids.new_zeros(padded_batch, padded_len)
        mask = torch.ones(padded_batch, padded_len + max_new_tokens, dtype=torch.long, device=device)
        ids[:batch, padded_len - prompt_len :] = prompt_ids
        mask[:batch, : padded_len - prompt_len] = 0
        mask[:batch, padded_len - prompt_len : padded_len] = prompt_attention_mask
        if padded_batch > batch:  # rows that only keep the shape: copies of the first row
            ids[batch:] = ids[0]
            mask[batch:] = mask[0]
        self._batch, self._model, self._mask, self._cache_kw = batch, model, mask, cache_keyword(model)
        self._cache_obj = self._cache(model, padded_batch, padded_len + max_new_tokens, device)
        self._next_position = mask[:, :padded_len].sum(dim=-1, keepdim=True)
        keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        outputs = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask[:, :padded_len]),
            use_cache=True,
            **{self._cache_kw: self._cache_obj},
            **keep,
        )
        return outputs.logits[:batch, -1, :]

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        assert self._model is not None, "prefill starts a decode"
        padded = self._mask.shape[0]
        if padded > self._batch:
            tokens = torch.cat([tokens, tokens[:1].expand(padded - self._batch)])
        if self.compile and self._device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        positions = self._next_position + step
        logits = self._forward()(self._model, tokens[:, None], self._mask, positions, self._cache_obj, self._cache_kw)
        # a CUDA graph's output is overwritten by its next replay: the caller may keep these logits
        return logits[: self._batch].clone() if self.compile else logits[: self._batch]

    def release(self) -> None:
        self._model = None
        self._cache_obj = None


def make_decoder(mode: str, **compile_options: Any) -> KVDecoder:
    """The decoder for a resolved ``mode`` (``dynamic``, ``static``, ``compiled``); ``compile_options`` go to a
    compiled ``StaticKVDecoder`` (``backend``, ``mode``, ``prompt_bucket``)."""
    if mode == "dynamic":
        return DynamicKVDecoder()
    if mode == "static":
        return StaticKVDecoder()
    if mode == "compiled":
        return StaticKVDecoder(compile=True, **compile_options)
    raise ValueError(f"A decoder is made for a resolved mode (dynamic, static, compiled), got {mode!r}.")
