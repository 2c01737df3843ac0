"""What the user sees: progress-bar metrics, the sample table, the TensorBoard logger, the final summary."""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers.fitting import small_trainer
from helpers.hydra_compose import FAST, compose_train

from lightning_gkd import ChatDataModule, DPOModule, GKDModule, PreferenceDataModule
from lightning_gkd.callbacks.sample_table import SampleTable, top1_agreement
from lightning_gkd.cli.train import run
from lightning_gkd.ops.decoding.sampling import completion_batch, position_ids_from_mask
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.preference import addition_preference_rows


def test_top1_agreement_counts_completion_positions_only(student, teacher):
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    batch = completion_batch(
        prompts, torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([[10, 11, 2], [12, 2, 0]]), eos_token_id=2
    )
    assert top1_agreement(student, copy.deepcopy(student), batch).tolist() == [1.0, 1.0]
    kwargs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "position_ids": position_ids_from_mask(batch["attention_mask"]),
    }
    ours = student(**kwargs).logits[:, :-1].argmax(-1)
    theirs = teacher(**kwargs).logits[:, :-1].argmax(-1)
    positions = batch["labels"][:, 1:] != -100  # row 0: 3 completion tokens, row 1: 2 (then padding)
    assert positions.sum(dim=1).tolist() == [3, 2]
    expected = [((ours[i] == theirs[i]) & positions[i]).sum().item() / positions[i].sum().item() for i in range(2)]
    assert top1_agreement(student, teacher, batch).tolist() == pytest.approx(expected)
    student.train()
    top1_agreement(student, teacher, batch)  # runs the student in eval mode, then gives its train mode back
    assert all(m.training for m in student.modules())


def test_sample_table_and_progress_bar_metrics_during_a_fit(student, teacher, tokenizer, toy_rows, tmp_path, capsys):
    table = SampleTable(every_n_steps=2, num_samples=3, max_new_tokens=5)
    module = GKDModule(
        student,
        teacher,
        tokenizer,
        lmbda=0.5,
        sampling={"max_new_tokens": 4},
        training={"optimizer": partial(torch.optim.AdamW, lr=1e-3)},
    )
    trainer = small_trainer(
        tmp_path,
        csv=True,
        max_steps=4,
        limit_val_batches=1,
        val_check_interval=4,
        enable_progress_bar=True,  # the bar that shows the progress-bar metrics
        callbacks=[table],
    )
    trainer.fit(module, datamodule=ChatDataModule(tokenizer, toy_rows["train"], toy_rows["val"], batch_size=4))

    assert {"train/loss", "train/on_policy_fraction", "train/tokens_per_sec"} <= set(trainer.progress_bar_metrics)
    assert trainer.progress_bar_metrics["train/tokens_per_sec"] > 0
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 2, 2, 4, 4, 4] and records == table.history
    first_prompt = toy_rows["val"][0]["messages"][0]["content"]
    assert first_prompt in records[0]["prompt"] and all(0.0 <= r["agreement"] <= 1.0 for r in records)
    out = capsys.readouterr().out
    assert "Samples at step 2 (greedy)" in out and "Samples at step 4 (greedy)" in out
    assert "top-1 agreement with teacher" in out and first_prompt in out
    with open(tmp_path / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    logged = {int(r["step"]): float(r["samples/top1_agreement"]) for r in rows if r.get("samples/top1_agreement")}
    assert logged[2] == pytest.approx(sum(r["agreement"] for r in records[:3]) / 3)
    assert sum(float(r["train/on_policy"]) for r in rows if r.get("train/on_policy")) / 4 == pytest.approx(
        [float(r["train/on_policy_fraction"]) for r in rows if r.get("train/on_policy_fraction")][-1]
    )
    assert module.trained_tokens > 0 and module.tokens_per_second() > 0


def test_sample_table_compares_dpo_against_its_reference(student, tokenizer, tmp_path, capsys):
    table = SampleTable(every_n_steps=1, num_samples=2, max_new_tokens=3)
    module = DPOModule(student, tokenizer, reference=copy.deepcopy(student))
    trainer = small_trainer(tmp_path, max_steps=1, callbacks=[table])
    trainer.fit(module, datamodule=PreferenceDataModule(tokenizer, addition_preference_rows("train", 8), batch_size=2))
    assert len(table.history) == 2 and "top-1 agreement with reference" in capsys.readouterr().out


def test_default_run_prints_the_sample_table_progress_lines_and_the_summary(debug_run):
    result, out = debug_run.result, debug_run.stdout
    # the config as one line (the overrides, where the whole config is), not a tree of every value
    assert re.search(
        r"^config: .*experiment=debug logger=\[csv,tensorboard\].*\(print_config=true prints it\)$", out, re.M
    )
    assert "print_config=true prints it" in out and "├── " not in out  # no rich tree
    assert "Samples at step 2 (greedy)" in out and "Samples at step 4 (greedy)" in out
    # stdout is no terminal here (as in a SLURM log): a line per logged step (log_every_n_steps=1), the
    # learning rate among its metrics, and one per validation
    train_lines = re.findall(r"^step (\d)/4 \((\d+)%\) \| .* elapsed, .* left \| train/loss=\S+ train/lr=", out, re.M)
    assert train_lines == [("1", "25"), ("2", "50"), ("3", "75"), ("4", "100")]
    assert re.findall(r"^step (\d)/4 validation \| val/loss=\S+ val/accuracy=", out, re.M) == ["2", "4"]
    summary = out[out.index("== lightning_gkd summary ==") :]
    assert (
        f"steps: 4  fit time: {result['fit_seconds']:.1f}s  throughput: {result['tokens_per_sec']:.0f} tokens/s"
        f" ({result['trained_tokens']} completion tokens trained)" in summary
    )
    assert summary.index("train/loss:") < summary.index("train/on_policy_fraction:")  # losses first
    # the last batch's 0/1 coin (train/on_policy) and the schedule's last rate are no results
    assert "train/on_policy:" not in summary and "train/lr" not in summary
    assert "held-out accuracy (student after)" in summary
    # callbacks.best_model: the best validation and the start it is compared with
    best = result["best_model"]
    assert f"best validation: {best['value']:.4f} at step {best['step']} (start {best['start']:.4f})" in summary
    assert f"trained model exported to: {debug_run.run_dir / 'student'}" in summary
    assert result["trained_tokens"] > 0 and (debug_run.run_dir / "samples.jsonl").is_file()
    with open(debug_run.run_dir / "logs" / "metrics.csv") as handle:
        rates = [float(row["train/lr"]) for row in csv.DictReader(handle) if row.get("train/lr")]
    # experiment=debug: cosine with 20 warmup steps (of 4): 0, then lr/20 more each step
    assert rates == pytest.approx([0.0, 5e-5, 1e-4, 1.5e-4])


def test_a_run_shorter_than_val_check_interval_still_validates_and_checkpoints_at_its_end(tmp_path, capsys):
    overrides = [*FAST, "model=tiny", "trainer.val_check_interval=50", "data.val_batch_size=8", "export=false"]
    overrides += ["callbacks.held_out_eval=null", "callbacks.sample_table=null"]
    result = run(compose_train(tmp_path, overrides))
    out = capsys.readouterr().out
    assert (
        "trainer.val_check_interval=50 is more than trainer.max_steps=3: validating (and checkpointing) at step 3 "
        "instead." in out
    )
    assert "val/loss" in result["metrics"] and re.search(r"^step 3/3 validation \| val/loss=", out, re.M)
    with open(tmp_path / "run" / "logs" / "metrics.csv") as handle:
        assert [row["val/loss"] for row in csv.DictReader(handle) if row.get("val/loss")]
    assert (tmp_path / "run" / "checkpoints" / "step3.ckpt").is_file()


# What a default run printed before (each from a run of `lightning-gkd` on a log file): Lightning's _pytree
# deprecation, its eval-mode warning for the teacher, its litlogger/litmodels tips, its log_every_n_steps warning
# for a short epoch, datasets' and transformers' progress bars.
SILENCED = (
    "LeafSpec",
    "module(s) in eval mode",
    "💡 Tip",
    "smaller than the logging interval",
    "Generating train split",
    "Loading weights",
    "Writing model shards",
)


@pytest.mark.slow
def test_a_run_on_a_log_file_prints_no_expected_noise(tmp_path):
    rows = addition_rows("train", 8)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "lightning-gkd"),
            "model=tiny",
            "data=chat_files",
            f"data.train_data={data}",
            f"data.val_data={data}",
            "data.batch_size=4",  # an epoch of 2 steps, shorter than log_every_n_steps (4 after the clamp)
            "trainer.max_steps=4",
            "trainer.limit_val_batches=1",
            "method.sampling.max_new_tokens=4",
            "print_config=false",
            "callbacks.sample_table=null",
            f"paths.cache_dir={tmp_path}/c",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert [message for message in SILENCED if message in printed] == []
    assert "step 4/4 (100%)" in result.stdout and "step 4/4 validation | val/loss=" in result.stdout
    assert "GPU available: False, used: False" in printed  # Lightning's other information stays


def test_tensorboard_logger_from_config(debug_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = debug_run.run_dir / "tensorboard"  # logger=[csv,tensorboard]
    assert list(folder.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(folder)).Reload()
    assert {"train/loss", "train/tokens_per_sec", "val/loss", "samples/top1_agreement"} <= set(events.Tags()["scalars"])
    assert "samples/text_summary" in events.Tags()["tensors"]
    text = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| prompt | completion | top-1 agreement with teacher |" in text


def test_table_cells_keep_blank_completions_visible_and_prompts_end_first():
    from lightning_gkd.callbacks.sample_table import _clip, _completion_cell

    assert _completion_cell("\n\n", 10) == "⏎⏎" and _completion_cell("", 10) == "(empty)"
    assert _completion_cell("abcdefghijkl", 6) == "abcde…"
    assert _clip("user\n123+456=\nassistant\n", 12, keep_end=True) == "…= assistant"


@pytest.mark.parametrize("full_error", [False, True])
def test_a_failed_run_prints_its_message_alone_and_the_traceback_on_request(tmp_path, full_error):
    """A missing data file: the one-line message and how to see the traceback, exit status 1; with HYDRA_FULL_ERROR=1
    Hydra's traceback as before."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1" if full_error else "0"}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_gkd.cli.train", "data.train_data=missing.jsonl", "print_config=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 1
    message = "train_data: data file 'missing.jsonl' does not exist."
    assert message in result.stderr
    assert ("Traceback" in result.stderr) == full_error
    if not full_error:
        assert (
            f"Error: FileNotFoundError: {message}\n(the traceback: run the command again with HYDRA_FULL_ERROR=1)"
            in (result.stderr)
        )
