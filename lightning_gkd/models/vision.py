"""Vision-language models: telling them from text models, and the modules that only make the language model's input
(the vision tower and its projector), which a student freezes by default and LoRA leaves alone."""

from __future__ import annotations

import logging
import re
from typing import Any

from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from lightning_gkd.ops.hf.forward import unwrap
from lightning_gkd.ops.hf.model_inputs import config_image_token_id

log = logging.getLogger(__name__)


def is_vision_language_config(config: PretrainedConfig | None) -> bool:
    """A config of a family ``AutoModelForImageTextToText`` builds, with a vision tower (``vision_config``)."""
    return (
        config is not None
        and getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and getattr(config, "vision_config", None) is not None
    )


def is_vision_language(model: nn.Module) -> bool:
    return is_vision_language_config(getattr(unwrap(model), "config", None))


def input_side_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The vision-language model's modules that only make its language model's input, by their names in ``model``:
    the children of its base model (``model.model``: ``vision_tower``, ``multi_modal_projector``, ...) other than the
    text decoder (``get_decoder()``). Empty for a text model."""
    core = unwrap(model)
    base = getattr(core, "model", None)
    get_decoder = getattr(core, "get_decoder", None)
    if not is_vision_language(core) or not isinstance(base, nn.Module) or not callable(get_decoder):
        return {}
    decoder = get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is base)
    return {
        f"{prefix}.{name}" if prefix else name: child
        for name, child in base.named_children()
        if child is not decoder and any(True for _ in child.parameters())
    }


def freeze_vision(model: nn.Module) -> int:
    """Freeze the vision tower and projector of a vision-language model (``input_side_modules``): no gradients, so
    only the language model trains. Returns the number of parameters frozen (0 for a text model)."""
    frozen = 0
    for module in input_side_modules(model).values():
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.requires_grad_(False)
                frozen += parameter.numel()
    if frozen:
        names = ", ".join(input_side_modules(model))
        log.info(
            "Froze the %d parameters of the vision tower and projector (%s): only the language model trains "
            "(method.training.freeze_vision=false trains them too).",
            frozen,
            names,
        )
    return frozen


def language_model_only(model: nn.Module) -> str | None:
    """A regular expression matching the module names of ``input_side_modules`` (and everything under them), for
    ``peft.LoraConfig(exclude_modules=...)``: LoRA adapts the language model only. None for a text model."""
    names = list(input_side_modules(model))
    if not names:
        return None
    return "^(" + "|".join(re.escape(name) for name in names) + r")(\..*)?$"


def check_processor_fits(processor: Any, config: PretrainedConfig | None, *, role: str = "student") -> None:
    """Before any model loads: a processor (rows with images) needs a vision-language model whose image token is the
    processor's. ValueError naming both otherwise. Nothing to check without a processor or a config."""
    if processor is None or config is None:
        return
    if not is_vision_language_config(config):
        raise ValueError(
            f"The data has a processor ({type(processor).__name__}: rows with images) but the {role} is a text model "
            f"({getattr(config, 'model_type', '?')}). Use a vision-language {role}, or text data without "
            "data.processor."
        )
    token = getattr(processor, "image_token", None)
    expected = config_image_token_id(config)
    if token is None or expected is None:
        return
    got = processor.tokenizer.convert_tokens_to_ids(token)
    if got != expected:
        raise ValueError(
            f"The processor's image token {token!r} has id {got} but the {role} ({config.model_type}) replaces id "
            f"{expected} by image features: the processor is not the {role}'s. Load the processor from the "
            f"{role}'s folder (Hydra: leave data.processor null) or give the matching one."
        )
