"""lightning_gkd.cli.bench_worker at toy sizes, in this process: one configuration's timed steps, the floor of an
on-policy step, and the probe the ``lightning-gkd`` command gets (the speed figures are docs/benchmarks*.md's)."""

import json

import pytest

from lightning_gkd.cli.bench_worker import StepEndsFile, floor, measurement
from lightning_gkd.studies.bench_models import bench_shape

TINY = bench_shape("small", tiny=True)


def test_our_steps_are_timed_between_optimizer_step_ends():
    result = measurement("ours", 1.0, 1, 2, TINY, "cpu")
    assert result["steps"] == 2 and result["group"] == 1 and result["seconds_per_step"] > 0
    assert result["peak_rss_mb"] >= result["baseline_rss_mb"] > 0
    assert result["first_step_seconds"] > result["models_seconds"] > 0


def test_the_floor_adds_its_parts_from_the_shape_and_measured_rates():
    result = floor(TINY, "cpu")
    assert set(result["parts"]) == {"sample", "teacher forward", "student forward + backward", "optimizer"}
    assert all(value > 0 for value in result["parts"].values())
    shapes = result["shapes"]
    assert shapes["supervised"] == TINY.batch * TINY.new_tokens
    assert shapes["tokens"] == TINY.batch * (shapes["prompt tokens"] + TINY.new_tokens)
    # 28 bytes of AdamW state traffic per student parameter at the measured copy rate
    copy = result["rates"]["copy GB/s"] * 1e9
    assert result["parts"]["optimizer"] == pytest.approx(28 * shapes["student parameters"] / copy)


def test_an_unknown_measurement_names_the_known_ones():
    with pytest.raises(ValueError, match="Unknown bench measurement 'fastest'"):
        measurement("fastest", 1.0, 1, 1, TINY, "cpu")


def test_the_command_probe_records_the_baseline_then_each_step_end(tmp_path):
    probe = StepEndsFile(str(tmp_path / "steps.jsonl"))
    probe.on_train_start(None, None)
    probe.on_train_batch_end(None, None)
    probe.on_train_batch_end(None, None)
    first, *ends = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert first["baseline_rss_mb"] > 0 and len(ends) == 2 and ends[0]["end"] <= ends[1]["end"]
