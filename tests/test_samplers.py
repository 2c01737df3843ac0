"""lightning_gkd.samplers: the Sampler protocol, the default KV-cache sampler, and a user's sampler driving a GKD
fit through a plain Lightning Trainer."""

import pytest
import torch
from test_methods_gkd import fit, logged, make_module

from lightning_gkd.ops.hf import resolve_eos_token_id
from lightning_gkd.ops.sampling import generate_completions
from lightning_gkd.samplers import KVCacheSampler, Sampler


def test_kv_cache_sampler_is_the_seeded_kv_cache_decoder(student, tokenizer):
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    sampler = KVCacheSampler(tokenizer, max_new_tokens=5, temperature=0.7, top_k=3)
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


@pytest.mark.parametrize(
    "kwargs, message", [({"temperature": 0.0}, "temperature must be > 0"), ({"top_p": 0}, "top_p")]
)
def test_kv_cache_sampler_checks_its_options(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheSampler(tokenizer, **kwargs)


class EchoPromptSampler:
    """A stand-in engine: 'samples' the prompt's last two tokens then EOS, and records each call."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos, self.calls = eos_token_id, []

    def sample(self, model, prompts, prompt_attention_mask, *, seed):
        self.calls.append((model, prompts.shape[0], seed))
        completion = torch.cat([prompts[:, -2:], torch.full((prompts.shape[0], 1), self.eos)], dim=1)
        ids = torch.cat([prompts, completion], dim=1)
        mask = torch.cat([prompt_attention_mask, torch.ones_like(completion)], dim=1)
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, : prompts.shape[1]] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_a_custom_sampler_drives_every_on_policy_step(student, teacher, tokenizer, toy_rows, tmp_path):
    sampler = EchoPromptSampler(tokenizer.eos_token_id)
    module = make_module(student, teacher, tokenizer, lmbda=1.0, sampler=sampler)
    fit(module, tokenizer, toy_rows, tmp_path, max_steps=3)
    assert [(model is module.student, rows) for model, rows, _ in sampler.calls] == [(True, 4)] * 3
    assert len({seed for _, _, seed in sampler.calls}) == 3  # a fresh seed per step
    assert logged(tmp_path, "train/completion_length") == [3.0] * 3  # two echoed tokens + EOS, every step
    assert module.sampling_calls == 3 and "sampler" not in module.hparams
