"""LengthGuard: the student's and the teacher's greedy completion lengths and EOS rates at validation, logged and
checked, on real fits of tiny models; a warning (and with stop=True a checkpoint and a stop) on a synthetic collapse,
nothing on a run whose student is its teacher."""

from __future__ import annotations

import copy
import csv
import json
import logging
import subprocess
import sys
from functools import partial

import pytest
import torch
from helpers.eos_boost import boost_eos
from helpers.fitting import small_trainer, with_group_defaults
from helpers.hydra_compose import compose_train
from helpers.launch import TIMEOUT, clean_env
from helpers.paths import TESTS

import lightning_gkd.callbacks.length_guard as length_guard
import lightning_gkd.methods.base as base
from lightning_gkd import ChatDataModule, GKDModule, OPDModule, SFTModule
from lightning_gkd.callbacks import LengthGuard
from lightning_gkd.cli.train import run
from lightning_gkd.evaluation.metrics import CompletionLengths
from lightning_gkd.ops.decoding.sampling import generate_completions
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm
from lightning_gkd.training.checkpoint_io import SafeCheckpointIO

FIGURES = ("val/length/student", "val/length/teacher", "val/eos_rate/student", "val/eos_rate/teacher")
BUDGET = 8  # validation.max_new_tokens


def make_module(student, teacher, tokenizer, method=GKDModule, **kwargs):
    if method is GKDModule:
        kwargs.setdefault("lmbda", 1.0)
    defaults = with_group_defaults(
        kwargs,
        sampling={"max_new_tokens": 4},
        training={"optimizer": partial(torch.optim.SGD, lr=0.0)},
        validation={"max_new_tokens": BUDGET},
    )
    return method(student, teacher, tokenizer, **defaults)


def fit(module, tokenizer, rows, tmp_path, callbacks, *, max_steps=4, limit_val_batches=2, ckpt_path=None):
    datamodule = ChatDataModule(tokenizer, rows["train"], rows["val"], batch_size=4, max_length=64)
    trainer = small_trainer(
        tmp_path,
        csv=True,
        max_steps=max_steps,
        val_check_interval=2,
        limit_val_batches=limit_val_batches,
        num_sanity_val_steps=1,
        enable_checkpointing=True,  # a ModelCheckpoint, as in a run: LengthGuard(stop=True) saves into its folder
        plugins=[SafeCheckpointIO()],
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def logged(tmp_path, key):
    with open(tmp_path / "metrics.csv") as handle:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(handle) if row.get(key)]


def by_hand(model, tokenizer, batches, eos: int) -> tuple[float, float]:
    """Mean completion tokens (EOS included) and the share of rows with an EOS, counted token by token."""
    tokens = rows = stopped = 0
    for batch in batches:
        prompts = batch["prompts"]
        out = generate_completions(
            model,
            prompts,
            batch["prompt_attention_mask"],
            max_new_tokens=BUDGET,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
            do_sample=False,
        )
        for row in out["input_ids"][:, prompts.shape[1] :].tolist():
            rows += 1
            if eos in row:
                tokens += row.index(eos) + 1
                stopped += 1
            else:
                tokens += BUDGET  # a row without EOS runs to the budget
    return tokens / rows, stopped / rows


# -- the figures ---------------------------------------------------------------------------------------------------


def test_figures_match_a_hand_count_and_the_teacher_is_measured_once(student, teacher, tokenizer, toy_rows, tmp_path):
    # moderate EOS boosts: some of the student's answers stop within the budget (one on its last token), the rest
    # are cut off; the teacher's stop after one or two tokens
    boost_eos(student, tokenizer, amount=0.9)
    boost_eos(teacher, tokenizer, amount=1.0)
    module = make_module(
        student, teacher, tokenizer, validation={"metrics": {}}
    )  # no metric: generated for the guard alone
    decoded = []  # the models the guard decodes with itself
    real = length_guard.greedy_completions
    guard = LengthGuard(min_length_ratio=0.0, max_eos_drop=1.0)  # checks off: measure only
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            length_guard, "greedy_completions", lambda model, *a, **k: decoded.append(model) or real(model, *a, **k)
        )
        fit(module, tokenizer, toy_rows, tmp_path, [guard])

    datamodule = ChatDataModule(tokenizer, toy_rows["train"], toy_rows["val"], batch_size=4, max_length=64)
    datamodule.setup("fit")
    batches = list(datamodule.val_dataloader())[:2]  # limit_val_batches=2
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    student_length, student_eos = by_hand(module.student, tokenizer, batches, eos)
    teacher_length, teacher_eos = by_hand(module.teacher, tokenizer, batches, eos)
    assert (student_length, student_eos, teacher_length, teacher_eos) == (7.25, 0.75, 1.5, 1.0)  # 8 rows

    expected = {
        "val/length/student": student_length,
        "val/eos_rate/student": student_eos,
        "val/length/teacher": teacher_length,
        "val/eos_rate/teacher": teacher_eos,
        "val/length_ratio": student_length / teacher_length,
    }
    for name, value in expected.items():  # lr=0: the same figures at both validations (global steps 2 and 4)
        assert logged(tmp_path, name) == [(1, pytest.approx(value)), (3, pytest.approx(value))], name
    assert guard.figures == pytest.approx(expected)
    # the teacher decodes the two batches of the first of two validations only (the sanity check is not measured)
    assert decoded == [module.teacher, module.teacher]
    assert module.completion_lengths is None and not guard.alerts


def test_completion_lengths_sum_over_ranks_not_a_mean_of_means():
    eos, pad = 2, 0
    rank0, rank1 = CompletionLengths(), CompletionLengths()
    rank0.add(torch.tensor([[5, 2, pad, pad]]), eos)  # 2 tokens, stopped
    rank1.add(torch.tensor([[5, 6, 7, 8], [2, pad, pad, pad], [5, 5, 5, 2]]), eos)  # 4 + 1 + 4 tokens, 2 stopped
    ranks = [rank0, rank1]

    def all_reduce_sum(tensor):  # what trainer.strategy.reduce(reduce_op="sum") returns on every rank
        return sum(torch.tensor([r.tokens, r.rows, r.stopped]) for r in ranks)

    total = rank0.reduced(all_reduce_sum, torch.device("cpu"))
    assert (total.tokens, total.rows, total.stopped) == (11, 4, 3)
    assert total.mean_length == 11 / 4 and total.eos_rate == 3 / 4
    assert total.mean_length != (rank0.mean_length + rank1.mean_length) / 2  # 2 and 3: not 2.5


def test_without_a_guard_or_metric_validation_generates_nothing(student, teacher, tokenizer, toy_rows, tmp_path):
    module = make_module(student, teacher, tokenizer, validation={"metrics": {}})
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        real = base.greedy_completions
        patch.setattr(base, "greedy_completions", lambda *a, **k: calls.append(1) or real(*a, **k))
        fit(module, tokenizer, toy_rows, tmp_path, [], max_steps=2)
        assert calls == []
        guarded = make_module(student, teacher, tokenizer, validation={"metrics": {}})
        fit(guarded, tokenizer, toy_rows, tmp_path / "guarded", [LengthGuard()], max_steps=2)
        assert len(calls) == 2  # the one validation's two batches; not the sanity check


@pytest.mark.multiprocess
def test_ddp_figures_are_sums_over_both_ranks(tokenizer, tmp_path):
    """Two CPU ranks (tests/helpers/length_guard_ddp_worker.py), each validating its own 4 of 8 rows: every rank
    logs the figures of the counts summed over both, which are one process's figures on all 8 rows."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(TESTS / "helpers" / "length_guard_ddp_worker.py"), str(out)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    rank0, rank1 = result["ranks"]
    prompts = [tuple(p) for rank in (rank0, rank1) for p in rank["prompts"]]
    assert len(prompts) == len(set(prompts)) == 8  # distinct rows per rank
    totals = {  # tokens, rows, rows with EOS
        who: [a + b for a, b in zip(rank0["counts"][who], rank1["counts"][who], strict=True)]
        for who in ("student", "teacher")
    }
    assert rank0["counts"]["teacher"] != rank1["counts"]["teacher"]  # the ranks' own figures differ
    expected = {
        "val/length/student": totals["student"][0] / totals["student"][1],
        "val/eos_rate/student": totals["student"][2] / totals["student"][1],
        "val/length/teacher": totals["teacher"][0] / totals["teacher"][1],
        "val/eos_rate/teacher": totals["teacher"][2] / totals["teacher"][1],
    }
    expected["val/length_ratio"] = expected["val/length/student"] / expected["val/length/teacher"]
    assert rank0["figures"] == rank1["figures"] == pytest.approx(expected)
    # one process on the same 8 rows and models, counted by hand
    student = boost_eos(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0), tokenizer, 0.9)
    teacher = boost_eos(tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1), tokenizer, 1.0)
    datamodule = ChatDataModule(tokenizer, addition_rows("train", 16), addition_rows("val", 8), batch_size=8)
    datamodule.setup("fit")
    batches = list(datamodule.val_dataloader())
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (expected["val/length/student"], expected["val/eos_rate/student"]) == by_hand(
        student, tokenizer, batches, eos
    )
    assert (expected["val/length/teacher"], expected["val/eos_rate/teacher"]) == by_hand(
        teacher, tokenizer, batches, eos
    )


# -- the guard ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [GKDModule, OPDModule])
def test_a_collapsed_student_is_named_with_its_figures(method, student, teacher, tokenizer, toy_rows, tmp_path):
    module = make_module(boost_eos(student, tokenizer), teacher, tokenizer, method=method)
    guard = LengthGuard()
    with pytest.warns(UserWarning, match="LengthGuard at step") as caught:
        trainer = fit(module, tokenizer, toy_rows, tmp_path, [guard])
    messages = [str(w.message) for w in caught if "LengthGuard" in str(w.message)]
    teacher_length = guard.figures["val/length/teacher"]
    assert len(messages) == 2 and [a["step"] for a in guard.alerts] == [2, 4]  # once per validation
    assert messages[0] == guard.alerts[0]["message"]
    assert (
        f"LengthGuard at step 2: the student's greedy completions of the validation prompts average 1.00 tokens with "
        f"EOS rate 1.00, the teacher's {teacher_length:.2f} tokens" in messages[0]
    )
    assert f"length ratio {1 / teacher_length:.2f} < min_length_ratio=0.5" in messages[0]
    assert "callbacks.length_guard.min_length_ratio" in messages[0] and "validation.max_new_tokens=8" in messages[0]
    assert "max_eos_drop=" not in messages[0].split("):")[1].split(".")[0]  # the EOS rate did not drop
    assert trainer.global_step == 4 and guard.stop_reason is None and guard.saved_path is None  # stop=False


def test_a_student_that_stops_answering_is_named(student, teacher, tokenizer, toy_rows, tmp_path):
    # the teacher answers EOS at once; the random student never stops within the budget
    module = make_module(student, boost_eos(teacher, tokenizer), tokenizer)
    guard = LengthGuard(min_length_ratio=0.0)
    with pytest.warns(UserWarning, match="LengthGuard at step 2") as caught:
        fit(module, tokenizer, toy_rows, tmp_path, [guard], max_steps=2)
    message = next(str(w.message) for w in caught if "LengthGuard" in str(w.message))
    assert guard.figures["val/eos_rate/teacher"] == 1.0 and guard.figures["val/eos_rate/student"] == 0.0
    assert "EOS rate drop 1.00 > max_eos_drop=0.25" in message and "length ratio" not in message


def test_stop_saves_a_checkpoint_and_stops_and_a_resume_continues(student, teacher, tokenizer, toy_rows, tmp_path):
    module = make_module(boost_eos(student, tokenizer), teacher, tokenizer)
    guard = LengthGuard(stop=True)
    with pytest.warns(UserWarning, match="LengthGuard") as caught:
        trainer = fit(module, tokenizer, toy_rows, tmp_path, [guard], max_steps=6)
    path = tmp_path / "checkpoints" / "last.ckpt"
    warned = [str(w.message) for w in caught if "LengthGuard" in str(w.message)]
    assert len(warned) == 2 and warned[0].startswith("LengthGuard at step 2: ")
    assert warned[0].endswith("callbacks.length_guard.max_eos_drop; stopping the run (stop=true).")
    assert warned[1] == (
        f"LengthGuard stopped the run after step 2 and saved {path}. Change the options named above, then resume "
        f"with ckpt_path={path}, or start again."
    )
    assert trainer.global_step == 2 and trainer.should_stop
    assert guard.saved_path == path and path.is_file()
    assert guard.stop_reason.startswith("length ratio 0.")
    assert guard.run_summary() == {"length_guard_stop": guard.stop_reason, "resume_from": str(path)}
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["global_step"] == 2
    # resumed with the guard relaxed: it trains on from step 2, without repeating step 2's validation
    resumed = make_module(student, teacher, tokenizer)
    relaxed = LengthGuard(min_length_ratio=0.0)
    trainer = fit(resumed, tokenizer, toy_rows, tmp_path / "resumed", [relaxed], max_steps=4, ckpt_path=path)
    assert trainer.global_step == 4 and relaxed.stop_reason is None
    assert [step for step, _ in logged(tmp_path / "resumed", "val/length_ratio")] == [3]  # step 4's validation


def test_a_student_that_is_its_teacher_passes(student, tokenizer, toy_rows, tmp_path):
    module = make_module(student, copy.deepcopy(student), tokenizer)
    guard = LengthGuard(stop=True)
    trainer = fit(module, tokenizer, toy_rows, tmp_path, [guard])
    assert trainer.global_step == 4 and not guard.alerts and guard.stop_reason is None
    assert guard.figures["val/length_ratio"] == 1.0
    assert guard.figures["val/eos_rate/student"] == guard.figures["val/eos_rate/teacher"]


# -- where it does nothing, or only half ----------------------------------------------------------------------------


def test_a_teacher_that_cannot_complete_prompts_is_skipped_and_said_once(
    student, teacher, tokenizer, toy_rows, tmp_path, caplog
):
    other = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=7)
    spec = {"kind": "multi", "column": "teacher", "teachers": {"a": {"kind": "local", "model": teacher}, "b": {
        "kind": "local", "model": other}}}  # fmt: skip
    rows = {split: [{**row, "teacher": "ab"[i % 2]} for i, row in enumerate(part)] for split, part in toy_rows.items()}
    module = make_module(boost_eos(student, tokenizer), spec, tokenizer)
    assert module.completing_teacher() is None
    guard = LengthGuard(stop=True)
    with caplog.at_level(logging.INFO):
        trainer = fit(module, tokenizer, rows, tmp_path, [guard])
    said = [
        r.getMessage() for r in caplog.records if "LengthGuard: the teacher cannot complete prompts" in r.getMessage()
    ]
    assert len(said) == 1
    assert set(guard.figures) == {"val/length/student", "val/eos_rate/student"}
    assert guard.figures["val/length/student"] == 1.0  # measured, but nothing to compare with
    assert trainer.global_step == 4 and not guard.alerts
    assert logged(tmp_path, "val/length/student") and not logged(tmp_path, "val/length_ratio")


def test_a_local_teacher_completes_prompts(student, teacher, tokenizer):
    assert make_module(student, teacher, tokenizer).completing_teacher() is teacher


def test_methods_without_a_teacher_are_left_alone(student, tokenizer, toy_rows, tmp_path):
    module = SFTModule(
        student, tokenizer, training={"optimizer": partial(torch.optim.SGD, lr=0.0)}, validation={"metrics": {}}
    )
    guard = LengthGuard(stop=True)
    fit(module, tokenizer, toy_rows, tmp_path, [guard], max_steps=2)
    assert guard.figures == {} and module.completion_lengths is None
    assert not logged(tmp_path, "val/length/student") if (tmp_path / "metrics.csv").exists() else True


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_length_ratio": -0.1}, "min_length_ratio must be >= 0 .* got -0.1 .*callbacks.length_guard"),
        ({"max_eos_drop": 1.5}, r"max_eos_drop must be in \[0, 1\] .* got 1.5"),
    ],
)
def test_thresholds_out_of_range_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthGuard(**kwargs)


# -- from the command line ------------------------------------------------------------------------------------------


def test_the_default_toy_run_logs_the_figures_and_is_not_stopped(debug_run):
    metrics = debug_run.result["metrics"]
    assert all(name in metrics for name in (*FIGURES, "val/length_ratio"))
    assert metrics["val/length_ratio"] > 0.5 and debug_run.result["length_guard_stop"] is None
    assert debug_run.result["student_dir"]


def test_stop_from_the_command_line_saves_does_not_export_and_records_a_stopped_run(tmp_path, capsys):
    cfg = compose_train(
        tmp_path,
        [
            "experiment=debug",
            "print_config=false",
            "~callbacks.held_out_eval",
            "~callbacks.sample_table",
            "callbacks.length_guard.stop=true",
            "callbacks.length_guard.min_length_ratio=100",  # the toy student's ratio is about 1: always beyond
        ],
    )
    with pytest.warns(UserWarning, match="LengthGuard stopped the run after step 2"):
        result = run(cfg)
    run_dir = tmp_path / "run"
    assert result["global_step"] == 2 and result["length_guard_stop"].startswith("length ratio ")
    assert result["resume_from"] == str(run_dir / "checkpoints" / "last.ckpt") and result["student_dir"] is None
    assert json.loads((run_dir / "run.json").read_text())["status"] == "stopped"
    printed = capsys.readouterr().out
    assert "stopped by the length guard after step 2 (length ratio" in printed and "not exported" in printed
    assert f"resume with: ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}" in printed
