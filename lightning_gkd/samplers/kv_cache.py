"""The default sampler: our KV-cache decoder (``lightning_gkd.ops.sampling.generate_completions``), in process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_gkd.ops.hf import (
    check_matmul_precision,
    float32_matmul_precision,
    resolve_eos_token_id,
    resolve_pad_token_id,
)
from lightning_gkd.ops.sampling import generate_completions, validate_sampling_args


@dataclass
class KVCacheSampler:
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
    Training and greedy validation are not affected."""

    tokenizer: Any
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    matmul_precision: str | None = "medium"

    def __post_init__(self) -> None:
        validate_sampling_args(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        check_matmul_precision(self.matmul_precision)

    def sample(
        self, model: nn.Module, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, seed: int
    ) -> dict[str, torch.Tensor]:
        with float32_matmul_precision(self.matmul_precision):
            return generate_completions(
                model,
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
            )
