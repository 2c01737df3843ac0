"""lightning_gkd.models.weights.hf_weights: the full weights under their Hugging Face names, one tensor at a time,
for a plain model and a LoRA model (merged on the fly, the live model untouched)."""

import pytest
import torch

from lightning_gkd.models.weights import hf_weights


def test_a_plain_model_streams_its_own_state_under_its_own_names(student):
    streamed = dict(hf_weights(student))
    state = student.state_dict()
    # every streamed tensor is the model's own (no copies); a tied head is streamed once, as the embedding
    assert set(streamed) <= set(state) and set(state) - set(streamed) <= {"lm_head.weight"}
    assert all(streamed[name].data_ptr() == state[name].data_ptr() for name in streamed)


def test_a_lora_model_streams_the_merged_weights_under_the_base_names(student):
    pytest.importorskip("peft")
    import copy

    from lightning_gkd.models.lora import apply_lora

    model = apply_lora(copy.deepcopy(student), {"r": 4, "target_modules": "all-linear"})
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    streamed = dict(hf_weights(model))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(streamed) == set(merged) - {"lm_head.weight"} or set(streamed) == set(merged)
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)
    assert not torch.equal(
        streamed["model.layers.0.self_attn.q_proj.weight"],
        student.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the live model is untouched
