"""lightning_gkd.studies.async_bench's summary and page from measured figures (the runs themselves need vLLM: the smoke
run of scripts/bench_async.py is in tests/asynchronous/test_vllm_process.py)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from lightning_gkd.studies.async_bench import SHAPES, BenchConfig, page, summarise


def result(shape, staleness, *, repeat: int, sample: float, train: float, idle: float) -> dict:
    step = train + idle
    config = BenchConfig(shape, staleness, steps=10, warmup=2, trainer_cpus=(0,), engine_cpus=(1,))
    return {
        **asdict(config),
        "steps_per_second": 1 / step,
        "step_seconds": step,
        "sample_seconds": sample,
        "idle_seconds": idle,
        "train_seconds": train,
        "weight_load_seconds": 0.01,
        "snapshot_seconds": 0.001,
        "producer_idle_seconds": 0.0,
        "staleness_mean": float(staleness or 0),
        "dropped": 0.0,
        "repeat": repeat,
    }


def test_the_summary_takes_medians_and_compares_each_run_with_staleness_zero_and_the_in_process_run():
    balanced = SHAPES[0]
    runs = [
        result(balanced, None, repeat=0, sample=0.1, train=0.2, idle=0.1),  # 3.33 steps/s
        result(balanced, 0, repeat=0, sample=0.2, train=0.2, idle=0.2),  # 2.5
        result(balanced, 0, repeat=1, sample=0.2, train=0.2, idle=0.3),  # 2.0: the median of 2.5 and 2.0 is 2.25
        result(balanced, 1, repeat=0, sample=0.2, train=0.25, idle=0.0),  # 4.0
        result(balanced, 1, repeat=1, sample=0.2, train=0.25, idle=0.0),
    ]
    summary = summarise(runs)[balanced.name]
    medians = summary["medians"]
    assert medians["0"]["steps_per_second"] == pytest.approx(2.25)
    assert medians["1"]["speedup_vs_staleness0"] == pytest.approx(4.0 / 2.25)
    assert medians["1"]["speedup_vs_sync"] == pytest.approx(4.0 / (1 / 0.3))
    assert summary["ideal_speedup"] == pytest.approx((0.2 + 0.2) / 0.2) and summary["repeats"] == 2


def test_the_page_says_whether_staleness_one_meets_the_target_and_where_the_time_goes():
    balanced = SHAPES[0]
    runs = [
        result(balanced, 0, repeat=0, sample=0.2, train=0.2, idle=0.2),
        result(balanced, 1, repeat=0, sample=0.22, train=0.25, idle=0.0),
    ]
    text = page(summarise(runs), command="python scripts/bench_async.py", machine="m", minutes=1.0, steps=10, warmup=2)
    assert "1.60× the steps per second of max_staleness 0" in text and "(meets the 1.5× target" in text
    assert "sampling takes 1.10× and training 1.25× their time at max_staleness 0" in text
    slow = [
        result(balanced, 0, repeat=0, sample=0.2, train=0.2, idle=0.2),
        result(balanced, 1, repeat=0, sample=0.2, train=0.3, idle=0.0),
    ]
    assert "(misses the 1.5× target" in page(summarise(slow), command="c", machine="m", minutes=1.0, steps=10, warmup=2)
