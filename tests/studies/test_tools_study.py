"""lightning_gkd.studies.tools_study: the tools studies' sections of docs/results.md re-render from their shipped
JSON alone, identically; the recovery study's smoke mode runs through the package function (every listed method,
the compute-matched arm, each transcript classified) and writes its section."""

import json
import shutil

import pytest
from helpers.paths import DOCS

from lightning_gkd.studies.tool_reports import recovery_figures
from lightning_gkd.studies.tools_study import get_task, main


def section(text: str, task: str) -> str:
    return text.split(f"<!-- task:{task} -->\n", 1)[1].split(f"<!-- /task:{task} -->\n", 1)[0]


@pytest.mark.parametrize("task", ["tools", "recovery"])
def test_sections_rerender_identically_from_their_json(tmp_path, task):
    shutil.copy(DOCS / "results.md", tmp_path / "results.md")
    shutil.copy(DOCS / f"results_{task}.json", tmp_path / f"results_{task}.json")
    assert main(["--task", task, "--rerender", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == (DOCS / "results.md").read_text()


def test_unknown_tasks_and_methods_are_refused():
    with pytest.raises(ValueError, match="known"):
        get_task("chess")
    with pytest.raises(ValueError, match="its methods"):
        get_task("recovery").method("GKD λ=7")
    with pytest.raises(SystemExit):
        main(["--task", "recovery", "--methods", "GKD λ=7", "--fast"])


def test_recovery_figures_count_transcripts_that_hit_an_error():
    outcomes = {"correct after an error": 0.2, "error not recovered": 0.1, "malformed call": 0.1}
    assert recovery_figures(outcomes) == (pytest.approx(0.4), pytest.approx(0.5))
    assert recovery_figures(dict.fromkeys(outcomes, 0.0)) == (0.0, None)


def test_recovery_fast_mode_runs_through_the_package(tmp_path):
    methods = ["SFT on teacher transcripts", "Supervised KD (λ=0)", "Mixed λ=0.5 β=0"]
    argv = ["--task", "recovery", "--fast", "--compute-matched", "--workers", "1", "--out", str(tmp_path)]
    assert main([*argv, "--methods", *methods]) == 0
    saved = json.loads((tmp_path / "results_recovery.json").read_text())
    assert [row["method"] for row in saved["table"]] == methods
    assert [row["method"] for row in saved["compute_matched"]] == methods[:2]
    assert all(row["steps"] >= 4 and row["matched_to"] == "Mixed λ=0.5 β=0" for row in saved["compute_matched"])
    assert saved["teacher"]["success"] > saved["start"]["success"]
    for run in saved["runs"] + saved["compute_matched_runs"]:
        assert sum(run["outcomes"].values()) == pytest.approx(1.0)
        assert run["example"][0]["role"] == "user"
    report = section((tmp_path / "results.md").read_text(), "recovery")
    assert "## Agentic task with error recovery" in report and "| Mixed λ=0.5 β=0 |" in report
    assert "Compute-matched" in report and "Best on-policy recipe" in report and "hit an error" in report
