"""lightning_gkd.studies.results_page: docs/results.md's addition and chain sections rendered from the studies the docs
ship (docs/results.json, docs/results_chain.json) are the sections the page holds, and their gap-closed columns are
each seed's."""

import json
import statistics

import pytest
from helpers.paths import DOCS

from lightning_gkd.studies.results_page import (
    RESULTS_HEADER,
    chain_section,
    chain_table,
    update_results_section,
    write_section,
)


def section(text: str, task: str) -> str:
    return text.split(f"<!-- task:{task} -->\n", 1)[1].split(f"<!-- /task:{task} -->\n", 1)[0]


def expected_gaps(accuracies, teacher, start):
    seeds = [(acc - start) / (teacher - start) for acc in accuracies]
    return seeds, statistics.fmean(seeds), statistics.stdev(seeds)


@pytest.mark.parametrize(
    "task, name", [("addition", "results.json"), ("chain", "results_chain.json"), ("shapes", "results_vlm.json")]
)
def test_each_section_of_the_page_is_what_its_shipped_study_renders(tmp_path, task, name):
    study = json.loads((DOCS / name).read_text())
    assert study["task"] == task
    write_section(tmp_path, study, plots=False)
    page = (DOCS / "results.md").read_text()
    assert section((tmp_path / "results.md").read_text(), task) == section(page, task)
    assert page.startswith("\n".join(RESULTS_HEADER))


def test_a_section_is_replaced_and_the_others_kept(tmp_path):
    path = tmp_path / "results.md"
    update_results_section(path, "chain", ["chain one"])
    update_results_section(path, "tools", ["tools"])
    update_results_section(path, "chain", ["chain two", ""])
    text = path.read_text()
    assert text.startswith("\n".join(RESULTS_HEADER))
    assert text.endswith(
        "<!-- task:tools -->\ntools\n<!-- /task:tools -->\n\n<!-- task:chain -->\nchain two\n<!-- /task:chain -->\n"
    )


def test_the_chain_table_closes_the_gap_per_seed_from_the_saved_runs():
    """docs/results_chain.json, two of its methods: each seed's greedy test accuracy against the teacher's and the
    student start's greedy accuracy, then mean ± std, as the rendered row shows."""
    saved = json.loads((DOCS / "results_chain.json").read_text())
    keep = {"Supervised KD", "GKD β=1"}
    saved = {
        **saved,
        "methods": [m for m in saved["methods"] if m["name"] in keep],
        "runs": [r for r in saved["runs"] if r["method"] in keep],
    }
    teacher = saved["reference"]["teacher"]["greedy"]["accuracy"]
    start = saved["reference"]["student_init"]["greedy"]["accuracy"]
    assert (round(teacher, 3), round(start, 3)) == (0.980, 0.162)
    table = chain_table(saved)
    assert [row["method"] for row in table] == ["Supervised KD", "GKD β=1"]
    for row in table:
        accuracies = [r["test_accuracy"] for r in saved["runs"] if r["method"] == row["method"] and r["arm"] == "full"]
        seeds, mean, std = expected_gaps(accuracies, teacher, start)
        assert len(seeds) == 3 and row["gap_closed_seeds"] == pytest.approx(seeds, abs=1e-12)
        assert (row["gap_closed"], row["gap_closed_std"]) == pytest.approx((mean, std), abs=1e-12)
    lines = chain_section(saved, table)
    assert any(line.startswith("| method | what | lr | test greedy | gap closed greedy |") for line in lines)
    (gkd,) = [line for line in lines if line.startswith("| GKD β=1 |")]
    assert "| 0.570 ± 0.006 (n=3) | 49.8% ± 0.8% |" in gkd


def test_the_addition_section_closes_the_gap_per_seed(tmp_path):
    study = json.loads((DOCS / "results.json").read_text())
    write_section(tmp_path, study, plots=False)
    report = (tmp_path / "results.md").read_text()
    teacher = study["reference"]["teacher"]["greedy"]["accuracy"]
    start = study["reference"]["student_init"]["greedy"]["accuracy"]
    for method in study["methods"]:
        accuracies = [r["test_accuracy"] for r in study["runs"] if r["method"] == method["name"]]
        _, mean, std = expected_gaps(accuracies, teacher, start)
        assert f"(n=5) | {mean:.1%} ± {std:.1%} |" in report
    assert "| SFT | cross-entropy on ground-truth answers | 0.003 | 0.749 ± 0.014 (n=5) | 70.0% ± 1.9% |" in report


def test_the_plots_are_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    write_section(tmp_path, json.loads((DOCS / "results.json").read_text()))
    assert (tmp_path / "gkd_accuracy.png").stat().st_size > 10_000
