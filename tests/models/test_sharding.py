"""FSDP2 (trainer=fsdp: ModelParallelStrategy + CausalLMModule.configure_model) with 2 CPU processes (gloo).

tests/helpers/fsdp_worker.py runs the two ranks (Lightning re-runs that script for rank 1) and replays the run unsharded
in one process; these tests check what it measured.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import HELPERS

WORKER = HELPERS / "fsdp_worker.py"

pytestmark = pytest.mark.multiprocess


def run_worker(out: Path, checkpoint: str) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # a clean launcher
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out), checkpoint],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> dict:
    return run_worker(tmp_path_factory.mktemp("fsdp") / "run", "file")


def test_sharded_training_matches_one_unsharded_process(sharded_run):
    r = sharded_run
    assert r["strategy"] == "ModelParallelStrategy" and r["world_size"] == 2
    # per step: mean of the two ranks' losses (sharded) vs the same batches in one unsharded process; the last
    # step is the run resumed from last.ckpt
    assert len(r["sharded_losses"]) == 4
    for sharded, reference in zip(r["sharded_losses"], r["reference_losses"], strict=True):
        assert sharded == pytest.approx(reference, rel=1e-4, abs=1e-7)
    assert r["logits_vs_reference"] < 1e-4  # the trained student, gathered, vs the unsharded replay


def test_each_rank_holds_half_of_each_model(sharded_run):
    for who in ("student_shards", "teacher_shards"):
        for rank in sharded_run[who]:
            assert rank["all_dtensor"] and rank["all_shard0"]
            assert abs(rank["local_numel"] / rank["full_numel"] - 0.5) < 0.01, (who, rank)
        assert sum(rank["local_numel"] for rank in sharded_run[who]) == sharded_run[who][0]["full_numel"]


def test_teacher_is_never_trained(sharded_run):
    r = sharded_run
    assert r["teacher_max_change"] == 0.0 and r["teacher_grads"] == 0 and r["teacher_requires_grad"] == 0
    assert r["teacher_training"] is False
    assert r["optimizer_params"] == r["student_params"] and not r["optimizer_has_teacher"]


def test_sampling_and_clipping_while_sharded(sharded_run):
    r = sharded_run
    assert r["completion_lengths"] and all(n > 0 for n in r["completion_lengths"])  # lmbda=1: student samples
    # the same total norm on both ranks (reduced over the shards), at most the limit after clipping
    assert r["clipping"][0] == r["clipping"][1]
    assert any(before > 0.05 for before, _ in r["clipping"][0])  # clipping was active
    for before, after in r["clipping"][0]:
        assert after <= 0.05 * (1 + 1e-4) and after == pytest.approx(min(before, 0.05), rel=1e-4)
    timing = r["sampling_seconds_16_tokens"]
    assert timing["sharded"] < 50 * timing["unsharded"] + 1.0  # decoding a sharded model is not pathological


def test_checkpoint_holds_the_student_only_and_resumes(sharded_run):
    r = sharded_run
    assert r["checkpoint_is_dir"] is False  # save_distributed_checkpoint=False: one file
    keys = r["checkpoint_keys"]
    assert keys and all(k.startswith("state_dict.model.") for k in keys)
    assert not any(".teacher." in k or k.startswith("state_dict.teacher") for k in keys)
    assert r["resumed_global_step"] == 4 and r["resumed_logits_vs_reference"] < 1e-4


def test_export_reloads_with_the_trained_weights(sharded_run):
    assert "model.safetensors" in sharded_run["export_files"] and "config.json" in sharded_run["export_files"]
    assert sharded_run["export_logits_vs_sharded"] < 1e-5


def test_lean_loss_uses_the_gathered_head_weight(sharded_run):
    for rank in sharded_run["lean_head"]:
        assert rank["student_head_after_forward"] == "Parameter"  # root unit still gathered after its forward
        assert rank["teacher_head_after_nograd_forward"] == "Parameter"
        assert rank["teacher_head_after_reshard_is_dtensor"]
        assert rank["loss_diff"] < 1e-5 and rank["grad_max_abs_diff"] < 1e-6


def test_distributed_checkpoint_folder_resumes(tmp_path):
    r = run_worker(tmp_path / "run", "distributed")
    assert r["checkpoint_is_dir"] is True
    assert not any("teacher" in k for k in r["checkpoint_keys"])
    assert any(k.startswith("optimizer_0") for k in r["checkpoint_keys"])
    assert r["resumed_global_step"] == 4 and r["resumed_logits_vs_reference"] < 1e-4
    assert r["sharded_losses"][-1] == pytest.approx(r["reference_losses"][-1], rel=1e-4, abs=1e-7)
