"""Reading a teacher's output head from its safetensors without loading the model (lightning_gkd.models.head): tiny
models of real families saved with save_pretrained, single-file and sharded; the head read back equals the model's
own (output_head) and gives its logits from its final hidden states; only the head's tensors are read; classes whose
head the description cannot reproduce are refused by name."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import EntryNotFoundError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.models import head as head_module
from lightning_gkd.models.head import HeadFile, load_output_head, read_output_head
from lightning_gkd.ops.hf.heads import final_hidden_states, output_head
from lightning_gkd.toy.tiny import tiny_causal_lm

TOKENIZER = build_chatml_tokenizer()
V = len(TOKENIZER)
H = 64
SMALL = {
    "hidden_size": H,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 64,
}
#: family -> (config, the stored name of its head weight)
FAMILIES = {
    "qwen2": ({"model_type": "qwen2", **SMALL, "tie_word_embeddings": True}, "model.embed_tokens.weight"),
    "llama": ({"model_type": "llama", **SMALL, "tie_word_embeddings": False}, "lm_head.weight"),
    # soft-capped head (final_logit_softcapping 30 by default), tied
    "gemma2": ({"model_type": "gemma2", **SMALL, "tie_word_embeddings": True}, "model.embed_tokens.weight"),
}
#: family -> (config, the stored names read) for the sharded test: Phi's lm_head has a bias; GPT-NeoX's checkpoints
#: store lm_head under its legacy name embed_out (transformers 5 renames it on loading and back on saving)
MORE = {
    "phi": (
        {"model_type": "phi", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": False},
        ("lm_head.weight", "lm_head.bias"),
    ),
    "gpt_neox": (
        {"model_type": "gpt_neox", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": False},
        ("embed_out.weight",),
    ),
}


def tiny(config: dict, seed: int = 0) -> nn.Module:
    """A tiny model whose logits are large (std ~15), where Gemma's soft-cap of 30 visibly bends them."""
    model = tiny_causal_lm(config, TOKENIZER, seed=seed).eval()
    ids, mask = probe()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        model.get_output_embeddings().weight.mul_(15.0 / float(logits.std()))
    return model


def probe() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the first left-padded by 3."""
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    return ids, mask


def assert_reproduces_logits(model: nn.Module, head) -> None:
    ids, mask = probe()
    positions = mask.bool()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        got = head.logits(final_hidden_states(model, ids, mask, positions))
    expected = expected[positions].float()
    assert float(expected.abs().max()) > 20  # large enough for a soft-cap to matter
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def assert_same_head(got, want) -> None:
    assert torch.equal(got.weight, want.weight.detach())
    assert (got.bias is None) == (want.bias is None)
    if want.bias is not None:
        assert torch.equal(got.bias, want.bias.detach())
    assert (got.scale, got.softcap) == (want.scale, want.softcap)


class Recorder:
    """Wraps safe_open: every get_tensor's name, bytes and file."""

    def __init__(self, real) -> None:
        self.real = real
        self.reads: list[tuple[str, int, str]] = []

    def __call__(self, path, framework, *args, **kwargs):
        return RecordingHandle(self.real(path, framework, *args, **kwargs), self, Path(path).name)


class RecordingHandle:
    def __init__(self, inner, recorder: Recorder, file: str) -> None:
        self.inner, self.recorder, self.file = inner, recorder, file

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self.inner.get_tensor(name)
        self.recorder.reads.append((name, tensor.numel() * tensor.element_size(), self.file))
        return tensor

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    recording = Recorder(head_module.safe_open)
    monkeypatch.setattr(head_module, "safe_open", recording)
    return recording


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_head_read_from_the_folder_is_the_models_own_and_gives_its_logits(family, tmp_path):
    config, stored_name = FAMILIES[family]
    model = tiny(config)
    model.save_pretrained(tmp_path)
    head, info = read_output_head(tmp_path)
    assert_same_head(head, output_head(model))
    assert head.weight.shape == (V, H) and head.weight.dtype == torch.float32
    assert info.names == (stored_name,) and info.tied == config["tie_word_embeddings"]
    assert info.files == (str(tmp_path / "model.safetensors"),) and info.nbytes == V * H * 4
    assert info.model_class == type(model).__name__
    assert_reproduces_logits(model, head)
    if family == "gemma2":
        assert head.softcap == 30.0


@pytest.mark.parametrize("family", ["qwen2", "llama", "phi", "gpt_neox"])
def test_a_sharded_folder_gives_the_same_head_reading_only_its_tensors(family, tmp_path, recorder):
    config, names = MORE[family] if family in MORE else (FAMILIES[family][0], (FAMILIES[family][1],))
    model = tiny(config)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3
    head, info = read_output_head(tmp_path)
    assert_same_head(head, output_head(model))
    assert_reproduces_logits(model, head)
    assert [name for name, _, _ in recorder.reads] == list(names) == list(info.names)
    expected_bytes = V * H * 4 + (V * 4 if family == "phi" else 0)
    assert sum(nbytes for _, nbytes, _ in recorder.reads) == expected_bytes == info.nbytes
    assert [file for _, _, file in recorder.reads] == [weight_map[name] for name in names]
    assert [Path(file).name for file in info.files] == list(dict.fromkeys(weight_map[name] for name in names))
    assert info.summary().startswith(f"read {len(names)} tensor")


def test_from_the_hub_only_the_config_the_index_and_the_heads_shard_are_downloaded(tmp_path, monkeypatch):
    model = tiny(FAMILIES["qwen2"][0])
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    requested: list[tuple[str, str, str | None]] = []

    def fake_download(repo_id: str, filename: str, revision: str | None = None) -> str:
        requested.append((repo_id, filename, revision))
        if not (tmp_path / filename).is_file():
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(tmp_path / filename)

    monkeypatch.setattr(head_module, "hf_hub_download", fake_download)
    head = load_output_head("someone/tiny-qwen", revision="v1")
    assert_same_head(head, output_head(model))
    files = ["config.json", "model.safetensors.index.json", weight_map["model.embed_tokens.weight"]]
    assert requested == [("someone/tiny-qwen", file, "v1") for file in files]


def test_dtype_casts_the_head_and_none_keeps_the_stored_dtype(tmp_path):
    model = tiny(FAMILIES["llama"][0]).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    stored = load_output_head(tmp_path)
    assert stored.weight.dtype == torch.bfloat16 and torch.equal(stored.weight, model.lm_head.weight.detach())
    as_float = load_output_head(tmp_path, dtype="float32")
    assert as_float.weight.dtype == torch.float32 and torch.equal(as_float.weight, stored.weight.float())
    assert load_output_head(tmp_path, dtype=torch.float16).weight.dtype == torch.float16
    assert load_output_head(tmp_path, dtype="auto").weight.dtype == torch.bfloat16


def test_a_folder_without_safetensors_is_refused_saying_only_safetensors_are_read(tmp_path):
    model = tiny(FAMILIES["llama"][0])
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"neither model\.safetensors nor .*pytorch_model\.bin.*only safetensors are "):
        load_output_head(tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM's head"):
        load_output_head(tmp_path)


def test_a_missing_head_tensor_and_a_shape_the_config_does_not_give_are_refused(tmp_path):
    model = tiny(FAMILIES["llama"][0])
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"stores no LlamaForCausalLM head weight: looked for lm_head\.weight"):
        load_output_head(tmp_path)
    save_file({**weights, "lm_head.weight": weights["lm_head.weight"][:-1]}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"shape \({V - 1}, {H}\) but LlamaForCausalLM's config gives \({V}, {H}\)"):
        load_output_head(tmp_path)


def test_a_path_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        load_output_head(tmp_path / "missing")


# Classes the description cannot reproduce, registered like a user's remote-code model.


class ScaledHeadConfig(LlamaConfig):
    model_type = "lgkd_test_scaled_head"


class ScaledHeadForCausalLM(LlamaForCausalLM):
    """A learned scale between the decoder and the head: a parameter the description does not cover."""

    config_class = ScaledHeadConfig

    def __init__(self, config) -> None:
        super().__init__(config)
        self.head_gain = nn.Parameter(torch.ones(1))


class ShiftedConfig(LlamaConfig):
    model_type = "lgkd_test_shifted"


class ShiftedForCausalLM(LlamaForCausalLM):
    """A head transform no config field names: logits + 3 on the first five tokens."""

    config_class = ShiftedConfig

    @functools.wraps(LlamaForCausalLM.forward)
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits[..., :5] += 3.0
        return out


class WideOnlyConfig(LlamaConfig):
    model_type = "lgkd_test_wide_only"


class WideOnlyForCausalLM(LlamaForCausalLM):
    """A class that cannot be built small: the numeric check cannot run."""

    config_class = WideOnlyConfig

    def __init__(self, config) -> None:
        if config.hidden_size < 100:
            raise ValueError("WideOnly needs hidden_size >= 100")
        super().__init__(config)


for _config, _model in [
    (ScaledHeadConfig, ScaledHeadForCausalLM),
    (ShiftedConfig, ShiftedForCausalLM),
    (WideOnlyConfig, WideOnlyForCausalLM),
]:
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)


def saved(model_type: str, path: Path, **overrides) -> nn.Module:
    config = {**FAMILIES["llama"][0], "model_type": model_type, **overrides}
    model = tiny_causal_lm(config, TOKENIZER, seed=0)
    model.save_pretrained(path)
    return model


def test_a_head_with_parameters_outside_the_description_is_refused_naming_the_class(tmp_path):
    saved("lgkd_test_scaled_head", tmp_path)
    for check in (True, False):  # a static refusal: no check needed
        with pytest.raises(ValueError, match=r"ScaledHeadForCausalLM's head cannot be read .*head_gain.*kind=server"):
            load_output_head(tmp_path, check=check)


def test_a_head_transform_the_description_does_not_know_is_refused_unless_check_is_off(tmp_path):
    model = saved("lgkd_test_shifted", tmp_path)
    with pytest.raises(ValueError, match=r"ShiftedForCausalLM's head cannot be read .*logits are not softcap"):
        load_output_head(tmp_path)
    unchecked = load_output_head(tmp_path, check=False)  # what check=False skips: this proof
    assert torch.equal(unchecked.weight, model.lm_head.weight.detach())


def test_a_class_that_cannot_be_built_small_is_refused_suggesting_check_false(tmp_path):
    model = saved("lgkd_test_wide_only", tmp_path, hidden_size=128, head_dim=64)
    with pytest.raises(ValueError, match=r"check WideOnlyForCausalLM's head .*hidden_size >= 100.*check=False"):
        load_output_head(tmp_path)
    assert torch.equal(load_output_head(tmp_path, check=False).weight, model.lm_head.weight.detach())


def test_the_numeric_check_runs_once_per_class_and_transform(tmp_path, monkeypatch):
    monkeypatch.setattr(head_module, "_PROVEN", set())
    calls: list[str] = []
    real_check = head_module.check_output_head

    def counting(model, *args):
        calls.append(type(model).__name__)
        return real_check(model, *args)

    monkeypatch.setattr(head_module, "check_output_head", counting)
    for index, family in enumerate(["llama", "llama", "gemma2"]):
        tiny(FAMILIES[family][0], seed=index).save_pretrained(tmp_path / str(index))
        load_output_head(tmp_path / str(index))
    load_output_head(tmp_path / "0", check=False)
    assert calls == ["LlamaForCausalLM", "Gemma2ForCausalLM"]


def test_head_file_summary_is_one_log_line():
    info = HeadFile("Qwen2ForCausalLM", ("model.embed_tokens.weight",), ("/x/model.safetensors",), 2_500_000, True)
    assert info.summary() == "read 1 tensor (model.embed_tokens.weight), 2.5 MB, from model.safetensors"
