"""Samplers and prompts with images: the KV-cache sampler prefills with them (a static decode falls back to the dynamic
decoder, with the same samples), its batch carries them, and the samplers that cannot take them refuse them."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers.vlm import image_row, picture

from lightning_gkd.data.vision_chat import VisionChatCollator
from lightning_gkd.ops.decoding.kv_decoders import supports_static_cache
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits, image_token_id, placeholder_token_ids
from lightning_gkd.samplers.base import check_sampler_images, refuse_images_message
from lightning_gkd.samplers.kv_cache import KVCacheSampler
from lightning_gkd.samplers.skd import SpeculativeKDSampler
from lightning_gkd.samplers.vllm import VLLMSampler
from lightning_gkd.toy.tiny_vlm import VLM_FAMILIES, tiny_vlm

_BUILT: dict[str, tuple] = {}


def vlm(family: str):
    if family not in _BUILT:
        _BUILT[family] = tiny_vlm(family, seed=0)
    return _BUILT[family]


def prompts(processor) -> dict:
    """Two prompt-only rows with one image each (the same image count: see tests/ops/hf/test_model_inputs.py for
    mllama's decode over uneven image counts)."""
    rows = [
        image_row(picture(0), "What shape?", completion=None),
        image_row("Hi, what is in this one?", picture(1, size=(30, 50)), completion=None),
    ]
    return VisionChatCollator(processor, 256)(rows)


def sample(family: str, decode: str, seed: int = 5) -> dict:
    model, processor = vlm(family)
    batch = prompts(processor)
    sampler = KVCacheSampler(processor.tokenizer, max_new_tokens=6, decode=decode, weights_dtype=None)
    return sampler.sample(model, batch["prompts"], batch["prompt_attention_mask"], seed=seed, vision=batch["vision"])


@pytest.mark.parametrize("family", [f for f in VLM_FAMILIES if supports_static_cache(vlm(f)[0])])
def test_static_decode_with_images_falls_back_to_dynamic_with_the_same_samples(family):
    static, dynamic = sample(family, "static"), sample(family, "dynamic")
    assert set(static) == set(dynamic) == {"input_ids", "attention_mask", "labels", "sampled_logprobs", "vision"}
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(static[key], dynamic[key]), key
    torch.testing.assert_close(static["sampled_logprobs"], dynamic["sampled_logprobs"], rtol=0, atol=0)
    assert not torch.equal(sample(family, "dynamic", seed=6)["input_ids"], dynamic["input_ids"])  # the seed matters


@pytest.mark.parametrize("family", [f for f in VLM_FAMILIES if not supports_static_cache(vlm(f)[0])])
def test_static_decode_is_refused_for_a_family_without_static_cache(family):
    with pytest.raises(ValueError, match="supports a static KV cache"):
        sample(family, "static")


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_sampled_batch_carries_the_images_and_its_logprobs_match_a_forward(family):
    model, processor = vlm(family)
    batch = prompts(processor)
    out = sample(family, "dynamic")
    assert out["vision"] is not None
    assert len(out["vision"]) == 2
    for got, want in zip(out["vision"], batch["vision"], strict=True):
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)
    width = batch["prompts"].shape[1]
    assert torch.equal(out["input_ids"][:, :width], batch["prompts"])
    # the training forward over the sampled batch (its images included) gives the sampled tokens' log-probabilities,
    # in the distribution sampled from: the image placeholders' logits removed
    with torch.no_grad():
        logits = causal_lm_logits(model, out).index_fill(-1, torch.tensor(placeholder_token_ids(model)), float("-inf"))
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, out["input_ids"][:, 1:, None])[..., 0]
    supervised = out["labels"][:, 1:] != -100
    assert supervised.any()
    torch.testing.assert_close(logprobs[supervised], out["sampled_logprobs"][:, 1:][supervised], rtol=0, atol=1e-4)


def test_samplers_that_take_no_images_refuse_them():
    _, processor = vlm("llava")
    batch = prompts(processor)
    skd = SpeculativeKDSampler(processor.tokenizer, max_new_tokens=4)
    with pytest.raises(ValueError) as caught:
        skd.sample(
            torch.nn.Linear(1, 1), batch["prompts"], batch["prompt_attention_mask"], seed=0, vision=batch["vision"]
        )
    assert str(caught.value) == refuse_images_message(SpeculativeKDSampler)
    assert str(caught.value).startswith("SpeculativeKDSampler does not sample from prompts with images")
    skd.refuse_images(None)  # text prompts, or rows without images, pass
    skd.refuse_images([{}, {}])
    # vLLM need not be installed: the check runs on the class (before any engine or model)
    vllm = VLLMSampler.__new__(VLLMSampler)
    with pytest.raises(ValueError, match=r"^VLLMSampler does not sample from prompts with images; use the KV-cache"):
        vllm.refuse_images(batch["vision"])
    for sampler in (VLLMSampler, partial(VLLMSampler, max_new_tokens=4), SpeculativeKDSampler, skd):
        with pytest.raises(ValueError, match="does not sample from prompts with images"):
            check_sampler_images(sampler)
    for sampler in (KVCacheSampler, partial(KVCacheSampler, decode="static"), KVCacheSampler(processor.tokenizer)):
        check_sampler_images(sampler)
    check_sampler_images(lambda **_: None)  # a factory of unknown class: checked once built
    KVCacheSampler(processor.tokenizer).refuse_images(batch["vision"])


@pytest.mark.parametrize("family", ["llava", "mllama"])
def test_image_placeholders_are_never_sampled(family):
    """A student that puts its mass on the image token (a random start can) never writes it: a sampled placeholder
    would ask the training forward for an image the row does not have."""
    model, processor = tiny_vlm(family, seed=0)
    image = image_token_id(model)
    boost = model.lm_head.register_forward_hook(
        lambda module, args, out: out.index_add(-1, torch.tensor([image]), torch.full_like(out[..., :1], 100.0))
    )
    try:
        batch = prompts(processor)
        sampler = KVCacheSampler(processor.tokenizer, max_new_tokens=4, temperature=1.0)
        out = sampler.sample(model, batch["prompts"], batch["prompt_attention_mask"], seed=0, vision=batch["vision"])
        new = out["input_ids"][:, batch["prompts"].shape[1] :]
        assert not (new == image).any()
        with torch.no_grad():  # without the suppression the boosted token is everyone's argmax
            assert (causal_lm_logits(model, batch)[:, -1].argmax(-1) == image).all()
        assert torch.isfinite(out["sampled_logprobs"]).all()
    finally:
        boost.remove()
