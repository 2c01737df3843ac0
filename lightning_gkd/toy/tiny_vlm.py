"""Tiny randomly initialised vision-language models of several families, with processors built offline.

Each family (``VLM_FAMILIES``) gets an ``AutoModelForImageTextToText`` model far under 5M parameters (a 2-layer text
model of hidden size 64, a 1-2 layer vision tower, images of a few dozen pixels that become a handful of image
tokens) and its own processor class around the project's byte-level ChatML tokenizer plus the family's image special
tokens, a PIL image processor (no torchvision needed) and a chat template whose image parts render to the family's
placeholder (``image_placeholder``). Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
)
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from lightning_gkd.data.tokenizer import IM_END, IM_START, PAD_TOKEN, build_chatml_tokenizer

PAD_ID = 0
BOS_ID = 1  # ``<|im_start|>``: every ChatML turn starts with it
EOS_ID = 2  # ``<|im_end|>``

#: The text model every family gets unless ``text`` overrides it (head size 16).
_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}


@dataclass(frozen=True)
class _Family:
    """How one family is built: tokens, configs, image processor and processor arguments.

    ``tokens`` are the named special tokens added to the tokenizer (``tokenizer.<name>`` / ``<name>_id``), ``extra``
    unnamed ones; ``token_ids`` maps config fields to the token whose id they hold; ``image_processor`` and
    ``processor`` give keyword arguments from the image size and the model config, ``config`` top-level config fields
    from the image size; ``tokenizer`` are extra keyword arguments of the tokenizer; ``redraw`` maps name suffixes
    of parameters the family initialises to zero, which would keep the image from reaching the logits, to the std of
    a normal draw replacing them.
    """

    placeholder: str
    tokens: Mapping[str, str]
    token_ids: Mapping[str, str]
    image_size: int
    vision: Mapping[str, Any]
    image_processor: Callable[[int], dict[str, Any]]
    processor: Callable[[PretrainedConfig], dict[str, Any]]
    text: Mapping[str, Any] = field(default_factory=dict)
    config: Callable[[int], Mapping[str, Any]] = lambda size: {}
    extra: tuple[str, ...] = ()
    tokenizer: Mapping[str, str] = field(default_factory=dict)
    redraw: Mapping[str, float] = field(default_factory=dict)


#: Top-level llava / llava_next config: the last layer's patch features, CLS dropped.
_LLAVA = {"vision_feature_layer": -1, "vision_feature_select_strategy": "default"}

#: A SigLIP-style vision tower (gemma3, idefics3): 1 layer of hidden size 32.
_SIGLIP = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


#: A CLIP vision tower (llava, llava_next): 2 layers of hidden size 32, 14 px patches.
_CLIP = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 14,
    "projection_dim": 32,
}


def _crop(size: int) -> dict[str, Any]:
    """Image processor arguments that resize the short side to ``size`` and center-crop a ``size`` square."""
    return {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}}


def _llava_processor(config: PretrainedConfig) -> dict[str, Any]:
    """``LlavaProcessor`` / ``LlavaNextProcessor`` arguments matching the model's tower."""
    return {
        "patch_size": config.vision_config.patch_size,
        "vision_feature_select_strategy": config.vision_feature_select_strategy,
        "num_additional_image_tokens": 1,  # CLIP's CLS token, dropped by the "default" strategy
    }


def _square(size: int) -> dict[str, Any]:
    """Image processor arguments that resize straight to ``size`` x ``size``."""
    return {"size": {"height": size, "width": size}}


_FAMILIES: dict[str, _Family] = {
    "llava": _Family(
        placeholder="<image>",
        tokens={"image_token": "<image>"},
        token_ids={"image_token_index": "<image>"},
        image_size=28,
        vision=_CLIP,
        text={"model_type": "llama"},
        config=lambda size: _LLAVA,
        image_processor=_crop,
        processor=_llava_processor,
    ),
    "gemma3": _Family(
        placeholder="<start_of_image>",
        tokens={"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"},
        token_ids={
            "boi_token_index": "<start_of_image>",
            "image_token_index": "<image_soft_token>",
            "eoi_token_index": "<end_of_image>",
        },
        image_size=32,
        vision={**_SIGLIP, "patch_size": 8},
        text={"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64},
        config=lambda size: {"mm_tokens_per_image": 4},  # 4x4 patches (at 32 px) average-pooled to 2x2
        image_processor=_square,
        processor=lambda config: {"image_seq_length": config.mm_tokens_per_image},
        redraw={"mm_input_projection_weight": 0.02},
    ),
    "idefics3": _Family(
        placeholder="<image>",
        tokens={"image_token": "<image>"},
        extra=("<fake_token_around_image>", "<global-img>", "<end_of_utterance>"),
        token_ids={"image_token_id": "<image>"},
        image_size=32,
        vision={**_SIGLIP, "model_type": "idefics3_vision", "patch_size": 8},
        text={"model_type": "llama"},
        config=lambda size: {"scale_factor": 2},  # 4x4 patches (at 32 px) shuffled into 2x2 tokens
        image_processor=lambda size: {
            "do_image_splitting": False,
            "size": {"longest_edge": size},
            "max_image_size": {"longest_edge": size},
        },
        processor=lambda config: {
            "image_seq_len": (config.vision_config.image_size // config.vision_config.patch_size) ** 2
            // config.scale_factor**2
        },
    ),
    "llava_next": _Family(
        placeholder="<image>",
        tokens={"image_token": "<image>"},
        token_ids={"image_token_index": "<image>"},
        image_size=28,
        vision=_CLIP,
        text={"model_type": "llama"},
        # one high-resolution tile of the tower's size: the base image's 2x2 patches, the tile's (unpadded to the
        # image's aspect ratio) and a newline token per tile row
        config=lambda size: {**_LLAVA, "image_grid_pinpoints": [[size, size]]},
        image_processor=lambda size: {**_crop(size), "image_grid_pinpoints": [[size, size]]},
        processor=_llava_processor,
    ),
    "mllama": _Family(
        placeholder="<|image|>",
        tokens={"image_token": "<|image|>"},
        # MllamaProcessor prepends the BOS token to a prompt that lacks it: every ChatML prompt starts with this one
        tokenizer={"bos_token": IM_START},
        token_ids={"image_token_index": "<|image|>"},
        image_size=28,
        vision={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_global_layers": 1,
            "attention_heads": 2,
            "patch_size": 14,
            "max_num_tiles": 1,
            "supported_aspect_ratios": [[1, 1]],
            "intermediate_layers_indices": [0],
            "vision_output_dim": 64,  # hidden size x (1 + intermediate layers)
        },
        # the second decoder layer is a cross-attention layer: the image reaches the text through it, not as tokens
        text={"cross_attention_layers": [1]},
        image_processor=lambda size: {**_square(size), "max_image_tiles": 1},
        processor=lambda config: {},
        redraw={"cross_attn_attn_gate": 1.0, "cross_attn_mlp_gate": 1.0},  # tanh gates
    ),
}

VLM_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)
#: Families tried and left out, with the reason.
UNSUPPORTED_VLM_FAMILIES: dict[str, str] = {
    family: f"{processor} needs a video processor, and video processors need torchvision (not installed): neither "
    "the processor nor AutoProcessor.from_pretrained can be built without it"
    for family, processor in (("qwen2_vl", "Qwen2VLProcessor"), ("smolvlm", "SmolVLMProcessor"))
} | {
    "paligemma": "PaliGemmaProcessor rewrites the rendered prompt (inserts the BOS token after the last image token, "
    "appends a newline), so a ChatML row does not survive processing as rendered; it also adds 1152 <loc>/<seg> tokens "
    "to the tokenizer and returns labels that mask every token without a `suffix`",
}


def _family(family: str) -> _Family:
    """The settings of ``family``, or a ``ValueError`` naming the supported ones."""
    if family not in _FAMILIES:
        why = UNSUPPORTED_VLM_FAMILIES.get(family)
        hint = f" ({why})" if why else ""
        raise ValueError(f"Unsupported VLM family {family!r}{hint}; supported: {', '.join(VLM_FAMILIES)}.")
    return _FAMILIES[family]


def image_placeholder(family: str) -> str:
    """The string an image part of a chat message renders to for ``family``: its processor expands each one into
    the image's tokens."""
    return _family(family).placeholder


def vlm_chat_template(image_placeholder: str) -> str:
    """``CHATML_TEMPLATE`` whose message content may also be a list of parts: ``{"type": "text", "text": ...}``
    renders its text, ``{"type": "image", ...}`` renders ``image_placeholder``."""
    placeholder = json.dumps(image_placeholder, ensure_ascii=False)
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ " + placeholder + " }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def vlm_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """``build_chatml_tokenizer()`` (pad 0, ``<|im_start|>`` 1, EOS ``<|im_end|>`` 2, 256 bytes) plus the image special
    tokens of ``family`` (ids 259 on, named ones also as ``tokenizer.<name>``), with ``vlm_chat_template``."""
    spec = _family(family)
    backend = build_chatml_tokenizer().backend_tokenizer
    specials = list(dict.fromkeys([*spec.tokens.values(), *spec.extra]))
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=dict(spec.tokens),
        **spec.tokenizer,
    )
    tokenizer.chat_template = vlm_chat_template(spec.placeholder)
    return tokenizer


def tiny_vlm(
    family: str,
    *,
    seed: int = 0,
    text: Mapping[str, Any] | None = None,
    vision: Mapping[str, Any] | None = None,
    image_size: int | None = None,
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """A randomly initialised tiny ``AutoModelForImageTextToText`` of ``family`` and its offline processor.

    ``text`` / ``vision`` override the text / vision config, ``image_size`` the tower's (and image processor's)
    square image size. Parameters the family initialises to zero on the image's path (gemma3's projection,
    mllama's cross-attention gates) are drawn at random, so the image changes the logits. The model's vocabulary is
    the tokenizer's, its image token id the tokenizer's, and pad 0, BOS 1 (``<|im_start|>``), EOS 2 (``<|im_end|>``)
    are set in its text and generation configs.
    """
    spec = _family(family)
    tokenizer = vlm_tokenizer(family)
    size = image_size or spec.image_size
    text_config = {**_TEXT, **spec.text, "vocab_size": len(tokenizer), **(text or {})}
    vision_config = {**spec.vision, "image_size": size, **(vision or {})}
    token_ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in spec.token_ids.items()}
    config = AutoConfig.for_model(
        family, text_config=text_config, vision_config=vision_config, **spec.config(size), **token_ids
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            std = next((std for suffix, std in spec.redraw.items() if name.endswith(suffix)), None)
            if std is not None:
                parameter.normal_(0.0, std)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    image_processor_class = getattr(transformers, IMAGE_PROCESSOR_MAPPING_NAMES[family]["pil"])
    processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[family])
    processor = processor_class(
        image_processor=image_processor_class(**spec.image_processor(size)),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        **spec.processor(model.config),
    )
    return model.eval(), processor


def write_tiny_vlm(family: str, folder: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """``tiny_vlm(family, seed=seed, **overrides)`` saved into ``folder`` (model and processor); returns the folder.

    ``AutoModelForImageTextToText.from_pretrained(folder)`` and ``AutoProcessor.from_pretrained(folder)`` load them
    back offline. The saved ``image_processor_type`` is the base class name (e.g. ``Gemma3ImageProcessor``):
    without torchvision ``AutoProcessor`` resolves it to the PIL class (``Gemma3ImageProcessorPil``); where
    torchvision is installed it picks the torchvision class unless called with ``backend="pil"``.
    """
    model, processor = tiny_vlm(family, seed=seed, **overrides)
    path = Path(folder)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


#: The toy vision task's models (``scripts/train_toy_vlm.py``, ``tiny_vlm("llava", **TOY_VLM_TEACHER)``): 32 px images
#: in 8 px patches (16 image tokens), one CLIP tower shape, a 2 x 128 teacher language model and a 2 x 64 student.
TOY_VLM_TEACHER: dict[str, Any] = {
    "image_size": 32,
    "vision": {"patch_size": 8},
    "text": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4},
}
TOY_VLM_STUDENT: dict[str, Any] = {
    "image_size": 32,
    "vision": {"patch_size": 8},
    "text": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2},
}
