"""The lean loss reproduces each model's own logits (lightning_gkd.ops.hf.heads.LogitHead, check_output_head and the
chunked JSD through GKDModule.distillation_loss): across every causal-LM architecture the installed transformers
registers, built tiny with large logits, the lean loss equals the full-logits loss in value and gradients, or the
module falls back to full logits with a warning naming the model class. Never silently wrong."""

import functools
import logging
import warnings

import pytest
import torch
from helpers.tiny_registry import build_tiny, causal_lm_types, tiny_config
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from lightning_gkd import GKDModule
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.ops.divergence.chunked_jsd import projected_jsd_loss
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss
from lightning_gkd.ops.hf.heads import LogitHead, output_head

log = logging.getLogger(__name__)
TOKENIZER = build_chatml_tokenizer()
LOGIT_STD = 15.0  # trained models reach tens (max |logit| here ~50); soft-capping (Gemma: 30) bites there
RTOL = 1e-5
#: families whose head the lean path describes: they must take the exact path, at defaults and at real values
EXACT = {
    "gemma2": {},  # final_logit_softcapping 30 by default
    "gemma3_text": {"final_logit_softcapping": 30.0},  # default None; Gemma 3 checkpoints have set it
    "cohere": {},  # logit_scale 0.0625
    "cohere2": {},
    "granite": {"logits_scaling": 8.0},  # default 1.0; Granite 3 checkpoints use 8 or 16
    "llama": {},
    "qwen2": {},
    "mistral": {},
    # get_decoder() returns the model itself: the decoder comes from hf._DECODER_PATHS
    "llama4": {},
    "llama4_text": {},
    "mllama": {},
    "fuyu": {},  # a vision projection feeding the decoder (hf._INPUT_SIDE_PATHS)
    # sizes the tiny builder keeps consistent (helpers.tiny_registry.consistent_sizes)
    "deepseek_v3": {},  # multi-head latent attention, grouped expert routing
    "minicpm3": {},
    "mamba2": {},  # heads * head width = expand * hidden
    "bamba": {},
    "falcon_h1": {},
    "zamba2": {},
    "gptj": {},  # rotary on part of a head
    "bart": {},  # the decoder stack of an encoder-decoder family
}
#: image-text-to-text classes whose text path the lean path takes on a text-only batch
CONDITIONAL_GENERATION = ["llama4", "mllama"]


def batch() -> dict[str, torch.Tensor]:
    """Two left-padded rows with uneven completion lengths (3 and 6 supervised tokens)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(TOKENIZER), (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    labels = torch.full_like(ids, -100)
    labels[0, -3:], labels[1, -6:] = ids[0, -3:], ids[1, -6:]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def with_large_logits(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Scale the output projection so the logits' standard deviation is about LOGIT_STD."""
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], use_cache=False).logits
        model.get_output_embeddings().weight.mul_(LOGIT_STD / max(float(logits.float().std()), 1e-6))
    return model


def build_pair(model_type: str, strict: bool = False, auto_class=AutoModelForCausalLM, **overrides):
    """Student and teacher of ``model_type`` built tiny; a skip when they cannot be, unless ``strict``."""
    try:
        config = tiny_config(model_type, len(TOKENIZER), **overrides)
        data = batch()
        student = with_large_logits(build_tiny(config, seed=0, auto_class=auto_class), data)
        teacher = with_large_logits(build_tiny(config, seed=1, auto_class=auto_class), data)
    except Exception as error:  # not buildable tiny and offline from its default config
        if strict:
            raise
        log.warning("skipping %s: %s: %s", model_type, type(error).__name__, str(error)[:200])
        pytest.skip(f"{model_type} cannot be built tiny offline: {type(error).__name__}: {str(error)[:200]}")
    return student, teacher, data


def losses_and_grads(module: GKDModule, data: dict[str, torch.Tensor], lean: bool):
    module.lean_path.enabled = lean
    module.student.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = module.distillation_loss(data).loss
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.student.named_parameters() if p.grad is not None}
    fallback = [str(w.message) for w in caught if "lean_loss:" in str(w.message)]
    return loss.detach(), grads, fallback


def assert_same(lean_loss, lean_grads, full_loss, full_grads):
    assert torch.allclose(lean_loss, full_loss, rtol=RTOL, atol=1e-7), (float(lean_loss), float(full_loss))
    assert lean_grads.keys() == full_grads.keys()
    scale = max(float(g.abs().max()) for g in full_grads.values())
    for name, grad in full_grads.items():
        difference = float((lean_grads[name] - grad).abs().max())
        assert difference <= RTOL * scale + 1e-9, (name, difference, scale)


def run_parity(model_type: str, strict: bool = False, auto_class=AutoModelForCausalLM, **overrides) -> bool:
    """True when the lean path was exact, False when it fell back (with its warning); fails otherwise. A model that
    cannot be built tiny or run is a skip, unless ``strict``."""
    student, teacher, data = build_pair(model_type, strict, auto_class, **overrides)
    try:
        # forward KL: with large logits the JSD saturates at ln 2 and its gradients vanish; the KL keeps O(1) ones
        module = GKDModule(student, teacher, TOKENIZER, sampling={"max_new_tokens": 4}, divergence={"beta": 0.0})
        full_loss, full_grads, _ = losses_and_grads(module, data, lean=False)
    except Exception as error:  # the model's own forward rejects our calling convention
        if strict:
            raise
        pytest.skip(f"{model_type}: its forward fails on a left-padded batch: {type(error).__name__}: {error}")
    lean_loss, lean_grads, fallback = losses_and_grads(module, data, lean=True)
    if fallback:
        assert type(student).__name__ in fallback[0] or "output projection" in fallback[0] or "no " in fallback[0]
        assert module.lean_path.enabled is False
        log.warning("%s falls back to full logits: %s", model_type, fallback[0])
    assert_same(lean_loss, lean_grads, full_loss, full_grads)
    return not fallback


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_lean_loss_equals_the_models_own_logits_or_falls_back_with_a_warning(model_type):
    run_parity(model_type)


@pytest.mark.parametrize("model_type", sorted(EXACT))
def test_the_described_heads_take_the_exact_lean_path(model_type):
    assert run_parity(model_type, strict=True, **EXACT[model_type]), f"{model_type} fell back to full logits"


@pytest.mark.parametrize("model_type", CONDITIONAL_GENERATION)
def test_image_text_to_text_classes_take_the_exact_lean_path_on_text(model_type):
    exact = run_parity(model_type, strict=True, auto_class=AutoModelForImageTextToText)
    assert exact, f"{model_type} (image-text-to-text class) fell back to full logits"


def test_the_head_description_reads_each_familys_transform():
    described = {}
    for model_type, overrides in EXACT.items():
        student, _, _ = build_pair(model_type, **overrides)
        head = output_head(student)
        described[model_type] = (head.scale, head.softcap)
    assert described["gemma2"] == (1.0, 30.0) and described["gemma3_text"] == (1.0, 30.0)
    assert described["cohere"] == (0.0625, None) and described["granite"] == (0.125, None)
    assert described["llama"] == (1.0, None)


def test_an_unknown_head_transform_falls_back_with_a_warning_naming_the_class():
    student, teacher, data = build_pair("llama")

    class Shifted(type(student)):
        """A head the description cannot know: logits + 3 on a few tokens."""

        @functools.wraps(type(student).forward)
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits[..., :5] += 3.0
            return out

    student.__class__ = Shifted
    module = GKDModule(student, teacher, TOKENIZER, sampling={"max_new_tokens": 4}, divergence={"beta": 0.0})
    full_loss, full_grads, _ = losses_and_grads(module, data, lean=False)
    lean_loss, lean_grads, fallback = losses_and_grads(module, data, lean=True)
    assert fallback and "Shifted's logits are not softcap" in fallback[0]
    assert_same(lean_loss, lean_grads, full_loss, full_grads)


@pytest.mark.parametrize("softcap, scale, bias", [(30.0, 1.0, False), (None, 0.125, True), (5.0, 2.0, True)])
def test_projected_jsd_through_a_capped_scaled_biased_head_matches_autograd(softcap, scale, bias):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 16, generator=generator, requires_grad=True)
    weight = (10 * torch.randn(40, 16, generator=generator)).requires_grad_()
    b = torch.randn(40, generator=generator).requires_grad_() if bias else None
    teacher = LogitHead(10 * torch.randn(40, 16, generator=generator), None, scale, softcap)
    teacher_hidden = torch.randn(7, 16, generator=generator)
    head = LogitHead(weight, b, scale, softcap)
    lean = projected_jsd_loss(hidden, head, teacher_hidden, teacher, beta=0.3, temperature=0.8, chunk_size=3)
    lean_grads = torch.autograd.grad(lean, [hidden, weight, *([b] if bias else [])])
    full = generalized_jsd_loss(
        head.logits(hidden)[None], teacher.logits(teacher_hidden)[None], beta=0.3, temperature=0.8
    ) * (1 / 7)
    full_grads = torch.autograd.grad(full, [hidden, weight, *([b] if bias else [])])
    assert torch.allclose(lean, full, rtol=1e-5)
    for got, want in zip(lean_grads, full_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
