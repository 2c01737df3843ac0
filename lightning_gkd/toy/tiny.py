"""Tiny offline models for the default run and the tests: a tokenizer and a student/teacher pair, written with
``save_pretrained`` so they load back through the same ``from_pretrained`` path a hub id takes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.training.checkpoint_io import write_folder_atomically

PACKAGE_ASSETS = Path(__file__).resolve().parents[1] / "assets"


def asset_path(name: str) -> str:
    """Absolute path of a shipped asset folder, e.g. ``asset_path("toy/teacher")`` (Hydra: ``${asset:toy/teacher}``)."""
    path = PACKAGE_ASSETS / name
    if not path.exists():
        available = sorted(str(p.relative_to(PACKAGE_ASSETS)) for p in PACKAGE_ASSETS.glob("*/*") if p.is_dir())
        raise FileNotFoundError(f"No packaged asset {name!r} under {PACKAGE_ASSETS}; available: {available}.")
    return str(path)


TINY_STUDENT = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
TINY_TEACHER = {
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}

# The toy task's models (scripts/train_toy_teacher.py): a 4x128 teacher and a 2x64 student (head size 32 in both).
TOY_TEACHER = {
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
TOY_STUDENT = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    # head size 32: vLLM's CPU attention (sampler=vllm) supports head sizes >= 32 only
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}

# The chain task's models (scripts/train_toy_teacher.py --task chain): the same 4x128 teacher and 2x64 student
# shapes with room for its longer rows; the student's size limits what it learns of the 20-50-token answers.
CHAIN_TEACHER = {**TOY_TEACHER, "max_position_embeddings": 128}
CHAIN_STUDENT = {**TOY_STUDENT, "max_position_embeddings": 128}
TOOLS_TEACHER = {**TOY_TEACHER, "max_position_embeddings": 160}
TOOLS_STUDENT = {**TOY_STUDENT, "max_position_embeddings": 160}
# The recovery task's (lightning_gkd.toy.recovery; scripts/train_toy_tools.py --task recovery): the tools task's
# shapes (its models are where they start), with room for transcripts with retries (208 tokens; RoPE, no new weights).
RECOVERY_TEACHER = {**TOOLS_TEACHER, "max_position_embeddings": 224}
RECOVERY_STUDENT = {**TOOLS_STUDENT, "max_position_embeddings": 224}


def tiny_causal_lm(config: Mapping[str, Any], tokenizer, *, seed: int) -> PreTrainedModel:
    """A randomly initialised causal LM over ``tokenizer``'s vocabulary, EOS/pad taken from the tokenizer."""
    spec = dict(config)
    model_type = spec.pop("model_type")
    hf_config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def write_tiny_models(
    out_dir: str | os.PathLike,
    *,
    student: Mapping[str, Any] = TINY_STUDENT,
    teacher: Mapping[str, Any] = TINY_TEACHER,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write ``tokenizer/``, ``student/`` and ``teacher/`` under ``out_dir`` (skipped if already there).

    Written to a temporary folder and renamed into place, so concurrent callers (DDP ranks) and interrupted
    writes never leave a half-written folder behind.
    """
    out = Path(out_dir).expanduser().resolve()
    if (out / "teacher" / "config.json").is_file() and not overwrite:
        return out

    def write(staging: Path) -> None:
        tokenizer = build_chatml_tokenizer()
        tokenizer.save_pretrained(staging / "tokenizer")
        tiny_causal_lm(student, tokenizer, seed=seed).save_pretrained(staging / "student")
        tiny_causal_lm(teacher, tokenizer, seed=seed + 1).save_pretrained(staging / "teacher")

    # without overwrite, another process (a DDP rank) that finished first wins
    return write_folder_atomically(out, write, replace=overwrite)
