"""lightning_gkd.studies.study: a hand-made sweep of study runs read as tables: each method's learning rate picked on
the first seed, every seed at that rate, the gap closed per seed, step- and FLOP-matched validation, the summary
page, and merging a study into an earlier one."""

import pytest
from helpers.study_jobs import START, TEACHER, study_job

from lightning_gkd.studies.study import (
    gap_fields,
    interpolate,
    mean_curves,
    merged_study,
    pick_learning_rates,
    study_from_jobs,
    study_markdown,
    study_table,
)

GKD_FLOPS = [[50, 7.5e10, 4.0], [100, 1.5e11, 8.0]]  # 1.5e9 FLOPs a step: 1.5x SFT's


def sweep() -> list[dict]:
    """SFT and GKD β=1 at two rates on seed 0 and more seeds at some rates; a failed job and a plain one."""
    sft = [
        (0, 1e-3, [[50, 0.3], [100, 0.5]], 0.4),
        (0, 3e-3, [[50, 0.4], [100, 0.7]], 0.6),  # SFT's best last validation on seed 0
        (1, 1e-3, [[50, 0.1], [100, 0.2]], 0.2),  # another rate's seed: not reported
        (1, 3e-3, [[50, 0.2], [100, 0.6]], 0.7),
        (2, 3e-3, [[50, 0.3], [100, 0.5]], 0.5),
    ]
    gkd = [
        (0, 1e-3, [[50, 0.5], [100, 0.6]], 0.5),  # a tie with 3e-3: the smaller rate
        (0, 3e-3, [[50, 0.5], [100, 0.6]], 0.8),
        (1, 1e-3, [[50, 0.7], [100, 0.8]], TEACHER),
        (2, 1e-3, [[50, 0.3], [100, 0.4]], START),
    ]
    jobs = [study_job(i, "SFT", seed, lr, curve=curve, test=test) for i, (seed, lr, curve, test) in enumerate(sft)]
    jobs += [
        study_job(len(jobs) + i, "GKD β=1", seed, lr, curve=curve, test=test, compute=GKD_FLOPS, on_policy=True)
        for i, (seed, lr, curve, test) in enumerate(gkd)
    ]
    jobs.append({"num": 99, "status": "failed", "error": "RuntimeError: boom"})
    jobs.append({"num": 100, "status": "finished", "held_out": {}})  # a run without a study record
    return jobs


def test_each_method_keeps_every_seed_at_the_rate_its_first_seed_validated_best():
    study = study_from_jobs(sweep(), command="lightning-gkd -m ...", machine="here")
    assert [(r["method"], r["seed"], r["lr"], r["test_accuracy"]) for r in study["runs"]] == [
        ("SFT", 0, 3e-3, 0.6),
        ("SFT", 1, 3e-3, 0.7),
        ("SFT", 2, 3e-3, 0.5),
        ("GKD β=1", 0, 1e-3, 0.5),
        ("GKD β=1", 1, 1e-3, TEACHER),
        ("GKD β=1", 2, 1e-3, START),
    ]
    assert study["sweep"] == [
        {"method": "SFT", "lr": 1e-3, "val": 0.5},
        {"method": "SFT", "lr": 3e-3, "val": 0.7},
        {"method": "GKD β=1", "lr": 1e-3, "val": 0.6},
        {"method": "GKD β=1", "lr": 3e-3, "val": 0.6},
    ]
    assert study["reference"] == {
        "teacher": {"greedy": {"accuracy": TEACHER}},
        "student_init": {"greedy": {"accuracy": START}},
    }
    assert [(m["name"], m["description"], m["on_policy"], m["lrs"]) for m in study["methods"]] == [
        ("SFT", "what SFT is", False, None),
        ("GKD β=1", "what GKD β=1 is", True, None),
    ]
    assert study["args"] == {
        "steps": 100,
        "batch_size": 8,
        "eval_every": 50,
        "seeds": [0, 1, 2],
        "lrs": [1e-3, 3e-3],
        "low_data": 0.0,
        "low_data_methods": [],
    }
    assert study["seconds"] == 10.0 * 9 and study["command"] == "lightning-gkd -m ..." and study["machine"] == "here"


def test_the_tie_goes_to_the_smaller_rate_and_a_run_without_a_curve_validates_at_zero():
    runs = [
        {"method": "A", "lr": 3e-3, "curve": [[10, 0.5]]},
        {"method": "A", "lr": 1e-3, "curve": [[10, 0.5]]},
        {"method": "B", "lr": 1e-3, "curve": []},
        {"method": "B", "lr": 3e-3, "curve": [[10, 0.0001]]},
    ]
    assert pick_learning_rates(runs) == {"A": 1e-3, "B": 3e-3}


def test_the_table_closes_the_gap_per_seed_and_reads_validation_at_matched_steps_and_flops():
    table = study_table(study_from_jobs(sweep()))
    sft, gkd = table
    assert sft["test"] == [0.6, 0.7, 0.5] and sft["test_mean_std"] == pytest.approx((0.6, 0.1))
    assert sft["gap_closed_seeds"] == pytest.approx([0.625, 0.75, 0.5])
    assert (sft["gap_closed"], sft["gap_closed_std"]) == pytest.approx((0.625, 0.125))
    assert gkd["gap_closed_seeds"] == pytest.approx([0.5, 1.0, 0.0])
    assert (gkd["gap_closed"], gkd["gap_closed_std"]) == pytest.approx((0.5, 0.5))
    # step-matched: the mean last validation; FLOP-matched: at SFT's 1e11 FLOPs (the smallest budget)
    assert sft["val_last_step"] == pytest.approx(0.6) and gkd["val_last_step"] == pytest.approx(0.6)
    assert sft["budget_tflops"] == gkd["budget_tflops"] == pytest.approx(0.1)
    assert sft["val_at_budget"] == pytest.approx(0.6)
    assert gkd["val_at_budget"] == pytest.approx(0.5 + 0.1 * (1e11 - 7.5e10) / (1.5e11 - 7.5e10))
    assert (sft["tflops"], gkd["tflops"]) == pytest.approx((0.1, 0.15))
    assert (sft["train_seconds"], gkd["train_seconds"]) == pytest.approx((10.0, 8.0))


def test_the_summary_page_shows_each_method_row():
    page = study_markdown(study_from_jobs(sweep(), command="lightning-gkd -m x=1,2"))
    assert page.startswith("# Study\n\n- Command: `lightning-gkd -m x=1,2`\n")
    rows = [line for line in page.splitlines() if line.startswith(("| SFT |", "| GKD β=1 |"))]
    assert rows == [
        "| SFT | what SFT is | 0.003 | 0.600 ± 0.100 (n=3) | 0.600, 0.700, 0.500 | 62.5% ± 12.5% | 0.10 | 10 | 0.600 "
        "| 0.600 |",
        "| GKD β=1 | what GKD β=1 is | 0.001 | 0.500 ± 0.400 (n=3) | 0.500, 0.900, 0.100 | 50.0% ± 50.0% | 0.15 | 8 "
        "| 0.600 | 0.533 |",
    ]
    assert "teacher 0.900, student start 0.100" in page and "at 0.10 TFLOPs" in page


def test_a_method_that_tried_other_rates_lists_them():
    jobs = sweep() + [study_job(200, "OPD", 0, rate, curve=[[50, 0.1], [100, 0.2]], test=0.3) for rate in (1e-4, 3e-4)]
    study = study_from_jobs(jobs)
    assert [m["lrs"] for m in study["methods"]] == [None, None, [1e-4, 3e-4]]
    assert "| OPD | what OPD is | 0.0001 (of [0.0001, 0.0003]) |" in study_markdown(study)


def test_the_low_data_arm_keeps_its_runs_at_the_chosen_rate_and_its_share_of_the_rows():
    low = [
        study_job(300 + seed, "SFT", seed, 3e-3, curve=[[50, 0.1], [100, 0.2]], test=0.3, arm="low-data", train_rows=50)
        for seed in (0, 1)
    ]
    study = study_from_jobs(sweep() + low)
    assert [(r["seed"], r["arm"]) for r in study["runs"] if r["method"] == "SFT"] == [
        (0, "full"),
        (1, "full"),
        (2, "full"),
        (0, "low-data"),
        (1, "low-data"),
    ]
    assert study["args"]["low_data"] == 50 / 1000 and study["args"]["low_data_methods"] == ["SFT"]
    assert study_table(study)[0]["test"] == [0.6, 0.7, 0.5]  # the full arm only


def test_a_sweep_without_study_runs_says_how_to_make_one():
    with pytest.raises(ValueError, match="experiment=study_addition or study_chain"):
        study_from_jobs([{"num": 0, "status": "finished", "held_out": {}}])


def test_mean_curves_start_from_the_student_and_interpolate_on_flops():
    study = study_from_jobs(sweep())
    study["reference"]["student_init"]["val_accuracy"] = 0.05
    curves = mean_curves(study, "GKD β=1")
    flat = {key: [value for point in points for value in point] for key, points in curves.items()}
    assert flat["step"] == pytest.approx([0.0, 0.05, 50.0, 0.5, 100.0, 0.6])
    assert flat["flops"] == pytest.approx([0.0, 0.05, 7.5e10, 0.5, 1.5e11, 0.6])
    assert flat["seconds"] == pytest.approx([0.0, 0.05, 4.0, 0.5, 8.0, 0.6])
    assert interpolate(curves["flops"], 3.75e10) == pytest.approx(0.275)
    assert interpolate(curves["flops"], 2e11) is None


def test_without_a_gap_to_close_the_gap_is_none():
    fields = gap_fields([0.5, 0.6], teacher=0.3, start=0.3)
    assert fields == {"gap_closed": None, "gap_closed_std": None, "gap_closed_seeds": [None, None]}


def test_add_keeps_the_earlier_methods_and_replaces_the_rerun_ones():
    before = {
        "runs": [{"method": "A", "seed": 0}, {"method": "B", "seed": 0}],
        "sweep": [{"method": "A", "lr": 1}, {"method": "B", "lr": 1}],
        "methods": [{"name": "A"}, {"name": "B"}],
        "seconds": 10.0,
        "command": "first",
        "args": {"low_data_methods": ["A"], "steps": 300},
    }
    new = {
        "runs": [{"method": "B", "seed": 1}, {"method": "C", "seed": 0}],
        "sweep": [{"method": "B", "lr": 2}, {"method": "C", "lr": 2}],
        "methods": [{"name": "B"}, {"name": "C"}],
        "seconds": 5.0,
        "command": "second",
        "args": {"low_data_methods": [], "steps": 300},
    }
    merged = merged_study(before, new)
    assert merged["runs"] == [{"method": "A", "seed": 0}, {"method": "B", "seed": 1}, {"method": "C", "seed": 0}]
    assert [m["name"] for m in merged["methods"]] == ["A", "B", "C"] and merged["sweep"][1] == {"method": "B", "lr": 2}
    assert merged["seconds"] == 15.0 and merged["command"] == "first && second"
    assert merged["args"]["low_data_methods"] == ["A"]
