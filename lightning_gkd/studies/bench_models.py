"""The benchmarks' models and rows: randomly initialised Qwen2 students and teachers of a few fixed shapes
(``BenchShape``: the bench's small pair, Qwen2.5-0.5B / 1.5B shapes, toy sizes that check a script), over the
project's byte-level ChatML tokenizer padded to the shape's vocabulary, and chat rows of a given answer length."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel


@dataclass(frozen=True)
class BenchShape:
    """Model and batch sizes of a benchmark: the student's and the teacher's Qwen2 sizes (``hidden_size``,
    ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``), the
    vocabulary, the batch, the tokens sampled on-policy, the collator's ``max_length`` and the answer length of the
    supervised (λ=0) rows."""

    name: str
    student: dict[str, int]
    teacher: dict[str, int]
    vocab: int
    batch: int
    new_tokens: int
    max_length: int
    supervised_answer: int

    def tiny(self) -> BenchShape:
        """The same code paths at toy sizes (a script's check, not a speed measurement): 1-layer models, vocabulary
        512, 8 new tokens; batch and ``max_length`` kept."""
        heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
        student = {**self.student, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, **heads}
        teacher = {**self.teacher, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, **heads}
        return replace(self, student=student, teacher=teacher, vocab=512, new_tokens=8, supervised_answer=8)

    def with_vocab(self, vocab: int) -> BenchShape:
        return replace(self, vocab=vocab)


def qwen2_sizes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict[str, int]:
    """A Qwen2 config's sizes."""
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }


#: the side-by-side bench's pair (student 4 x 256, teacher 6 x 512, vocabulary 32000), batch 8, 64 sampled tokens
SMALL = BenchShape(
    "small",
    student=qwen2_sizes(256, 768, 4, 4, 2),
    teacher=qwen2_sizes(512, 1536, 6, 8, 4),
    vocab=32000,
    batch=8,
    new_tokens=64,
    max_length=256,
    supervised_answer=64,
)
#: Qwen2.5-0.5B's (24 x 896) and Qwen2.5-1.5B's (28 x 1536) shapes, vocabulary 151936, batch 2, 32 sampled tokens,
#: 512-token supervised answers
REAL = BenchShape(
    "real",
    student=qwen2_sizes(896, 4864, 24, 14, 2),
    teacher=qwen2_sizes(1536, 8960, 28, 12, 2),
    vocab=151936,
    batch=2,
    new_tokens=32,
    max_length=640,
    supervised_answer=512,
)
SHAPES = {"small": SMALL, "real": REAL}


def bench_shape(name: str, *, tiny: bool = False) -> BenchShape:
    """``SHAPES[name]``, at toy sizes with ``tiny``."""
    if name not in SHAPES:
        raise ValueError(f"Unknown bench shape {name!r}; use one of {sorted(SHAPES)}.")
    return SHAPES[name].tiny() if tiny else SHAPES[name]


def bench_rows(count: int, answer_tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    """Chat rows with a ~40-character prompt and an answer of ``answer_tokens`` characters (one token per byte with
    the ChatML byte tokenizer), words drawn from a fixed list with ``seed``."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta", "lambda", "zeta"]

    def text(chars: int) -> str:
        out = ""
        while len(out) < chars:
            out += rng.choice(words) + " "
        return out[:chars].strip()

    return [
        {
            "messages": [
                {"role": "user", "content": "Continue: " + text(30)},
                {"role": "assistant", "content": text(answer_tokens)},
            ]
        }
        for _ in range(count)
    ]


def build_model(sizes: dict[str, int], vocab: int, tokenizer: Any, seed: int) -> PreTrainedModel:
    """A randomly initialised (``seed``) float32 Qwen2 of ``sizes`` over ``vocab`` tokens, tied embeddings, the
    tokenizer's EOS and pad ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **sizes,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build_models(shape: BenchShape, tokenizer: Any) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The shape's student (seed 0) and teacher (seed 1)."""
    return build_model(shape.student, shape.vocab, tokenizer, 0), build_model(shape.teacher, shape.vocab, tokenizer, 1)
