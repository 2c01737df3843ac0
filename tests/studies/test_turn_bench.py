"""lightning_gkd.studies.turn_bench and scripts/bench_turns.py at toy sizes (``--tiny``): the same code as the
measurement, in seconds; the figures are not a measurement."""

from __future__ import annotations

import json

from helpers.scripts import run_script

from lightning_gkd.studies.turn_bench import SETTINGS, TurnBenchConfig, page, run


def test_the_tiny_bench_compares_both_settings_turn_by_turn():
    config = TurnBenchConfig(tiny=True, batch=3, prompt_min=5, prompt_max=9, new_tokens=4, reply_tokens=3, repeats=1)
    result = run(config)
    assert result["transcripts_equal"] and result["prompt_lengths"] == [5, 7, 9]
    turns = result["per_turn"]
    assert [row["turn"] for row in turns] == [1, 2, 3, 4]
    # turn 1 prefills the prompts in both; later, reuse prefills each row's last sampled token and the reply
    assert turns[0]["reuse_reused_tokens"] == 0 and turns[0]["reuse_prefill_tokens"] == 21
    for k, row in enumerate(turns[1:], start=1):
        assert row["reuse_prefill_tokens"] == 3 * (1 + 3)
        assert row["re-prefill_prefill_tokens"] == 21 + 3 * k * (4 + 3)
        assert row["reuse_reused_tokens"] + row["reuse_prefill_tokens"] == row["re-prefill_prefill_tokens"]
    assert all(len(result["timings"][name]) == 1 for name in SETTINGS)
    text = page(result, command="python scripts/bench_turns.py --tiny", load="low", minutes=0.1)
    assert "| whole rollout |" in text and "equal token for token" in text


def test_the_script_writes_the_page_and_its_figures(tmp_path):
    run_script("bench_turns.py", "--tiny", "--repeats", "1", "--out", str(tmp_path), cwd=tmp_path, timeout=600)
    saved = json.loads((tmp_path / "benchmarks_turns.json").read_text())
    assert saved["transcripts_equal"] and len(saved["per_turn"]) == 4
    assert (tmp_path / "benchmarks_turns.md").read_text().startswith("# Benchmark: KV reuse across the turns")
