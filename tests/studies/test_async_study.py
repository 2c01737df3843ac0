"""lightning_gkd.studies.async_study: the asynchronous-rollouts study's grid composes into runs of the staleness and
rate it names, its runner pins each run to one core and resumes, and hand-made jobs read as per-seed changes against
staleness 0 whose section says what the numbers say (a forward KL that loses 3 points at staleness 2 fails the bar).
The script's smoke run (slow): the real runs, the JSON and the section."""

import json
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.hydra_compose import compose_train
from helpers.paths import DOCS
from helpers.scripts import run_script
from helpers.study_jobs import study_job

from lightning_gkd.cli.sweep import collect_jobs
from lightning_gkd.studies.async_study import (
    RUN_LOG,
    SECTION,
    STALENESS_KEY,
    AsyncRun,
    async_section,
    chain_learning_rates,
    grid,
    reading_lines,
    recipe_name,
    run_grid,
    safe_staleness,
    summarize,
    write_async_section,
)

NAMES = {"gkd_beta0": "GKD β=0", "mixed_lambda05": "Mixed λ=0.5", "gkd_beta1": "GKD β=1", "opd": "OPD"}


# -- the grid ----------------------------------------------------------------------------------------------------------


def test_each_recipe_runs_at_its_chosen_chain_rate_read_from_the_shipped_chain_study():
    lrs = chain_learning_rates(json.loads((DOCS / "results_chain.json").read_text()))
    assert lrs == {"gkd_beta0": 1e-3, "mixed_lambda05": 3e-3, "gkd_beta1": 1e-3, "opd": 3e-4}
    assert {recipe: recipe_name(recipe) for recipe in lrs} == NAMES
    with pytest.raises(KeyError, match="GKD β=0"):
        chain_learning_rates({"runs": [{"method": "OPD", "lr": 3e-4}]}, ["gkd_beta0"])


def test_the_grid_is_every_recipe_staleness_and_seed_each_in_a_folder_of_its_own(tmp_path):
    runs = grid({"gkd_beta0": 1e-3, "opd": 3e-4}, extra=["trainer.max_steps=6"])
    assert len(runs) == 2 * 4 * 3 == len({run.name for run in runs})
    assert [(r.recipe, r.staleness, r.seed) for r in runs[:5]] == [
        ("gkd_beta0", 0, 0),
        ("gkd_beta0", 0, 1),
        ("gkd_beta0", 0, 2),
        ("gkd_beta0", 1, 0),
        ("gkd_beta0", 1, 1),
    ]
    run = runs[-1]
    assert run.name == "opd_staleness4_seed2"
    assert run.overrides == [
        "experiment=study_async",
        "recipe=opd",
        "optimizer.lr=0.0003",
        "seed=2",
        f"{STALENESS_KEY}=4",
        "print_config=false",
        "trainer.max_steps=6",
    ]
    command = run.command(tmp_path / run.name)
    assert command[:4] == [sys.executable, "-m", "lightning_gkd.cli.train", "-m"]  # a multirun job writes result.json
    assert command[-2:] == [f"hydra.sweep.dir={tmp_path / run.name}", "hydra.sweep.subdir=run"]
    # the overrides compose into the run they name: the chain study with a producer that far behind
    cfg = compose_train(tmp_path, run.overrides)
    assert cfg.method.asynchronous.max_staleness == 4 and cfg.optimizer.lr == 3e-4 and cfg.seed == 2
    assert cfg.study.task == "chain" and cfg.study.recipe.name == "OPD" and cfg.trainer.max_steps == 6


# -- the runner --------------------------------------------------------------------------------------------------------

#: a stand-in for one lightning-gkd run: a multirun job folder with a finished result.json, or exit 1 on "fail"
FAKE_RUN = textwrap.dedent(
    """
    import json, os, sys, pathlib
    folder, overrides, result = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    print("cores", sorted(os.sched_getaffinity(0)), "threads", os.environ["OMP_NUM_THREADS"], flush=True)
    if "seed=1" in overrides and os.environ.get("FAKE_RUN_FAILS"):
        sys.exit("boom: the run fell over")
    (folder / "run" / ".hydra").mkdir(parents=True)
    (folder / "run" / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\\n" for o in overrides))
    (folder / "run" / "result.json").write_text(json.dumps(result))
    """
)


@pytest.fixture()
def fake_runs(monkeypatch):
    """``AsyncRun.command`` runs ``FAKE_RUN`` (its finished result: seed/100 greedy test accuracy); the commands run."""
    started = []

    def command(self, folder: Path) -> list[str]:
        started.append(self.name)
        result = study_job(0, NAMES[self.recipe], self.seed, self.lr, curve=[[6, 0.5]], test=self.seed / 100)
        return [sys.executable, "-c", FAKE_RUN, str(folder), json.dumps(self.overrides), json.dumps(result)]

    monkeypatch.setattr(AsyncRun, "command", command)
    return started


def test_runs_are_pinned_to_a_core_each_skipped_once_finished_and_a_failure_carries_its_log(
    tmp_path, fake_runs, monkeypatch
):
    runs = grid({"gkd_beta0": 1e-3}, staleness=(0, 1), seeds=(0, 1))
    said = []
    seconds = run_grid(runs, tmp_path, workers=2, poll_seconds=0.05, say=said.append)
    assert sorted(seconds) == sorted(fake_runs) == sorted(run.name for run in runs)
    for run in runs:
        log = (tmp_path / run.name / RUN_LOG).read_text()
        assert "threads 1" in log and len(json.loads(log.split("cores ")[1].split(" threads")[0])) == 1
    jobs = [job for run in runs for job in collect_jobs(tmp_path / run.name, final=True)]
    assert [(job["values"]["recipe"], job["values"][STALENESS_KEY], job["study"]["seed"]) for job in jobs] == [
        ("gkd_beta0", "0", 0),
        ("gkd_beta0", "0", 1),
        ("gkd_beta0", "1", 0),
        ("gkd_beta0", "1", 1),
    ]
    # a second pass runs nothing; a run whose overrides changed (another rate) runs again
    fake_runs.clear()
    assert run_grid(runs, tmp_path, poll_seconds=0.05, say=said.append) == {} and fake_runs == []
    moved = grid({"gkd_beta0": 3e-3}, staleness=(0,), seeds=(0,))
    assert list(run_grid([*runs, *moved], tmp_path, poll_seconds=0.05, say=said.append)) == [moved[0].name]
    # a failed run: the others finish, the error carries the end of its log, and the next pass redoes only it
    monkeypatch.setenv("FAKE_RUN_FAILS", "1")
    failing = grid({"opd": 3e-4}, staleness=(0,), seeds=(0, 1, 2))
    with pytest.raises(RuntimeError, match="boom: the run fell over") as raised:
        run_grid(failing, tmp_path, workers=1, poll_seconds=0.05, say=said.append)
    assert "opd_staleness0_seed1" in str(raised.value) and "exit status 1" in str(raised.value)
    assert not (tmp_path / "opd_staleness0_seed2").exists()  # none starts after a failure
    monkeypatch.delenv("FAKE_RUN_FAILS")
    fake_runs.clear()
    run_grid(failing, tmp_path, poll_seconds=0.05, say=said.append)
    assert fake_runs == ["opd_staleness0_seed1", "opd_staleness0_seed2"]


# -- the summary and the section ---------------------------------------------------------------------------------------


def async_job(recipe: str, staleness: int, seed: int, greedy: float, sampled: float, seconds: float = 60.0) -> dict:
    """A ``collect_jobs`` entry of one finished run of the study (chain-like: its test completions scored)."""
    curve, compute = [[150, 0.3], [300, greedy]], [[150, 1e9, seconds / 5], [300, 2e9, seconds * 0.4]]
    job = study_job(0, NAMES[recipe], seed, 1e-3, curve=curve, test=greedy, compute=compute)
    job["study"]["completions"] = {
        "trained": {
            "greedy": {"accuracy": greedy, "texts": ["x"] * 512},
            "sampled": {"accuracy": sampled, "texts": ["x"] * 512},
        },
        "teacher": {"greedy": {"accuracy": 0.98}},
        "student_init": {"greedy": {"accuracy": 0.16}},
    }
    job["fit_seconds"] = seconds
    job["folder"] = "run"
    job["values"] = {"experiment": "study_async", "recipe": recipe, STALENESS_KEY: str(staleness), "seed": str(seed)}
    return job


#: (greedy, sampled) per seed at staleness 0; each staleness shifts every seed's greedy accuracy by its points
BASE = {
    "gkd_beta0": [(0.28, 0.04), (0.29, 0.04), (0.30, 0.03)],
    "mixed_lambda05": [(0.47, 0.24), (0.54, 0.26), (0.43, 0.22)],
    "gkd_beta1": [(0.57, 0.28), (0.56, 0.29), (0.58, 0.30)],
    "opd": [(0.28, 0.09), (0.35, 0.08), (0.29, 0.08)],
}


def study_jobs(shifts: dict[str, dict[int, float]]) -> list[dict]:
    """Every recipe x staleness {0, 1, 2, 4} x seeds 0-2; at staleness k each seed's greedy accuracy moves by
    ``shifts[recipe][k]`` points (its T=1 accuracy by half that)."""
    jobs = []
    for recipe, seeds in BASE.items():
        for k in (0, 1, 2, 4):
            shift = 0.0 if k == 0 else shifts[recipe][k] / 100
            for seed, (greedy, sampled) in enumerate(seeds):
                jobs.append(async_job(recipe, k, seed, greedy + shift, sampled + shift / 2, seconds=60.0 + k + seed))
    return jobs


FINE = {
    "gkd_beta0": {1: 0.3, 2: -1.2, 4: -1.9},
    "mixed_lambda05": {1: 1.0, 2: -0.5, 4: 0.0},
    "gkd_beta1": {1: -1.2, 2: -3.2, 4: -5.2},
    "opd": {1: -2.5, 2: -4.0, 4: -6.0},
}


def cell(summary: dict, recipe: str, staleness: int) -> dict:
    entry = next(entry for entry in summary["recipes"] if entry["recipe"] == recipe)
    return next(cell for cell in entry["cells"] if cell["staleness"] == staleness)


def test_the_summary_holds_each_seed_its_mean_and_the_mean_per_seed_change_against_staleness_0():
    jobs = study_jobs(FINE)
    jobs.append({"num": 99, "status": "failed", "error": "RuntimeError: boom", "folder": "x", "values": {}})
    jobs.append(async_job("opd", 8, 0, 0.1, 0.1) | {"status": "failed"})  # a failed run is no staleness of the study
    summary = summarize(jobs, commands=["python scripts/async_accuracy.py"], machine="here", minutes=12.5)
    assert json.loads(json.dumps(summary)) == summary  # JSON-ready as it is
    assert [entry["recipe"] for entry in summary["recipes"]] == list(BASE)
    assert [entry["method"] for entry in summary["recipes"]] == list(NAMES.values())
    assert summary["staleness"] == [0, 1, 2, 4] and summary["seeds"] == [0, 1, 2] and len(summary["runs"]) == 48
    assert (summary["steps"], summary["batch_size"], summary["test_prompts"]) == (300, 8, 512)
    assert summary["reference"] == {"teacher": 0.98, "student_init": 0.16}
    assert (summary["commands"], summary["machine"], summary["minutes"]) == (
        ["python scripts/async_accuracy.py"],
        "here",
        12.5,
    )
    synchronous = cell(summary, "gkd_beta1", 0)
    assert synchronous["greedy"] == [0.57, 0.56, 0.58] and synchronous["sampled"] == [0.28, 0.29, 0.30]
    assert synchronous["greedy_mean"] == pytest.approx(0.57) and synchronous["greedy_std"] == pytest.approx(0.01)
    assert synchronous["greedy_delta"] == 0.0 and synchronous["seconds"] == pytest.approx(61.0)
    assert synchronous["train_seconds"] == pytest.approx(24.4)
    stale = cell(summary, "gkd_beta1", 2)
    assert stale["greedy"] == pytest.approx([0.538, 0.528, 0.548])
    assert stale["greedy_delta"] == pytest.approx(-3.2) and stale["sampled_delta"] == pytest.approx(-1.6)
    assert stale["greedy_std"] == pytest.approx(0.01) and stale["seconds"] == pytest.approx(63.0)
    assert cell(summary, "mixed_lambda05", 1)["greedy_delta"] == pytest.approx(1.0)


def test_the_change_is_per_seed_a_seed_missing_at_staleness_0_is_left_out_of_it():
    jobs = [
        async_job("gkd_beta0", 0, 0, 0.30, 0.05),
        async_job("gkd_beta0", 0, 1, 0.50, 0.05),
        async_job("gkd_beta0", 1, 0, 0.32, 0.04),
        async_job("gkd_beta0", 1, 1, 0.44, 0.07),
        async_job("gkd_beta0", 1, 2, 0.90, 0.90),  # no staleness-0 run of seed 2: in the mean, not in the change
    ]
    stale = cell(summarize(jobs), "gkd_beta0", 1)
    assert stale["seeds"] == [0, 1, 2] and stale["greedy_mean"] == pytest.approx((0.32 + 0.44 + 0.90) / 3)
    assert stale["greedy_delta"] == pytest.approx((2.0 - 6.0) / 2) and stale["sampled_delta"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="No finished run"):
        summarize([{"num": 0, "status": "failed", "folder": "run", "values": {}}])


def test_the_section_tables_each_cell_and_its_readings_follow_the_numbers():
    summary = summarize(study_jobs(FINE), commands=["python scripts/async_accuracy.py"], machine="here", minutes=90.0)
    lines = async_section(summary)
    text = "\n".join(lines)
    assert "| recipe | lr | staleness 0 | staleness 1 | staleness 2 | staleness 4 |" in lines
    assert "| GKD β=1 | 0.001 | 57.0 ± 1.0 | 55.8 ± 1.0 (−1.2) | 53.8 ± 1.0 (−3.2) | 51.8 ± 1.0 (−5.2) |" in lines
    assert "| GKD β=1 | 0.001 | 29.0 ± 1.0 | 28.4 ± 1.0 (−0.6) | 27.4 ± 1.0 (−1.6) | 26.4 ± 1.0 (−2.6) |" in lines
    assert "Machine: here; total 90.0 min" in text and "Teacher: 98.0%; student at start: 16.0%" in text
    assert "GKD β=0 24 / 25 / 25 / 26" in text  # training seconds: 0.4 of the fit's (60 + k + seed) here
    readings = reading_lines(summary)
    assert readings[0] == (
        "- Forward KL (GKD β=0) at staleness ≤ 2 ends within 2 points of synchronous (staleness 0) greedy test "
        "accuracy: Δ +0.3 at staleness 1, −1.2 at staleness 2 (points, mean over 3 seed(s))."
    )
    assert readings[1] == "- GKD β=1 loses more than 2 points at staleness 2 (−3.2) and 4 (−5.2)."
    assert readings[2] == "- OPD loses more than 2 points at staleness 1 (−2.5), 2 (−4.0) and 4 (−6.0)."
    assert readings[3].startswith("- Seed noise: the std over seeds of a cell is ")
    assert readings[4] == (
        "- Recommendation (no loss of more than 2 points up to the staleness named): use `max_staleness` ≤ 4 (the "
        "largest tested) with GKD β=0 and Mixed λ=0.5; use `max_staleness` ≤ 1 with GKD β=1; keep `max_staleness=0` "
        "(synchronous) with OPD."
    )
    assert lines[-len(readings) :] == readings


def test_a_forward_kl_that_loses_3_points_at_staleness_2_fails_the_bar_and_is_recommended_less():
    shifts = {**FINE, "gkd_beta0": {1: -0.5, 2: -3.0, 4: 1.0}}  # a recovery at 4 does not make 2 safe
    summary = summarize(study_jobs(shifts))
    assert cell(summary, "gkd_beta0", 2)["greedy_delta"] == pytest.approx(-3.0)
    entry = next(entry for entry in summary["recipes"] if entry["recipe"] == "gkd_beta0")
    assert safe_staleness(entry) == 1
    readings = reading_lines(summary)
    assert readings[0] == (
        "- Forward KL (GKD β=0) at staleness ≤ 2 does **not** end within 2 points of synchronous (staleness 0) greedy "
        "test accuracy: Δ −0.5 at staleness 1, −3.0 at staleness 2 (points, mean over 3 seed(s)); it loses 3.0 "
        "points at staleness 2."
    )
    assert readings[1] == "- GKD β=0 loses more than 2 points at staleness 2 (−3.0)."
    assert readings[-1] == (
        "- Recommendation (no loss of more than 2 points up to the staleness named): use `max_staleness` ≤ 4 (the "
        "largest tested) with Mixed λ=0.5; use `max_staleness` ≤ 1 with GKD β=0 and GKD β=1; keep "
        "`max_staleness=0` (synchronous) with OPD."
    )


def test_when_no_recipe_loses_the_bar_the_readings_say_so():
    calm = {recipe: {1: 0.5, 2: -0.5, 4: -1.5} for recipe in BASE}
    readings = reading_lines(summarize(study_jobs(calm)))
    assert readings[1] == "- No recipe loses more than 2 points at any staleness tested (1, 2 and 4)."
    assert readings[-1].endswith(
        "use `max_staleness` ≤ 4 (the largest tested) with GKD β=0, Mixed λ=0.5, GKD β=1 and OPD."
    )


def section(text: str) -> str:
    return text.split(f"<!-- task:{SECTION} -->\n", 1)[1].split(f"<!-- /task:{SECTION} -->\n", 1)[0]


def test_the_section_goes_between_its_markers_after_the_chain_study_and_keeps_the_others(tmp_path):
    page = tmp_path / "results.md"
    shipped = (DOCS / "results.md").read_text()
    page.write_text(shipped)
    write_async_section(page, ["## first", ""])
    text = page.read_text()
    assert section(text) == "## first\n"
    assert text.index("<!-- /task:chain -->") < text.index("<!-- task:async -->") < text.index("<!-- task:addition -->")
    write_async_section(page, ["## second", "table"])
    again = page.read_text()
    assert section(again) == "## second\ntable\n"
    assert again.replace("<!-- task:async -->\n## second\ntable\n<!-- /task:async -->\n", "") == text.replace(
        "<!-- task:async -->\n## first\n<!-- /task:async -->\n", ""
    )


# -- the script --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_script_fast_mode_runs_its_grid_writes_the_json_and_the_section_and_resumes(tmp_path):
    run_script("async_accuracy.py", "--fast", "--workers", "1", "--out", str(tmp_path), cwd=tmp_path)
    summary = json.loads((tmp_path / "results_async.json").read_text())
    assert [(entry["method"], entry["lr"]) for entry in summary["recipes"]] == [("GKD β=0", [1e-3]), ("OPD", [3e-4])]
    assert summary["staleness"] == [0, 1] and summary["seeds"] == [0] and summary["steps"] == 6
    assert summary["test_prompts"] == 64 and summary["task"] == "chain"
    for run in summary["runs"]:
        assert 0.0 <= run["test_accuracy"] <= 1.0 and 0.0 <= run["test_sampled_accuracy"] <= 1.0
        assert run["seconds"] > 0
    for entry in summary["recipes"]:
        assert [c["greedy_delta"] for c in entry["cells"]][0] == 0.0
    reference = summary["reference"]
    assert reference["teacher"] > reference["student_init"]
    work = tmp_path / ".sweeps" / "async"
    assert sorted(path.name for path in work.iterdir()) == [
        "gkd_beta0_staleness0_seed0",
        "gkd_beta0_staleness1_seed0",
        "opd_staleness0_seed0",
        "opd_staleness1_seed0",
    ]
    assert (work / "opd_staleness1_seed0" / "run" / "result.json").exists()
    page = (tmp_path / "results.md").read_text()
    assert "<!-- task:async -->" in page and "| OPD | 0.0003 |" in page
    assert "Forward KL (GKD β=0) at staleness ≤ 2" in page and "Recommendation" in page
    # a second pass runs nothing and renders the same numbers; the section is rendered from the JSON alone, the same
    done = run_script("async_accuracy.py", "--fast", "--workers", "1", "--out", str(tmp_path), cwd=tmp_path)
    assert done.stdout.count("done already:") == 4
    again = json.loads((tmp_path / "results_async.json").read_text())
    assert again["runs"] == summary["runs"]
    rendered = (tmp_path / "results.md").read_text()
    run_script("async_accuracy.py", "--rerender", "--out", str(tmp_path), cwd=tmp_path)
    assert (tmp_path / "results.md").read_text() == rendered
