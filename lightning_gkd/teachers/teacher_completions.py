"""Offline sequence-level KD: the teacher writes the completions once, before the cache is built over them.

``lightning-gkd-cache cache.completions=teacher`` replaces every training row's answer by the teacher's own
completion of its prompt (``teacher_completion_rows``, our KV-cache sampler; greedy at ``temperature`` 0) and writes
them to ``<cache>/completions.jsonl`` (chat rows); the cache is then built over those rows, and training reads the
same file (``data.train_data=<cache>/completions.jsonl``) with ``teacher=cache``: SeqKD with no teacher model in the
training process. ``completions.json`` records the settings; a rerun with the same ones reuses the file (so each
rank of a multi-process build, and a resumed build, reads the same completions), other settings are refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.ops.hf import resolve_eos_token_id, resolve_pad_token_id
from lightning_gkd.ops.sampling import derive_seed, generate_completions

COMPLETIONS_FILE = "completions.jsonl"
SETTINGS_FILE = "completions.json"


def teacher_completion_rows(
    teacher: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 32,
) -> list[dict[str, Any]]:
    """``rows`` (chat rows) with the final assistant message (if any) replaced by ``teacher``'s completion of the
    prompt: at most ``max_new_tokens`` tokens, greedy at ``temperature`` 0, else sampled (seeded per batch by
    ``seed``). Other columns are kept."""
    collate = ChatMLCollator(tokenizer, max_length=max_length, name="train_data")
    eos, pad = resolve_eos_token_id(teacher, tokenizer), resolve_pad_token_id(tokenizer)
    device = next(teacher.parameters()).device
    out: list[dict[str, Any]] = []
    for start in range(0, len(rows), batch_size):
        part = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
        batch = collate(part)
        sampled = generate_completions(
            teacher,
            batch["prompts"].to(device),
            batch["prompt_attention_mask"].to(device),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=eos,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else 1.0,
            seed=derive_seed(seed, start),
        )
        width = batch["prompts"].shape[1]
        for row, ids, labels in zip(part, sampled["input_ids"], sampled["labels"], strict=True):
            completion = ids[width:][labels[width:] != -100]
            text = tokenizer.decode(completion.tolist(), skip_special_tokens=True)
            messages = list(row["messages"])
            if messages and messages[-1].get("role") == "assistant":
                messages = messages[:-1]
            out.append({**row, "messages": [*messages, {"role": "assistant", "content": text}]})
    return out


def cached_teacher_completions(folder: str | Path, settings: Mapping[str, Any], make: Any) -> Path:
    """``<folder>/completions.jsonl``: written by ``make()`` (the rows) unless it exists with these ``settings``;
    another run's settings raise ``ValueError`` naming both."""
    folder = Path(folder)
    path, recorded = folder / COMPLETIONS_FILE, folder / SETTINGS_FILE
    if recorded.is_file() and path.is_file():
        before = json.loads(recorded.read_text())
        if before != dict(settings):
            changed = {
                k: (before.get(k), settings.get(k)) for k in {*before, *settings} if before.get(k) != settings.get(k)
            }
            raise ValueError(
                f"{path} holds teacher completions made with other settings ({changed}: there, now). Use another "
                "cache.path, or delete the folder to remake them."
            )
        return path
    folder.mkdir(parents=True, exist_ok=True)
    rows = make()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
    os.replace(tmp, path)
    recorded.write_text(json.dumps(dict(settings), indent=2, sort_keys=True) + "\n")
    return path
