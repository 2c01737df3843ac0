"""Tiny models of every causal-LM architecture the installed transformers registers, built from its default config
shrunk to a few hundred thousand parameters (built in well under a second each, offline)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.auto_factory import _BaseAutoModelClass
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
    # the decoder stacks of encoder-decoder families (BART, Marian, Pegasus, Whisper, ...), used as causal LMs
    "decoder_layers": 2,
    "decoder_ffn_dim": 128,
    "decoder_attention_heads": 2,
    "encoder_layers": 2,
    "encoder_ffn_dim": 128,
    "encoder_attention_heads": 2,
}
#: vision towers shrunk for the image-text-to-text classes whose text path the lean path takes (the causal-LM
#: classes of these families ignore the vision config)
SMALL_VISION = {
    "llama4": {
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "vision_output_dim": 64,
        "image_size": 28,
        "patch_size": 14,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
    },
    "mllama": {
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_global_layers": 1,
        "attention_heads": 2,
        "intermediate_size": 128,
        "vision_output_dim": 128,  # hidden_size * (1 + len(intermediate_layers_indices))
        "intermediate_layers_indices": [0],
        "image_size": 28,
        "patch_size": 14,
        "max_num_tiles": 1,
        "supported_aspect_ratios": [[1, 1]],
    },
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
    for name, value in consistent_sizes(text).items():
        if name not in overrides:
            setattr(text, name, value)
    for name, value in SMALL_VISION.get(model_type, {}).items():
        setattr(config.vision_config, name, value)
    cross_attention = getattr(text, "cross_attention_layers", None)  # Mllama: image layers among those kept
    if isinstance(cross_attention, list) and isinstance(layers := getattr(text, "num_hidden_layers", None), int):
        text.cross_attention_layers = [i for i in cross_attention if i < layers] or [layers - 1]
    return config


def consistent_sizes(text: PretrainedConfig) -> dict[str, int]:
    """The fields derived from others at a config's ``__init__``, recomputed from the shrunk sizes: shrinking sets
    each field alone, so these keep their full-size defaults and the model's shapes disagree."""
    fields: dict[str, int] = {}

    def has(*names: str) -> bool:
        return all(isinstance(getattr(text, name, None), int) for name in names)

    if has("qk_rope_head_dim", "qk_nope_head_dim"):  # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM)
        fields["head_dim"] = text.qk_rope_head_dim  # the rotary embedding's width: the rope part of a query head
        if has("num_attention_heads", "num_key_value_heads"):  # keys are per query head (latent, not grouped)
            fields["num_key_value_heads"] = text.num_attention_heads
        if hasattr(text, "qk_head_dim"):
            fields["qk_head_dim"] = text.qk_nope_head_dim + text.qk_rope_head_dim
        if has("index_head_dim", "index_n_heads"):  # DeepSeek sparse attention's indexer
            fields["index_head_dim"], fields["index_n_heads"] = 2 * text.qk_rope_head_dim, 2
    if has("n_group", "topk_group"):  # grouped expert routing: the shrunk expert count no longer fills 8 groups
        fields["n_group"], fields["topk_group"] = 1, 1
    if has("rotary_dim", "hidden_size", "num_attention_heads"):  # GPT-J, CodeGen: rotary on part of a head
        fields["rotary_dim"] = min(text.rotary_dim, text.hidden_size // text.num_attention_heads // 2)
    # Mamba2 mixers need heads * head width == expand * hidden_size, and groups dividing the heads
    if has("expand", "hidden_size", "head_dim", "num_heads", "n_groups"):  # Mamba2
        fields["num_heads"] = text.expand * text.hidden_size // text.head_dim
        fields["n_groups"] = 1
    if has("mamba_expand", "hidden_size", "mamba_n_heads", "mamba_d_head"):  # Bamba, GraniteMoeHybrid, Falcon-H1
        width = getattr(text, "mamba_d_ssm", None) or text.mamba_expand * text.hidden_size  # Falcon-H1 sets d_ssm
        fields["mamba_d_head"] = width // text.mamba_n_heads
    if has("mamba_expand", "hidden_size", "n_mamba_heads", "mamba_headdim"):  # Zamba2
        fields["mamba_headdim"] = text.mamba_expand * text.hidden_size // text.n_mamba_heads
    if has("embedding_dim", "hidden_size") and text.embedding_dim != text.hidden_size:  # xLSTM
        fields["embedding_dim"] = text.hidden_size
    return fields


def build_tiny(
    config: PretrainedConfig, seed: int, auto_class: type[_BaseAutoModelClass] = AutoModelForCausalLM
) -> torch.nn.Module:
    """The model of ``config`` (the ``auto_class`` mapping's class for it) with random weights (seeded); ValueError
    when it is not tiny."""
    with torch.device("meta"):
        sized = auto_class.from_config(config)
    count = sum(p.numel() for p in sized.parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count} parameters after shrinking the config (not tiny)")
    torch.manual_seed(seed)
    return auto_class.from_config(config).float()
