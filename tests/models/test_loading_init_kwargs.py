"""TRL's ``teacher_model_init_kwargs`` as our teacher spec's ``init_kwargs``: each kwarg reaches
``from_pretrained``, and, unlike TRL (which indexes ``kwargs["dtype"]``), no ``dtype`` key is required."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config

from lightning_gkd import GKDModule


@pytest.fixture()
def teacher_dir(teacher, tmp_path):
    teacher.save_pretrained(tmp_path / "teacher")
    return tmp_path / "teacher"


def dtypes(model):
    return {p.dtype for p in model.parameters()}


@pytest.mark.parametrize(
    "init_kwargs, expected",
    [
        ({}, torch.float32),  # dtype absent: TRL raises KeyError here
        ({"dtype": "auto"}, torch.float32),  # the dtype the folder was saved in
        ({"dtype": "bfloat16"}, torch.bfloat16),
        ({"dtype": "torch.bfloat16"}, torch.bfloat16),
        ({"attn_implementation": "eager"}, torch.float32),
        ({"revision": "main"}, torch.float32),  # ignored for a local folder, as from_pretrained does
    ],
)
def test_local_teacher_folder_with_each_init_kwarg(student, teacher, teacher_dir, tokenizer, init_kwargs, expected):
    module = GKDModule(student, {"name_or_path": str(teacher_dir), "init_kwargs": init_kwargs}, tokenizer)
    assert dtypes(module.teacher) == {expected}
    assert not module.teacher.training and not any(p.requires_grad for p in module.teacher.parameters())
    if "attn_implementation" in init_kwargs:
        assert module.teacher.config._attn_implementation == "eager"
    reference = {k: v.to(expected) for k, v in teacher.state_dict().items()}
    assert all(torch.equal(v, reference[k]) for k, v in module.teacher.state_dict().items())


def test_auto_dtype_keeps_a_bfloat16_folder_in_bfloat16(student, teacher, tmp_path, tokenizer):
    teacher.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    module = GKDModule(student, {"name_or_path": str(tmp_path / "bf16"), "init_kwargs": {"dtype": "auto"}}, tokenizer)
    assert dtypes(module.teacher) == {torch.bfloat16}


def test_quantization_config_mapping_reaches_from_pretrained(student, teacher, tokenizer, monkeypatch, hub_reachable):
    calls = []

    def fake_from_pretrained(name, **kwargs):
        calls.append((name, kwargs))
        return teacher

    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda name, **kw: Qwen2Config())  # a text model's config
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    spec = {
        "name_or_path": "org/teacher",
        "init_kwargs": {"quantization_config": {"load_in_8bit": True}, "revision": "v1", "attn_implementation": "sdpa"},
    }
    GKDModule(student, spec, tokenizer)
    ((name, kwargs),) = calls
    assert name == "org/teacher" and "dtype" not in kwargs
    assert isinstance(kwargs["quantization_config"], BitsAndBytesConfig)
    assert kwargs["quantization_config"].load_in_8bit is True
    assert (kwargs["revision"], kwargs["attn_implementation"], kwargs["trust_remote_code"]) == ("v1", "sdpa", False)


def test_unknown_dtype_names_the_value(student, teacher_dir, tokenizer):
    with pytest.raises(ValueError, match="Unknown dtype 'bf17'"):
        GKDModule(student, {"name_or_path": str(teacher_dir), "init_kwargs": {"dtype": "bf17"}}, tokenizer)
