"""SamplingSettings (lightning_gkd/samplers/settings.py): TRL's defaults, the ranges checked when made (before any model
loads) with the option named, the sampler's own checks, and the sampler built from them; the Sampler base's hooks."""

import importlib.util
from functools import partial

import pytest
import torch

from lightning_gkd.samplers import (
    KVCacheSampler,
    Sampler,
    SamplingSettings,
    SpeculativeKDSampler,
    VLLMSampler,
    build_sampler,
    sampler_class,
)


def test_the_defaults_are_trls_gkd_config():
    settings = SamplingSettings()
    assert (settings.temperature, settings.top_k, settings.top_p, settings.max_new_tokens) == (0.9, 0, 1.0, 128)
    assert settings.sampler is None and settings.engine is KVCacheSampler
    assert settings.options() == {"max_new_tokens": 128, "temperature": 0.9, "top_k": 0, "top_p": 1.0}


@pytest.mark.parametrize(
    "options, match",
    [
        ({"temperature": 0.0}, r"sampling\.temperature must be > 0, got 0\.0 \(1: the model's own distribution\)"),
        ({"temperature": -1}, r"sampling\.temperature must be > 0, got -1"),
        ({"top_k": -1}, r"sampling\.top_k must be >= 0 \(an integer; 0 disables it\), got -1"),
        ({"top_k": 2.5}, r"sampling\.top_k must be >= 0 .*got 2\.5"),
        ({"top_p": 0.0}, r"sampling\.top_p must be in \(0, 1\], got 0\.0 \(1: off\)"),
        ({"top_p": 1.5}, r"sampling\.top_p must be in \(0, 1\], got 1\.5"),
        ({"max_new_tokens": 0}, r"sampling\.max_new_tokens must be >= 1, got 0 \(an integer\)"),
        ({"max_new_tokens": 8.0}, r"sampling\.max_new_tokens must be >= 1, got 8\.0"),
        ({"max_new_tokens": True}, r"sampling\.max_new_tokens must be >= 1, got True"),
    ],
)
def test_each_range_is_checked_naming_the_option_and_its_value(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingSettings(**options)


def test_the_sampler_is_checked_when_the_settings_are_made():
    with pytest.raises(TypeError, match=r"sampling\.sampler must be a lightning_gkd\.samplers\.Sampler or a factory"):
        SamplingSettings(sampler="hf")
    with pytest.raises(ValueError, match=r"accept_top_k"):  # the factory's own options, before any model loads
        SamplingSettings(sampler=partial(SpeculativeKDSampler, accept_top_k=0))
    with pytest.raises(ValueError, match=r"sampler\.weights_dtype must be one of"):
        SamplingSettings(sampler=partial(KVCacheSampler, weights_dtype="int8"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_sampler_that_is_not_installed_is_refused_when_the_settings_are_made():
    with pytest.raises(ImportError, match=r"sampler=vllm needs vLLM, which is not installed"):
        SamplingSettings(sampler=partial(VLLMSampler, sync_every=2))


def test_the_sampler_is_built_from_the_factory_with_the_options(tokenizer):
    settings = SamplingSettings(
        temperature=1.3, top_k=5, max_new_tokens=6, sampler=partial(KVCacheSampler, matmul_precision="highest")
    )
    built = settings.build(tokenizer)
    assert isinstance(built, KVCacheSampler) and built.tokenizer is tokenizer
    assert (built.temperature, built.top_k, built.top_p, built.max_new_tokens) == (1.3, 5, 1.0, 6)
    assert built.matmul_precision == "highest"
    assert isinstance(SamplingSettings().build(tokenizer), KVCacheSampler)  # None: our KV-cache decoder
    given = KVCacheSampler(tokenizer)
    assert SamplingSettings(sampler=given).build(tokenizer) is given  # a sampler is taken as it is


def test_the_sampler_class_of_a_sampler_a_class_or_a_partial(tokenizer):
    assert sampler_class(KVCacheSampler) is KVCacheSampler
    assert sampler_class(partial(VLLMSampler, sync_every=2)) is VLLMSampler
    assert sampler_class(KVCacheSampler(tokenizer)) is KVCacheSampler
    assert sampler_class(lambda tokenizer, **options: KVCacheSampler(tokenizer, **options)) is None


class Echo(Sampler):
    """Only sample: every other hook is the base's."""

    def sample(self, model, prompts, prompt_attention_mask, *, seed, vision=None):
        return {"input_ids": prompts, "attention_mask": prompt_attention_mask, "labels": prompts}


def test_the_base_hooks_do_nothing_and_greedy_says_there_is_no_engine():
    sampler = Echo()
    prompts = torch.ones(2, 3, dtype=torch.long)
    sampler.bind_teachers({})
    sampler.start({"student": torch.nn.Linear(1, 1)}, max_model_len=8)
    sampler.weights_updated()
    sampler.close()
    assert sampler.greedy(torch.nn.Linear(1, 1), prompts, prompts, max_new_tokens=4) is None  # decode in process
    assert sampler.last_stats() == {} and sampler.sampled_logprobs_problem() is None
    Echo.check_available()
    Echo.check_settings(anything=1)
    Echo.check_teachers(object())
    with pytest.raises(TypeError, match="abstract"):
        Sampler()  # type: ignore[abstract]  # sample is the one method a sampler must have


def test_a_factory_that_makes_no_sampler_is_refused(tokenizer):
    class NotASampler:
        def __init__(self, tokenizer, **options):
            pass

        def sample(self, *args, **kwargs):
            return {}

    with pytest.raises(TypeError, match=r"must be a lightning_gkd\.samplers\.Sampler .*subclass Sampler"):
        build_sampler(NotASampler, tokenizer, max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0)
