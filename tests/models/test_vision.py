"""Vision-language models as students: loaded whole from a folder, the vision tower and projector told apart from
the language model (frozen by default, left out of LoRA), the processor checked against the config before loading,
and the head reader's output head of each family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, Qwen2Config

from lightning_gkd.models.head import load_output_head
from lightning_gkd.models.loading import load_causal_lm, source_config
from lightning_gkd.models.lora import apply_lora
from lightning_gkd.models.vision import (
    check_processor_fits,
    freeze_vision,
    input_side_modules,
    is_vision_language,
    language_model_only,
)
from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm
from lightning_gkd.toy.tiny_vlm import VLM_FAMILIES, tiny_vlm, vlm_tokenizer, write_tiny_vlm

#: the modules that only make each family's decoder input
VISION_SIDE = {
    "llava": ["model.vision_tower", "model.multi_modal_projector"],
    "llava_next": ["model.vision_tower", "model.multi_modal_projector"],
    "gemma3": ["model.vision_tower", "model.multi_modal_projector"],
    "idefics3": ["model.vision_model", "model.connector"],
    "mllama": ["model.vision_model", "model.multi_modal_projector"],
}


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_vision_side_is_found_frozen_and_left_out_of_lora(family):
    model, _ = tiny_vlm(family, seed=0)
    assert is_vision_language(model)
    assert list(input_side_modules(model)) == VISION_SIDE[family]
    vision = {id(p) for name in VISION_SIDE[family] for p in model.get_submodule(name).parameters()}
    frozen = freeze_vision(model)
    assert frozen == sum(p.numel() for p in model.parameters() if id(p) in vision)
    assert all(p.requires_grad == (id(p) not in vision) for p in model.parameters())
    assert model.lm_head.weight.requires_grad
    adapted, _ = tiny_vlm(family, seed=0)
    pattern = language_model_only(adapted)
    lora = apply_lora(adapted, {"r": 4})
    adapters = [name for name, p in lora.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in name for name in adapters)
    assert not any(side in name for name in adapters for side in VISION_SIDE[family])
    assert pattern is not None and pattern.startswith("^(")


def test_a_text_model_has_no_vision_side():
    model = tiny_causal_lm(TINY_STUDENT, vlm_tokenizer("llava"), seed=0)
    assert not is_vision_language(model) and input_side_modules(model) == {}
    assert freeze_vision(model) == 0 and language_model_only(model) is None


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_a_folder_loads_the_whole_vision_language_model(family, tmp_path):
    write_tiny_vlm(family, tmp_path / family)
    model = load_causal_lm(str(tmp_path / family))
    built, _ = tiny_vlm(family, seed=0)
    assert type(model) is type(built)
    assert is_vision_language(model)
    torch.testing.assert_close(model.lm_head.weight, built.lm_head.weight)
    assert source_config(str(tmp_path / family)).model_type == family


def test_the_processor_is_checked_against_the_students_config():
    _, processor = tiny_vlm("llava", seed=0)
    llava_config = tiny_vlm("llava", seed=0)[0].config
    check_processor_fits(processor, llava_config)  # its own: fine
    check_processor_fits(None, Qwen2Config())  # text data: nothing to check
    with pytest.raises(ValueError, match="the student is a text model"):
        check_processor_fits(processor, Qwen2Config())
    other = AutoConfig.for_model("llava")
    other.image_token_id = llava_config.image_token_id + 1
    with pytest.raises(ValueError, match="the processor is not the student's"):
        check_processor_fits(processor, other)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_head_reader_reads_a_vision_language_models_head(family, tmp_path):
    write_tiny_vlm(family, tmp_path)
    model, _ = tiny_vlm(family, seed=0)
    head = load_output_head(tmp_path)
    torch.testing.assert_close(head.weight, model.lm_head.weight)
