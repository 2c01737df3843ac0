"""Multirun sweeps (lightning_gkd/cli/sweep.py): job folders named by the swept overrides, each job's result.json, and
the sweep's summary.csv / summary.md, from job folders and from real `lightning-gkd -m` sweeps."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hydra_compose import compose_train
from helpers.study_jobs import study_result
from omegaconf import OmegaConf, open_dict, read_write

from lightning_gkd.cli.sweep import MAX_NAME, job_dir_name, write_job_result, write_study, write_summary

FAST = [
    "model=tiny",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.val_batch_size=8",
    "data.test_data=null",
    "method.sampling.max_new_tokens=4",
    "method.validation.max_new_tokens=4",
    "print_config=false",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "export=false",
]


def test_job_folder_names_are_one_valid_folder():
    assert job_dir_name(0, ["method.divergence.beta=0"]) == "0_method.divergence.beta=0"
    assert job_dir_name(3, []) == "3"
    # a slash (or anything a shell or a file system minds) never makes a nested or odd folder
    assert job_dir_name(1, ["data.train_data=data/a b.jsonl", "+x='y'"]) == "1_+x=_y_,data.train_data=data_a_b.jsonl"
    long = [f"data.train_data=/some/long/path/number_{i:03d}/train.jsonl" for i in range(8)]
    first, second = job_dir_name(0, long), job_dir_name(0, long[:-1] + ["data.train_data=other"])
    assert len(first) == MAX_NAME and first != second and first[:20] == second[:20]


def test_the_sweep_subdir_names_a_job_by_the_overrides_the_sweep_varies(tmp_path):
    cfg = compose_train(tmp_path, ["method.divergence.beta=0", "trainer.max_steps=2", "data.train_data=a/b.jsonl"])
    sweep = tmp_path / "sweep"
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.job.num = 4
        cfg.hydra.sweep.dir = str(sweep)
    # no multirun.yaml (another sweeper): every override but the noisy ones
    assert cfg.hydra.sweep.subdir == "4_data.train_data=a_b.jsonl,method.divergence.beta=0,trainer.max_steps=2"
    sweep.mkdir()
    OmegaConf.save(
        {
            "hydra": {
                "overrides": {
                    "task": ["method.divergence.beta=0,1", "trainer.max_steps=2", "data.train_data=a/b.jsonl,c"]
                }
            }
        },
        sweep / "multirun.yaml",
    )
    assert cfg.hydra.sweep.subdir == "4_data.train_data=a_b.jsonl,method.divergence.beta=0"


def fake_job(sweep: Path, num: int, overrides: list[str], result: dict | None = None, error: Exception | None = None):
    folder = sweep / job_dir_name(num, overrides)
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), folder / ".hydra" / "overrides.yaml")
    OmegaConf.save({"hydra": {"job": {"num": num}}}, folder / ".hydra" / "hydra.yaml")
    if result is not None or error is not None:
        write_job_result(folder, num, overrides, result, error)
    return folder


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_summary_has_a_row_per_job_and_a_failed_job_shows_as_failed(tmp_path):
    sweep = tmp_path / "sweep"
    done = {
        "global_step": 2,
        "metrics": {"train/loss": 0.5, "val/loss": 0.25, "train/lr": 0.001, "val/accuracy": 0.75},
        "held_out": {"after": {"accuracy": 0.5}},
        "stopped_by_signal": False,
    }
    fake_job(sweep, 0, ["method.divergence.beta=0", "seed=1"], done)
    fake_job(sweep, 1, ["method.divergence.beta=1", "seed=1"], error=FileNotFoundError("no such file: x.jsonl\nmore"))
    fake_job(sweep, 2, ["method.divergence.beta=2", "seed=1"])  # killed: no result.json
    table = write_summary(sweep, swept=["method.divergence.beta"], final=True)
    rows = read_csv(sweep / "summary.csv")
    assert list(rows[0]) == [
        "job",
        "method.divergence.beta",
        "status",
        "steps",
        "train/loss",
        "val/loss",
        "val/accuracy",
        "held-out accuracy (after)",
        "folder",
    ]
    assert [(r["job"], r["method.divergence.beta"], r["status"], r["steps"]) for r in rows] == [
        ("0", "0", "finished", "2"),
        ("1", "1", "failed: FileNotFoundError: no such file: x.jsonl", ""),
        ("2", "2", "failed (no result.json: the job was killed)", ""),
    ]
    assert rows[0]["val/loss"] == "0.25" and rows[0]["held-out accuracy (after)"] == "0.5"
    assert "| 0 | 0 | finished | 2 | 0.5000 | 0.2500 | 0.7500 | 0.5000 | 0_method.divergence.beta=0,seed=1 |" in table
    assert (sweep / "summary.md").read_text() == table + "\n"


def test_a_sweep_of_study_runs_writes_its_study_tables(tmp_path):
    """Each job's result.json keeps its study record (StudyRecord); the sweep's study.json / study.md keep SFT's run at
    the rate its validation chose, with the sweep's command."""
    sweep = tmp_path / "sweep"
    for num, (lr, last_val, test) in enumerate([(1e-3, 0.5, 0.4), (3e-3, 0.6, 0.7)]):
        result = study_result("SFT", 0, lr, curve=[[50, 0.1], [100, last_val]], test=test)
        folder = fake_job(sweep, num, [f"optimizer.lr={lr}"], result)
        saved = json.loads((folder / "result.json").read_text())
        assert saved["study"] == result["study"] and saved["fit_seconds"] == 10.0
    task = ["experiment=study_addition", "recipe=sft", "optimizer.lr=1e-3,3e-3"]
    OmegaConf.save({"hydra": {"overrides": {"task": task}}}, sweep / "multirun.yaml")
    text = write_study(sweep)
    study = json.loads((sweep / "study.json").read_text())
    assert study["command"] == "lightning-gkd -m experiment=study_addition recipe=sft optimizer.lr=1e-3,3e-3"
    assert [(run["lr"], run["test_accuracy"]) for run in study["runs"]] == [(3e-3, 0.7)]
    assert (sweep / "study.md").read_text() == text
    assert "| SFT | what SFT is | 0.003 | 0.700 ± 0.000 (n=1) | 0.700 | 75.0% ± 0.0% |" in text


def test_a_sweep_without_study_runs_writes_no_study(tmp_path):
    sweep = tmp_path / "sweep"
    fake_job(sweep, 0, ["method.beta=0"], {"global_step": 2, "metrics": {}, "held_out": {}})
    assert write_study(sweep) is None and not (sweep / "study.md").exists()


def _env() -> dict[str, str]:
    drop = ("SLURM_", "SUBMITIT_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(drop)}, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_a_real_sweep_names_its_jobs_and_prints_the_summary(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_gkd.cli.train",
            "-m",
            "method.divergence.beta=0,1",
            *FAST,
            "paths.cache_dir=cache",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    (sweep,) = (tmp_path / "outputs" / "multirun").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [
        "0_method.divergence.beta=0",
        "1_method.divergence.beta=1",
    ]
    rows = read_csv(sweep / "summary.csv")
    assert [(r["job"], r["method.divergence.beta"], r["status"], r["steps"]) for r in rows] == [
        ("0", "0", "finished", "2"),
        ("1", "1", "finished", "2"),
    ]
    assert all(float(r["train/loss"]) > 0 and float(r["val/loss"]) > 0 for r in rows)
    assert f"== lightning_gkd sweep summary ({sweep.relative_to(tmp_path)}) ==" in result.stdout
    assert "| job | method.divergence.beta | status | steps | train/loss | val/loss |" in result.stdout
    assert (sweep / "summary.md").read_text().strip() in result.stdout
    assert json.loads((sweep / "0_method.divergence.beta=0" / "result.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_a_sweep_over_paths_with_slashes_whose_jobs_fail(tmp_path):
    """Values with slashes stay one folder each, and failed jobs are rows of the summary (Hydra then re-raises the
    first job's error, so the sweep's exit status is 1)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_gkd.cli.train",
            "-m",
            "data.train_data=missing/a.jsonl,missing/b.jsonl",
            *FAST,
            "paths.cache_dir=cache",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-4000:]
    (sweep,) = (tmp_path / "outputs" / "multirun").iterdir()
    names = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert names == ["0_data.train_data=missing_a.jsonl", "1_data.train_data=missing_b.jsonl"]
    rows = read_csv(sweep / "summary.csv")
    assert [(r["job"], r["data.train_data"]) for r in rows] == [("0", "missing/a.jsonl"), ("1", "missing/b.jsonl")]
    assert all(r["status"].startswith("failed: ") and "missing/" in r["status"] for r in rows), rows


@pytest.mark.parametrize("status", ["finished", "interrupted (Ctrl-C)"])
def test_job_results_name_how_the_run_ended(tmp_path, status):
    result = {"global_step": 3, "stop_signal": "SIGINT" if status != "finished" else None}
    result["stopped_by_signal"] = status != "finished"
    assert write_job_result(tmp_path, 0, [], result)["status"] == status
