"""scripts/device_check.py --dry-run: every part of the prepared GPU check runs on CPU at toy sizes and the JSON and
markdown reports are written (docs/developing.md, "A prepared GPU check"). This keeps the script working between
GPU runs; it says nothing about speed."""

import json
import math
import subprocess
import sys

import pytest
from helpers.paths import ROOT

pytestmark = pytest.mark.slow  # a script smoke run

PARTS = {
    "default_job",
    "methods",
    "lean_memory",
    "sampler",
    "bench_trl",
    "step_profile",
    "step_profile_cpu_built",
    "fsdp",
    "teacher_cache",
}


def test_dry_run_runs_every_part_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "device_check.json").read_text())
    parts = report["parts"]
    assert set(parts) == PARTS
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(PARTS, "ok"), {
        name: part.get("error", "")[-1500:] for name, part in parts.items()
    }
    assert all(part["seconds"] > 0 for part in parts.values())
    assert report["meta"]["dry_run"] and report["meta"]["device"].startswith("CPU dry run")
    r = {name: part["results"] for name, part in parts.items()}

    assert r["default_job"]["steps"] == 2 and math.isfinite(r["default_job"]["train/loss"])
    assert r["default_job"]["command"] == "lightning-gkd trainer=cpu trainer.max_steps=2 trainer.val_check_interval=2"
    assert set(r["methods"]) == {"gkd (lambda 1)", "opd", "sft", "dpo"}
    for row in [*r["methods"].values(), r["fsdp"]]:
        assert row["steps"] == 2 and row["s_per_step"] > 0 and math.isfinite(row["loss"])
        assert row["peak_gpu_gb"] is None  # a GPU measurement: left out on CPU
    assert r["methods"]["dpo"]["loss"] == pytest.approx(math.log(2), abs=0.05)  # the reference is the policy's copy
    assert r["fsdp"]["student_sharded"] is True

    lean = r["lean_memory"]
    assert lean["lean"]["lean_taken"] and not lean["full"]["lean_taken"]
    assert lean["loss_rel_diff"] < 1e-3 and lean["full"]["added_gpu_gb"] is None and "note" in lean
    grid = [(2, 4), (4, 8)]  # the dry run's cells of the GPU grid (batch x new tokens)
    decode = r["sampler"]
    assert [(cell["batch"], cell["new_tokens"]) for cell in decode.values()] == grid
    for cell in decode.values():
        for name in ("ours", "hf_generate"):  # three interleaved repetitions' tokens, the first call timed apart
            assert cell[name]["tokens"] == 2 * cell["batch"] * cell["new_tokens"]
            assert cell[name]["tokens_per_s"] > 0 and cell[name]["first_call_s"] > 0
        assert cell["decoder"] == "DynamicKVDecoder"  # the CPU default; compiled on CUDA
    cells = r["bench_trl"]["cells"]
    assert [(cell["batch"], cell["new_tokens"]) for cell in cells.values()] == grid
    for cell in cells.values():
        assert cell["ours"]["mfu"] is None and len(cell["trl_distill"]["s_per_step_reps"]) == 2
        assert cell["ours_over_trl"] == pytest.approx(cell["ours"]["s_per_step"] / cell["trl_distill"]["s_per_step"])
        assert cell["ours_phases_s"]["sample"] > 0 and cell["ours_phases_s"]["backward"] > 0
    for name in ("step_profile", "step_profile_cpu_built"):
        profile = r[name]
        means = profile["mean_s"]
        phases = ("sampling", "teacher_forward", "student_forward_and_loss", "backward", "optimizer_and_logging")
        assert all(means[phase] > 0 for phase in phases), means
        assert sum(means[phase] for phase in phases) == pytest.approx(means["step"], rel=0.1)
        assert profile["lean_taken"] and "syncs_in_profiled_step" not in profile  # syncs are counted on CUDA only
        assert profile["top_self_cpu_ms"] and profile["profiled_step_s"] > 0
    assert "| sampling | " in (out / "device_check.md").read_text()
    cache = r["teacher_cache"]
    assert cache["topk"]["tokens"] == cache["hidden_bf16"]["tokens"] > 0  # the same rows, two signals
    assert (out / "cache_hidden_bf16" / "head.safetensors").is_file()

    table = (out / "device_check.md").read_text()
    assert "| default_job | ok |" in table and "| gkd under FSDP2 | 2 |" in table
    assert "| hidden_bf16 | " in table and "| 4 | 8 | " in table and "x | DynamicKVDecoder |" in table
