"""SampleTable: every N steps, show what the trained model writes for a few fixed prompts, and how often its top-1
next token agrees with its teacher's there."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_gkd.evaluation.metrics import decode_until_eos
from lightning_gkd.methods.base import require_lm_module
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.sampling import generate_completions
from lightning_gkd.ops.hf.forward import eval_mode, resolve_eos_token_id, resolve_pad_token_id
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits

_COMPARED = ("teacher", "reference")  # the frozen model the table compares against, first one the module has


class SampleTable(L.Callback):
    """Every ``every_n_steps`` optimizer steps, greedily complete the first ``num_samples`` prompts of the
    validation data (else the training data) with the trained model, and report for each: the prompt, the
    completion, and the teacher–student top-1 agreement on it (the fraction of completion positions where the
    teacher's most likely next token equals the student's; "reference" instead of "teacher" for DPO; no column
    when the module has neither).

    Reported as a table on the console, as JSON lines appended to ``<default_root_dir>/samples.jsonl``, as text in
    TensorBoard (``add_text``) or a table in loggers with ``log_text`` (W&B), and the mean agreement as the metric
    ``samples/top1_agreement``. Every rank generates (sharded models need all ranks); rank zero reports.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        num_samples: int = 4,
        max_new_tokens: int = 32,
        max_chars: int = 60,
        filename: str = "samples.jsonl",
    ) -> None:
        if every_n_steps < 1 or num_samples < 1 or max_new_tokens < 1:
            raise ValueError(
                "every_n_steps, num_samples and max_new_tokens must be >= 1, got "
                f"{every_n_steps}, {num_samples}, {max_new_tokens}."
            )
        self.every_n_steps, self.num_samples, self.max_new_tokens = every_n_steps, num_samples, max_new_tokens
        self.max_chars, self.filename = max_chars, filename
        self.history: list[dict[str, Any]] = []  # every reported sample, as written to samples.jsonl
        self._batch: dict[str, torch.Tensor] | None = None
        self._disabled = False
        self._last_step = -1

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._disabled or step == 0 or step == self._last_step or step % self.every_n_steps:
            return
        self._last_step = step
        prompts = self._prompts(trainer)
        if prompts is None:
            return
        rows = self.sample(pl_module, move_data_to_device(prompts, pl_module.device))
        if trainer.is_global_zero:
            self._report(trainer, step, rows)

    def _prompts(self, trainer: L.Trainer) -> dict[str, torch.Tensor] | None:
        if self._batch is None:
            batch = _first_batch(trainer)
            if batch is None or "prompts" not in batch or "prompt_attention_mask" not in batch:
                rank_zero_info("SampleTable: the data yields no 'prompts'/'prompt_attention_mask'; no sample table.")
                self._disabled = True
                return None
            k = self.num_samples
            self._batch = {"prompts": batch["prompts"][:k], "prompt_attention_mask": batch["prompt_attention_mask"][:k]}
            if batch.get("vision") is not None:  # the prompts' images
                self._batch["vision"] = batch["vision"][:k]
        return self._batch

    @torch.no_grad()
    def sample(self, pl_module: L.LightningModule, prompts: Mapping[str, Any]) -> list[dict[str, Any]]:
        """``[{"prompt", "completion", "agreement"}]`` for the prompts (agreement None without a teacher)."""
        module = require_lm_module(pl_module, type(self).__name__)
        model, tokenizer = module.model, module.tokenizer
        eos = resolve_eos_token_id(model, tokenizer)
        ids, mask = prompts["prompts"], prompts["prompt_attention_mask"]
        pad = resolve_pad_token_id(tokenizer)
        full = generate_completions(
            model,
            ids,
            mask,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=eos,
            do_sample=False,
            vision=prompts.get("vision"),
        )
        completions = decode_until_eos(tokenizer, full["input_ids"][:, ids.shape[1] :].tolist(), eos)
        compared = next((getattr(pl_module, name) for name in _COMPARED if hasattr(pl_module, name)), None)
        agreement: list[float | None] = [None] * len(completions)
        if isinstance(compared, nn.Module):
            agreement = top1_agreement(model, compared, full).tolist()
        return [
            {
                "prompt": tokenizer.decode(row[row_mask.bool()].tolist(), skip_special_tokens=True),
                "completion": completion,
                "agreement": agree,
            }
            for row, row_mask, completion, agree in zip(ids, mask, completions, agreement, strict=True)
        ]

    def _report(self, trainer: L.Trainer, step: int, rows: list[dict[str, Any]]) -> None:
        pl_module = trainer.lightning_module
        compared = next((name for name in _COMPARED if hasattr(pl_module, name)), None)
        records = [{"step": step, **row} for row in rows]
        self.history += records
        out = Path(trainer.default_root_dir) / self.filename
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as file:
            file.writelines(json.dumps(record) + "\n" for record in records)
        _print_table(step, rows, compared, self.max_chars)
        agreements = [row["agreement"] for row in rows if row["agreement"] is not None]
        for logger in trainer.loggers:
            if agreements:
                logger.log_metrics({"samples/top1_agreement": sum(agreements) / len(agreements)}, step=step)
            add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
            log_text = getattr(logger, "log_text", None)
            if callable(add_text):  # TensorBoard
                add_text("samples", _markdown(rows, compared), global_step=step)
            elif callable(log_text):  # W&B
                log_text(
                    key="samples",
                    columns=["prompt", "completion", "agreement"],
                    data=[[r["prompt"], r["completion"], r["agreement"]] for r in rows],
                    step=step,
                )


@torch.no_grad()
def top1_agreement(model: nn.Module, compared: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per row ``(B,)``: the fraction of completion positions (labels != -100) where the argmax of ``compared``'s
    next-token logits equals ``model``'s (0 for a row without completion tokens)."""
    with eval_mode(model):
        ours = causal_lm_logits(model, batch)[:, :-1].argmax(dim=-1)
    theirs = causal_lm_logits(compared, batch)[:, :-1].argmax(dim=-1)
    positions = batch["labels"][:, 1:] != IGNORE_INDEX
    agree = ((ours == theirs) & positions).sum(dim=1)
    return (agree.float() / positions.sum(dim=1).clamp(min=1)).cpu()


def _first_batch(trainer: L.Trainer) -> dict[str, torch.Tensor] | None:
    datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
    loaders = []
    if datamodule is not None:
        loaders = [datamodule.val_dataloader(), datamodule.train_dataloader()]
    else:
        loaders = [trainer.train_dataloader]
    for loader in loaders:
        if isinstance(loader, (list, tuple)):
            loader = loader[0] if loader else None
        if loader is not None:
            batch = next(iter(loader), None)
            if isinstance(batch, Mapping):
                return dict(batch)
    return None


def _clip(text: str, limit: int, *, keep_end: bool = False) -> str:
    """``text`` on one line, at most ``limit`` characters: its start, or its end (a prompt ends in the question)."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    return "…" + flat[-(limit - 1) :] if keep_end else flat[: limit - 1] + "…"


def _completion_cell(text: str, limit: int) -> str:
    # newlines shown, not collapsed: a completion of blank lines must not look empty
    return _clip(text.replace("\n", "⏎"), limit) or "(empty)"


def _print_table(step: int, rows: list[dict[str, Any]], compared: str | None, max_chars: int) -> None:
    import rich
    from rich.table import Table

    table = Table(title=f"Samples at step {step} (greedy)", title_justify="left")
    table.add_column("prompt", overflow="fold")
    table.add_column("completion", overflow="fold")
    if compared:
        table.add_column(f"top-1 agreement with {compared}", justify="right")
    for row in rows:
        cells = [_clip(row["prompt"], max_chars, keep_end=True), _completion_cell(row["completion"], max_chars)]
        if compared:
            cells.append("-" if row["agreement"] is None else f"{row['agreement']:.2f}")
        table.add_row(*cells)
    rich.get_console().print(table)


def _markdown(rows: list[dict[str, Any]], compared: str | None) -> str:
    header = "| prompt | completion |" + (f" top-1 agreement with {compared} |" if compared else "")
    lines = [header, "|---|---|" + ("---|" if compared else "")]
    for row in rows:
        cells = [
            _clip(row["prompt"], 200, keep_end=True).replace("|", "\\|"),
            _completion_cell(row["completion"], 200).replace("|", "\\|"),
        ]
        if compared:
            cells.append("-" if row["agreement"] is None else f"{row['agreement']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
