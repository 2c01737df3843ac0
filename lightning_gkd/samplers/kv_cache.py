"""The default sampler: our KV-cache decoder (``ops.decoding.sampling.generate_completions``), in process."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_gkd.ops.decoding.kv_decoders import (
    DECODE_MODES,
    DecodedKV,
    KVDecoder,
    make_decoder,
    resolve_decode,
)
from lightning_gkd.ops.decoding.sampling import (
    completion_batch,
    completion_lengths,
    generate_completions,
    validate_sampling_args,
)
from lightning_gkd.ops.decoding.turn_cache import (
    KeptKV,
    PastKV,
    gather_kv,
    is_left_padded,
    kept_kv,
    match_rows,
    row_tokens,
    suffix_inputs,
    weights_fingerprint,
)
from lightning_gkd.ops.hf.forward import (
    check_matmul_precision,
    float32_matmul_precision,
    is_sharded,
    resolve_eos_token_id,
    resolve_pad_token_id,
)
from lightning_gkd.ops.hf.model_inputs import VisionRows, has_images
from lightning_gkd.samplers.base import Sampler

log = logging.getLogger(__name__)

#: ``weights_dtype`` choices: the dtype of the sampling copy (``None``: sample with the model itself; ``auto``: the
#: autocast dtype where training runs mixed precision on a GPU, else the model itself).
SAMPLING_DTYPES = ("auto", "bfloat16", "float16")


def autocast_sampling_dtype(device: torch.device) -> torch.dtype | None:
    """``weights_dtype=auto``'s dtype on ``device``: the autocast dtype when autocast is on for a CUDA device (the
    step runs under Lightning's bf16-/16-mixed precision), else None (sample with the model itself)."""
    if device.type == "cuda" and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


@dataclass
class _SamplingCopy:
    """A frozen copy of a model in the sampling dtype, and the weight version it was last synced at."""

    model: nn.Module
    synced_version: int


@dataclass
class _TurnCache:
    """The KV kept from the last ``sample`` call for the next turn, and what it was computed with: the sampled
    model and its sampling module (weak references), their weights' fingerprints, the sampler's weight version, the
    device and the autocast state."""

    kept: KeptKV
    model: weakref.ReferenceType[nn.Module]
    sampling_model: weakref.ReferenceType[nn.Module]
    key: tuple[Any, ...]


@dataclass
class KVCacheSampler(Sampler):
    """Ancestral sampling with ``temperature``, ``top_k`` (0: off) and ``top_p`` (1: off), at most
    ``max_new_tokens`` new tokens, always with the KV cache (also when training uses gradient checkpointing). EOS
    comes from the sampling model's generation config (else the tokenizer's); rows are padded with the tokenizer's
    pad id (else EOS) after their EOS.

    ``matmul_precision`` (default "medium") is torch's float32 matmul precision while sampling (see
    ``ops.hf.float32_matmul_precision``). Decoding a few rows is a chain of thin matrix products, one read of every
    weight per token; at "medium" torch hands them to oneDNN, whose kernels read the weights 2.2x faster than exact
    float32's on an AVX512-BF16 CPU (a 0.5B student: 152 vs 332 ms a token at batch 2) and there keep float32's
    accuracy; on AMX CPUs and GPUs they may use bf16/TF32 inputs, and the samples and ``sampled_logprobs`` then come
    from those products, as from a bf16 serving engine. "highest" always samples from the exact float32 model.
    Training and greedy validation are not affected.

    ``weights_dtype`` ("bfloat16" or "float16"; ``None``: off; default "auto": the autocast dtype when the step runs
    under bf16-/16-mixed precision on a GPU, else off) samples from a copy of the model cast to that dtype, which
    halves the bytes every decoded token reads and, under autocast, removes its cast of every weight at every decode
    forward (the copy decodes with autocast off, as a bf16 serving engine does). The copy is made at the first
    sampling call (it holds half a float32 model's bytes for the whole fit) and re-synced from the model, in place,
    at the first sampling call after an optimizer step changed the model (``weights_updated``), like the vLLM
    engine's copy. The samples and ``sampled_logprobs`` are then those of the cast copy, as from a bf16 serving
    engine. A model whose floating weights already have that dtype is sampled as is; a sharded (FSDP2) model is
    refused when the dtype is named (gather it or use ``sampler=vllm``) and sampled as is under "auto".

    ``decode`` chooses how the forwards run (``ops.decoding.kv_decoders``), once, at the first sampling call
    (logged): "dynamic" (transformers' growing cache), "static" (a static cache and one mask for the whole decode:
    no host read per token), "compiled" (the static decode forward ``torch.compile``d with ``compile_backend``,
    default inductor, as CUDA graphs on a GPU; prompts left-padded to a multiple of ``prompt_bucket`` and batches to
    a power of two, so a run compiles a few shapes) or "auto" (default: "compiled" on CUDA for a family with
    static-cache support, else "dynamic"). ``finished_lag`` reads "all rows finished" that many tokens late (None:
    4 on CUDA, 0 on the CPU; ``ops.decoding.sampling.LaggedFlag``). Samples are the same whichever is chosen, up
    to floating-point summation order in the static cache's longer, masked attention.

    Prompts with images (``vision``, a vision-language model's) prefill with them; those decodes use the dynamic
    decoder whatever ``decode`` says (the static ones take text only).

    ``reuse_turn_cache`` (default True) carries each row's KV cache from one ``sample`` call to the next, for the
    turns of a multi-turn rollout: after a call the sampler keeps every returned row's cache (its context and its
    sampled tokens up to and including EOS, as far as the model consumed them) and, at the next call, a row whose
    tokens start with a kept row's reuses that row's keys and values and prefills only the rest (the environment's
    reply and the next generation prompt); other rows prefill in full (``ops.decoding.turn_cache``). The samples are
    those of a full prefill, up to floating-point summation order. What is kept is dropped at ``weights_updated``,
    at ``end_rollout``, at ``close``, and never used with another model, with weights changed in place since
    (``weights_fingerprint``), on another device or autocast state. Only the dynamic decoder reuses: with
    ``decode=static|compiled`` every turn prefills in full and nothing is kept; so do rows with images, and a model
    whose cache is not transformers' ``DynamicCache`` of full (or not yet sliding) attention layers, or whose
    sliding window the decode's width would reach. ``last_stats()`` reports the tokens of the last call's prefill
    (``prefill_tokens``) and the reused ones (``reused_tokens``).
    """

    takes_images: ClassVar[bool] = True

    tokenizer: Any
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    matmul_precision: str | None = "medium"
    weights_dtype: str | None = "auto"
    decode: str = "auto"
    compile_backend: str | None = None
    prompt_bucket: int = 64
    finished_lag: int | None = None
    reuse_turn_cache: bool = True
    _decoder: KVDecoder | None = field(default=None, init=False, repr=False)
    _turns: _TurnCache | None = field(default=None, init=False, repr=False)
    _stats: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _copies: dict[int, _SamplingCopy] = field(default_factory=dict, init=False, repr=False)
    _version: int = field(default=0, init=False, repr=False)
    #: Seconds spent making and re-syncing sampling copies (``weights_dtype``), in this process.
    seconds: dict[str, float] = field(default_factory=lambda: {"sync": 0.0}, init=False, repr=False)

    def __post_init__(self) -> None:
        validate_sampling_args(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        check_matmul_precision(self.matmul_precision)
        self.check_settings(
            weights_dtype=self.weights_dtype,
            decode=self.decode,
            prompt_bucket=self.prompt_bucket,
            finished_lag=self.finished_lag,
            reuse_turn_cache=self.reuse_turn_cache,
        )

    @staticmethod
    def check_settings(
        weights_dtype: str | None = "auto",
        decode: str = "auto",
        prompt_bucket: int = 64,
        finished_lag: int | None = None,
        reuse_turn_cache: bool = True,
        **_: Any,
    ) -> None:
        """The factory's options, checked before any model loads."""
        if weights_dtype is not None and weights_dtype not in SAMPLING_DTYPES:
            raise ValueError(
                f"sampler.weights_dtype must be one of {SAMPLING_DTYPES} or null (sample with the model itself), "
                f"got {weights_dtype!r}."
            )
        if decode not in DECODE_MODES:
            raise ValueError(f"sampler.decode must be one of {DECODE_MODES}, got {decode!r}.")
        if isinstance(prompt_bucket, bool) or not isinstance(prompt_bucket, int) or prompt_bucket < 1:
            raise ValueError(f"sampler.prompt_bucket must be an integer >= 1, got {prompt_bucket!r}.")
        if finished_lag is not None and (not isinstance(finished_lag, int) or finished_lag < 0):
            raise ValueError(f"sampler.finished_lag must be an integer >= 0 or null (auto), got {finished_lag!r}.")
        if not isinstance(reuse_turn_cache, bool):
            raise ValueError(f"sampler.reuse_turn_cache must be true or false, got {reuse_turn_cache!r}.")

    def weights_updated(self) -> None:
        """An optimizer step is about to change the trainable models: their sampling copies re-sync when next used,
        and the KV kept for the next turn is dropped."""
        self._version += 1
        self._turns = None

    def end_rollout(self) -> None:
        """A multi-turn rollout ended: drop the KV kept for its next turn."""
        self._turns = None

    def close(self) -> None:
        """Drop the KV kept for a next turn (the sampling copies stay: they are re-synced, not rebuilt)."""
        self._turns = None

    def last_stats(self) -> dict[str, float]:
        """The last call's prefill: ``prefill_tokens`` (the rows' tokens it fed) and ``reused_tokens`` (the tokens
        whose keys and values came from the previous call instead)."""
        return dict(self._stats)

    def kept_bytes(self) -> int:
        """Bytes of the keys and values kept for the next turn (0: none)."""
        return 0 if self._turns is None else self._turns.kept.nbytes()

    def sample(
        self,
        model: nn.Module,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        seed: int,
        vision: VisionRows | None = None,
    ) -> dict[str, Any]:
        sampling_model = self.sampling_model(model, prompts.device)
        # a cast copy decodes in its own dtype: autocast would only add casts
        autocast_off = (
            torch.autocast(prompts.device.type, enabled=False)
            if sampling_model is not model
            else contextlib.nullcontext()
        )
        decoder = self.decoder(sampling_model, prompts.device)
        eos_token_id = resolve_eos_token_id(model, self.tokenizer)
        reusing = self.reuse_turn_cache and decoder.takes_past and not has_images(vision)
        real = int(prompt_attention_mask.sum())
        self._stats = {"prefill_tokens": float(real), "reused_tokens": 0.0}
        key = self._turn_key(model, sampling_model, prompts.device) if reusing else None
        tokens = row_tokens(prompts, prompt_attention_mask) if reusing else []
        past, reuse, ids, mask = self._reuse(model, sampling_model, key, prompts, prompt_attention_mask, tokens)
        self._turns = None  # what this call reuses is gathered into past: hold one turn's cache at a time
        kv_out: list[DecodedKV | None] | None = [] if reusing else None
        with float32_matmul_precision(self.matmul_precision), autocast_off:
            out = generate_completions(
                sampling_model,
                ids,
                mask,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=resolve_pad_token_id(self.tokenizer),
                eos_token_id=eos_token_id,
                do_sample=True,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=seed,
                decoder=decoder,
                finished_lag=self.finished_lag,
                vision=vision,
                past=past,
                kv_out=kv_out,
            )
        completion = out["input_ids"][:, ids.shape[1] :]
        if past is not None:  # the batch's prompt columns are the full prompts, as given
            reused = int(reuse.sum())
            self._stats = {"prefill_tokens": float(real - reused), "reused_tokens": float(reused)}
            logprobs = out["sampled_logprobs"][:, ids.shape[1] :]
            out = completion_batch(prompts, prompt_attention_mask, completion, eos_token_id, logprobs)
        decoded = kv_out[0] if kv_out else None
        if decoded is not None and key is not None and key == self._turn_key(model, sampling_model, prompts.device):
            lengths, _ = completion_lengths(completion, eos_token_id)
            kept = kept_kv(
                decoded.keys,
                decoded.values,
                decoded.context_mask,
                tokens,
                completion,
                lengths,
                decoded.fed,
                window=decoded.window,
            )
            self._turns = _TurnCache(kept, weakref.ref(model), weakref.ref(sampling_model), key)
        return out

    def _turn_key(self, model: nn.Module, sampling_model: nn.Module, device: torch.device) -> tuple[Any, ...]:
        """What kept KV must have been computed with to be reused: the weights of ``model`` and of the module that
        decodes for it (``weights_fingerprint``), the sampler's weight version, the device and the autocast
        state."""
        autocast = torch.is_autocast_enabled(device.type)
        return (
            weights_fingerprint(model),
            weights_fingerprint(sampling_model) if sampling_model is not model else None,
            self._version,
            device,
            autocast,
            torch.get_autocast_dtype(device.type) if autocast else None,
        )

    def _reuse(
        self,
        model: nn.Module,
        sampling_model: nn.Module,
        key: tuple[Any, ...] | None,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        tokens: list[list[int]],
    ) -> tuple[PastKV | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept KV this call's rows reuse (None: prefill in full), how many tokens each reuses ``(B,)``, and
        the ids and mask to prefill: the rows' suffixes after the reused tokens, or the prompts as given."""
        none = torch.zeros(prompts.shape[0], dtype=torch.long, device=prompts.device)
        turns = self._turns
        if key is None or turns is None:
            return None, none, prompts, prompt_attention_mask
        if turns.model() is not model or turns.sampling_model() is not sampling_model or turns.key != key:
            self._turns = None  # other weights, another model, another device: never reused
            return None, none, prompts, prompt_attention_mask
        if not is_left_padded(prompt_attention_mask):
            return None, none, prompts, prompt_attention_mask
        sources, counts = match_rows(turns.kept.tokens, tokens)
        if not any(counts):
            return None, none, prompts, prompt_attention_mask
        device = turns.kept.columns.device
        source = torch.tensor(sources, dtype=torch.long, device=device)
        reuse = torch.tensor(counts, dtype=torch.long, device=device)
        ids, mask = suffix_inputs(prompts, prompt_attention_mask, reuse.to(prompts.device))
        width = max(counts) + ids.shape[1] + self.max_new_tokens
        if turns.kept.window is not None and width >= turns.kept.window:
            return None, none, prompts, prompt_attention_mask  # the gap would reach into the sliding window
        return gather_kv(turns.kept, source, reuse), reuse, ids, mask

    def decoder(self, model: nn.Module, device: torch.device) -> KVDecoder:
        """The decoder ``decode`` resolves to for the first model sampled (kept for the whole run, logged once)."""
        if self._decoder is None:
            mode = resolve_decode(self.decode, model, device)
            options: dict[str, Any] = {"prompt_bucket": self.prompt_bucket}
            if self.compile_backend is not None:
                options["backend"] = self.compile_backend
            self._decoder = make_decoder(mode, **options)
            log.info("KVCacheSampler decodes with the %s decoder (decode=%s, on %s)", mode, self.decode, device)
        return self._decoder

    def sampling_model(self, model: nn.Module, device: torch.device | None = None) -> nn.Module:
        """The module that decodes for ``model`` on ``device`` (its parameters' device when None): ``model``
        itself, or its copy in ``weights_dtype`` (made on first use, re-synced when an optimizer step changed
        ``model`` since)."""
        if self.weights_dtype == "auto":
            if device is None:
                device = next(model.parameters()).device
            dtype = autocast_sampling_dtype(device)
            if dtype is None or is_sharded(model):
                return model
        elif self.weights_dtype is None:
            return model
        else:
            dtype = getattr(torch, self.weights_dtype)
        floating = [p for p in model.parameters() if p.is_floating_point()]
        if all(p.dtype == dtype for p in floating):
            return model
        if is_sharded(model):
            raise ValueError(
                f"sampler.weights_dtype={self.weights_dtype} copies the model for sampling, but this model is "
                "sharded (FSDP2). Set sampler.weights_dtype=null, or use sampler=vllm, whose engine gathers the "
                "shards."
            )
        started = time.perf_counter()
        held = self._copies.get(id(model))
        if held is None:
            held = self._copies[id(model)] = _SamplingCopy(_cast_copy(model, dtype), self._version)
        elif held.synced_version != self._version and any(p.requires_grad for p in floating):
            _sync_copy(held.model, model)
            held.synced_version = self._version
        self.seconds["sync"] += time.perf_counter() - started
        return held.model


def _cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen deep copy of ``model`` whose floating parameters are cast to ``dtype`` (tied parameters stay tied;
    the float32 weights are never duplicated on the way); buffers are copied as they are."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        cast = parameter.detach().to(dtype) if parameter.is_floating_point() else parameter.detach().clone()
        memo[id(parameter)] = nn.Parameter(cast, requires_grad=False)
    return copy.deepcopy(model, memo).requires_grad_(False)


@torch.no_grad()
def _sync_copy(target: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s parameters into ``target``'s (same structure), casting to ``target``'s dtypes in place."""
    for copied, parameter in zip(target.parameters(), source.parameters(), strict=True):
        copied.copy_(parameter)
