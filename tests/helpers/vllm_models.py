"""Tiny causal LMs that vLLM's CPU build can serve (its CPU attention needs a head size of 32 or more; the suite's
TINY_STUDENT has 16), for the vLLM sampler's tests in the vLLM virtual environment."""

from __future__ import annotations

import os

import torch

from lightning_gkd.toy.tiny import tiny_causal_lm

# Families with different module layouts (Qwen2: q/k/v biases; Llama: none; Gemma 2: a soft-capped head), GQA.
VLLM_TINY = {
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    },
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    # a soft-capped head (final_logit_softcapping 30), tied embeddings scaled by sqrt(H), sliding-window layers
    "gemma2": {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 128,
        "sliding_window": 16,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
}


def vllm_tiny(family: str, tokenizer, *, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny ``family`` model whose weights make peaked, varied greedy completions."""
    model = tiny_causal_lm(VLLM_TINY[family], tokenizer, seed=seed)
    with torch.no_grad():  # larger weights than the init: logits far from uniform, so ties are rare
        generator = torch.Generator().manual_seed(seed)
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def in_process_vllm() -> None:
    """vLLM's engine core in this process (no spawned workers)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
