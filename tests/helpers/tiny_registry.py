"""Tiny models of every causal-LM architecture the installed transformers registers, built from its default config
shrunk to a few hundred thousand parameters (built in well under a second each, offline)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lightning_gkd.models.head import SHRUNK_FIELDS

#: config fields shrunk when a config has them (names differ across families): the head check's, and more
SMALL = {
    **SHRUNK_FIELDS,
    # linear-attention and state-space mixers (Kimi, Bailing, Falcon-H1): their reference PyTorch kernels at the
    # default head counts and 256-token chunks took ~15 s per model on CPU
    "linear_num_heads": 2,
    "linear_head_dim": 32,
    "mamba_n_heads": 8,
    "mamba_d_head": 8,
    "mamba_d_ssm": 64,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
}
MAX_PARAMETERS = 5_000_000


def causal_lm_types() -> list[str]:
    """Every model type with a causal-LM class in the installed transformers' auto registry."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, vocab_size: int, **overrides) -> PretrainedConfig:
    """The default config of ``model_type`` shrunk to tiny sizes, with our vocabulary (ids 0-2 for pad/bos/eos)."""
    config = AutoConfig.for_model(model_type)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = {**SMALL, "vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    for name, value in values.items():
        if hasattr(text, name):
            try:
                setattr(text, name, value)
            except Exception:  # a derived or validated field: keep the default
                pass
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) > 2:
        text.layer_types = layer_types[:2]
    return config


def build_tiny(config: PretrainedConfig, seed: int) -> torch.nn.Module:
    """The model of ``config`` with random weights (seeded); ValueError when it is not tiny."""
    with torch.device("meta"):
        sized = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in sized.parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count} parameters after shrinking the config (not tiny)")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float()
