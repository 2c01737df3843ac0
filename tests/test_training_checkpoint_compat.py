"""Checkpoints written before the package restructure still resume: tests/fixtures/pre_restructure/last.ckpt was
saved by the old layout (lightning_gkd.modules.gkd, ...) after step 3 of a 6-step grouped-generation run, in the
middle of an on-policy group (tests/helpers/make_pre_restructure_checkpoint.py). Resumed with today's code, steps
3-5 repeat the uninterrupted old run's losses and coin flips."""

import csv
import json
import shutil
from pathlib import Path

from helpers.hydra_compose import compose_train
from omegaconf import open_dict

from lightning_gkd.cli.train import run

FIXTURE = Path(__file__).parent / "fixtures" / "pre_restructure"


def test_a_checkpoint_from_before_the_restructure_resumes_exactly(tmp_path, monkeypatch):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "old.ckpt"
    shutil.copy(FIXTURE / "last.ckpt", ckpt)
    # the run as it was configured then: float32 teacher, exact sampling, for-loop AdamW (today's defaults differ)
    then = ["method.frozen_dtype=float32", "sampler.matmul_precision=highest", "optimizer.fused=false"]
    cfg = compose_train(tmp_path, [*expected["overrides"], *then, f"ckpt_path={ckpt}"])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "resumed")
    run(cfg)

    with open(tmp_path / "resumed" / "logs" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train/loss")]
    resumed = {int(row["step"]): float(row["train/loss"]) for row in rows}
    flips = {int(row["step"]): float(row["train/on_policy"]) for row in rows}
    stop = expected["stopped_after_step"]
    want = {int(step): value for step, value in expected["loss"].items() if int(step) >= stop}
    assert sorted(resumed) == sorted(want) == list(range(stop, 6))
    for step, value in want.items():
        assert abs(resumed[step] - value) <= 1e-6 * max(1.0, abs(value)), (step, resumed[step], value)
    assert flips == {int(step): value for step, value in expected["on_policy"].items() if int(step) >= stop}
    assert any(flips.values())  # the resumed group is an on-policy one: its saved samples were restored
