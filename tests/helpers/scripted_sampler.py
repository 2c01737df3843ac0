"""A sampler that writes scripted assistant turns, so rollouts can be tested on exact transcripts: each row's turns
are looked up by the row's user message, and the turn index is the number of assistant turns already in the
context. A ``Sampler`` (with ``greedy``); the model is only used for its device."""

from __future__ import annotations

import torch

from lightning_gkd.ops.decoding.sampling import completion_batch
from lightning_gkd.samplers import Sampler


class ScriptedSampler(Sampler):
    def __init__(self, tokenizer, script: dict[str, list[str]], *, logprob: float = -0.5) -> None:
        self.tokenizer, self.script, self.logprob = tokenizer, script, logprob
        self.calls: list[int] = []  # rows per sample call

    def _turn_ids(self, context: list[int]) -> list[int]:
        text = self.tokenizer.decode(context)
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        turn = text.count("<|im_start|>assistant\n") - 1
        turns = self.script[user]
        written = turns[turn] if turn < len(turns) else turns[-1]
        ids = self.tokenizer(written, add_special_tokens=False)["input_ids"]
        return ids + ([self.tokenizer.eos_token_id] if not written.endswith("...") else [])

    def sample(
        self, model, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, seed: int, vision=None
    ) -> dict:
        self.calls.append(prompts.shape[0])
        turns = [
            self._turn_ids(row[mask.bool()].tolist()) for row, mask in zip(prompts, prompt_attention_mask, strict=True)
        ]
        width = max(len(t) for t in turns)
        pad = self.tokenizer.pad_token_id
        completion = torch.tensor([t + [pad] * (width - len(t)) for t in turns])
        logprobs = torch.full(completion.shape, self.logprob)
        return completion_batch(prompts, prompt_attention_mask, completion, self.tokenizer.eos_token_id, logprobs)

    def greedy(self, model, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, max_new_tokens: int):
        return self.sample(model, prompts, prompt_attention_mask, seed=0)
