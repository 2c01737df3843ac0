"""The default sampler: our KV-cache decoder (``ops.decoding.sampling.generate_completions``), in process."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_gkd.ops.decoding.kv_decoders import DECODE_MODES, KVDecoder, make_decoder, resolve_decode
from lightning_gkd.ops.decoding.sampling import generate_completions, validate_sampling_args
from lightning_gkd.ops.hf.forward import (
    check_matmul_precision,
    float32_matmul_precision,
    is_sharded,
    resolve_eos_token_id,
    resolve_pad_token_id,
)
from lightning_gkd.ops.hf.model_inputs import VisionRows
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
    _decoder: KVDecoder | None = field(default=None, init=False, repr=False)
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
        )

    @staticmethod
    def check_settings(
        weights_dtype: str | None = "auto",
        decode: str = "auto",
        prompt_bucket: int = 64,
        finished_lag: int | None = None,
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

    def weights_updated(self) -> None:
        """An optimizer step is about to change the trainable models: their sampling copies re-sync when next used."""
        self._version += 1

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
        with float32_matmul_precision(self.matmul_precision), autocast_off:
            return generate_completions(
                sampling_model,
                prompts,
                prompt_attention_mask,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=resolve_pad_token_id(self.tokenizer),
                eos_token_id=resolve_eos_token_id(model, self.tokenizer),
                do_sample=True,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=seed,
                decoder=self.decoder(sampling_model, prompts.device),
                finished_lag=self.finished_lag,
                vision=vision,
            )

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
