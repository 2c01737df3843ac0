"""Decoding a model with multimodal rotary positions (Qwen2-VL's M-RoPE) from prompts with images: the positions after
an image continue from where the image left them (``ops.hf.model_inputs.text_position_offsets``), not from its count
of tokens. Qwen2-VL's processor needs torchvision (not on these machines), so the prompts are built by hand around
the PIL image processor's pixel values and grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

import lightning_gkd.ops.decoding.kv_decoders as kv_decoders
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.sampling import complete_prompts
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits, lm_inputs

IMAGE, START, END, VIDEO = 290, 292, 293, 291


@pytest.fixture(scope="module")
def qwen2_vl():
    config = AutoConfig.for_model("qwen2_vl")
    text = config.text_config
    for name, value in {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 512,
    }.items():
        setattr(text, name, value)
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [2, 3, 3]}  # 16 = 2 * (2 + 3 + 3)
    vision = config.vision_config
    for name, value in {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 8}.items():
        setattr(vision, name, value)
    config.image_token_id, config.video_token_id = IMAGE, VIDEO
    config.vision_start_token_id, config.vision_end_token_id = START, END
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    processor_class = get_image_processor_class_from_name("Qwen2VLImageProcessorPil")
    images = processor_class(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=48 * 48, max_pixels=48 * 48)
    return model, images


def prompts(images):
    """Two left-padded prompts, each with one 48 px image (6 x 6 patches merged to 3 x 3 = 9 tokens that take 3
    positions), and their per-row image inputs."""
    rng = np.random.default_rng(0)
    vision, rows = [], []
    for text in ([10, 11, 12], [15]):
        picture = Image.fromarray((rng.random((48, 48, 3)) * 255).astype("uint8"))
        inputs = images(images=[picture], return_tensors="pt")
        count = int(inputs["image_grid_thw"].prod()) // 4
        rows.append([1, *text, START, *[IMAGE] * count, END, 20, 21, 2, 1, 30])
        vision.append({"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]})
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return rows, ids, mask, vision


class Ids:
    pad_token_id, eos_token_id = 0, 2


@torch.no_grad()
def decode_logprob_error(model, ids, mask, vision) -> float:
    """The largest difference between each decoded token's log-prob and the full forward's over the result."""
    out = complete_prompts(model, Ids(), ids, mask, max_new_tokens=6, vision=vision)
    logits = causal_lm_logits(model, out).float().index_fill(-1, torch.tensor([IMAGE, VIDEO]), float("-inf"))
    full = torch.log_softmax(logits, dim=-1)  # the distribution sampled from: placeholders are never written
    labelled = out["labels"][:, 1:] != IGNORE_INDEX
    forward = full[:, :-1].gather(-1, out["input_ids"][:, 1:, None])[..., 0][labelled]
    return float((forward - out["sampled_logprobs"][:, 1:][labelled]).abs().max())


def test_greedy_decoding_equals_generate(qwen2_vl):
    model, images = qwen2_vl
    rows, ids, mask, vision = prompts(images)
    out = complete_prompts(model, Ids(), ids, mask, max_new_tokens=6, vision=vision)
    for index, row in enumerate(rows):
        prompt = torch.tensor([row])
        inputs = lm_inputs(model, prompt, torch.ones_like(prompt), [vision[index]])
        assert "position_ids" not in inputs and "mm_token_type_ids" in inputs  # the model computes its own positions
        expected = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=2)
        assert out["input_ids"][index, ids.shape[1] :].tolist() == expected[0, len(row) :].tolist()[:6]


def test_decoded_positions_are_the_full_forwards(qwen2_vl, monkeypatch):
    model, images = qwen2_vl
    _, ids, mask, vision = prompts(images)
    assert decode_logprob_error(model, ids, mask, vision) < 1e-5
    # the check can fail: positions counted as tokens (no offsets) give other log-probs
    monkeypatch.setattr(kv_decoders, "text_position_offsets", lambda model, inputs: 0)
    assert decode_logprob_error(model, ids, mask, vision) > 1e-4
