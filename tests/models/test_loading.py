import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from lightning_gkd.models.loading import freeze, load_causal_lm, resolve_dtype, shared_vocab_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm


def test_module_is_returned_as_is(student):
    assert load_causal_lm(student) is student


def test_from_config_spec_builds_the_described_model():
    spec = {
        "config": {
            "model_type": "llama",
            "vocab_size": 50,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        "init_kwargs": {"dtype": "bfloat16"},
    }
    model = load_causal_lm(spec)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.hidden_size == 32 and model.get_output_embeddings().weight.shape == (50, 32)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_local_folder_loads_through_from_pretrained_with_init_kwargs(student, tmp_path):
    student.save_pretrained(tmp_path / "student")
    spec = {
        "name_or_path": str(tmp_path / "student"),
        "init_kwargs": {"dtype": "bfloat16", "attn_implementation": "eager"},
    }
    loaded = load_causal_lm(spec)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.config._attn_implementation == "eager"
    reference = {k: v.to(torch.bfloat16) for k, v in student.state_dict().items()}
    assert all(torch.equal(v, reference[k]) for k, v in loaded.state_dict().items())


def test_hub_id_passes_init_kwargs_and_never_trusts_remote_code_by_default(monkeypatch, hub_reachable):
    calls = []
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda name, **kw: Qwen2Config())  # a text model's config
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda name, **kw: calls.append((name, kw)) or torch.nn.Linear(1, 1)
    )
    load_causal_lm({"name_or_path": "org/model", "init_kwargs": {"dtype": "float16", "revision": "v2"}})
    load_causal_lm("org/other", trust_remote_code=True)
    assert calls[0] == ("org/model", {"dtype": torch.float16, "revision": "v2", "trust_remote_code": False})
    assert calls[1] == ("org/other", {"trust_remote_code": True})


def test_missing_folder_and_bad_spec_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"teacher: model folder .*nope' does not exist"):
        load_causal_lm(str(tmp_path / "nope"), role="teacher")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['path'\]"):
        load_causal_lm({"path": "x"})
    with pytest.raises(ValueError, match="Unknown dtype 'float17'"):
        resolve_dtype("float17")


def test_freeze_makes_a_fixed_function(tokenizer):
    model = tiny_causal_lm({**TINY_STUDENT, "attention_dropout": 0.1}, tokenizer, seed=0)
    model.add_module("extra_dropout", torch.nn.Dropout(0.3))
    model.train()
    frozen = freeze(model)
    assert not frozen.training and not any(m.training for m in frozen.modules())
    assert not any(p.requires_grad for p in frozen.parameters())
    assert frozen.extra_dropout.p == 0.0
    assert all(m.attention_dropout == 0.0 for m in frozen.modules() if hasattr(m, "attention_dropout"))


def test_shared_vocab_rows_is_the_fewest_rows_and_refuses_a_model_short_of_the_tokenizer(tokenizer):
    assert len(tokenizer) == 259
    assert shared_vocab_rows(tokenizer, {"student": 264, "teacher": 272, "other": None}) == 264
    assert shared_vocab_rows(tokenizer, {"student": None}) is None
    with pytest.raises(ValueError, match="The teacher's vocabulary has 200 rows but the tokenizer .* has 259 tokens"):
        shared_vocab_rows(tokenizer, {"student": 259, "teacher": 200})


def test_disable_dropout_also_zeroes_functional_dropout_rates():
    """OPT applies dropout and layerdrop with float rates (not nn.Dropout): two train-mode forwards differ until
    disable_dropout zeroes those too."""
    from helpers.tiny_registry import build_tiny, tiny_config

    from lightning_gkd.models.loading import disable_dropout

    model = build_tiny(tiny_config("opt", 64, dropout=0.3, layerdrop=0.0), seed=0).train()
    ids = torch.randint(3, 64, (2, 10))

    def logits():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

    torch.manual_seed(0)
    assert not torch.equal(logits(), logits())
    disable_dropout(model)
    assert model.config.dropout == 0.0 and model.model.decoder.dropout == 0.0
    assert torch.equal(logits(), logits())


def test_a_mistyped_relative_folder_fails_at_once_naming_the_missing_folder(monkeypatch, tmp_path):
    """'models/studnet' is no folder here: with the hub out of reach (offline here, or HF_HUB_OFFLINE) it is refused
    in well under a second, the missing folder named first, not after the hub client's retries."""
    import time

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("lightning_gkd.models.loading.hub_reachable", lambda timeout=3.0: False)
    started = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"^student: no local folder 'models/studnet' \(relative to "):
        load_causal_lm("models/studnet", role="student")
    assert time.perf_counter() - started < 1.0


def test_the_hub_is_unreachable_under_hf_hub_offline(monkeypatch):
    from huggingface_hub import constants

    from lightning_gkd.models.loading import hub_reachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_reachable() is False


def test_source_vocab_size_reads_the_config_without_loading_weights(student, tmp_path, monkeypatch):
    from lightning_gkd.models.loading import source_vocab_size

    student.save_pretrained(tmp_path / "student")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    size = student.get_output_embeddings().weight.shape[0]
    assert source_vocab_size({"name_or_path": str(tmp_path / "student")}) == size
    assert source_vocab_size(str(tmp_path / "student")) == size
    assert source_vocab_size(student) == size
    assert source_vocab_size({"config": {"model_type": "llama", "vocab_size": 50}}) == 50
    assert source_vocab_size({"config": {"model_type": "gpt2"}}) == 50257  # the family's default
    assert source_vocab_size(str(tmp_path / "missing")) is None  # load_causal_lm names the missing folder


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_training(tokenizer, student):
    from lightning_gkd import SFTModule
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.models.loading import check_tokenizer_fits

    check_tokenizer_fits(tokenizer, len(tokenizer))  # equal: fine
    check_tokenizer_fits(tokenizer, len(tokenizer) + 100)  # a padded vocabulary: fine
    bigger = build_chatml_tokenizer()
    bigger.add_tokens(["<tool>", "</tool>", "<think>"])
    with pytest.raises(ValueError, match=r"has 262 tokens but the student's vocabulary has 259: token ids 259 and up"):
        check_tokenizer_fits(bigger, 259)
    # The module says so at construction instead of an IndexError in the sanity check.
    with pytest.raises(ValueError, match=r"has 262 tokens but the model's vocabulary has 259"):
        SFTModule(student, bigger)


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_limit_output_rows_is_the_truncated_model_and_keeps_the_parameters(family, tmp_path):
    """Across a tied head (qwen2), an untied one (llama) and a soft-capped one (gemma2): logits, the lean path's head
    and greedy decoding equal the model truncated to the rows; names, shapes and the tie stay; a save reloads."""
    from helpers.padded_vocab import pad_vocabulary, truncated_copy
    from helpers.tiny_registry import build_tiny, tiny_config

    from lightning_gkd.models.loading import limit_output_rows, vocab_size
    from lightning_gkd.ops.hf.heads import check_output_head, hidden_states_and_head

    model = pad_vocabulary(build_tiny(tiny_config(family, 64), seed=0), 80, seed=1, scale=3.0).eval()
    reference = truncated_copy(model, 70).eval()
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert limit_output_rows(model, 70) and not limit_output_rows(model, 70)
    assert vocab_size(model) == 70 and {n: p.shape for n, p in model.state_dict().items()} == shapes
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        check_output_head(model, ids, mask)  # the lean path's description holds for the limited head
        positions = torch.ones_like(ids, dtype=torch.bool)
        hidden, head = hidden_states_and_head(model, ids, mask, positions)
        assert head.weight.shape[0] == 70
        torch.testing.assert_close(head.logits(hidden), reference(input_ids=ids).logits.reshape(-1, 70))
    model.save_pretrained(tmp_path / "saved")
    assert load_causal_lm(str(tmp_path / "saved")).get_output_embeddings().weight.shape[0] == 80


def test_limit_output_rows_refuses_a_head_it_cannot_cut(student):
    from lightning_gkd.models.loading import limit_output_rows

    student.lm_head = torch.nn.Sequential(student.lm_head)
    with pytest.raises(ValueError, match="its output projection is Sequential, not a plain nn.Linear"):
        limit_output_rows(student, 200)
