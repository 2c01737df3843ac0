"""DDP from a shell: `python -m lightning_gkd.cli.train trainer=ddp trainer.devices=2 trainer.accelerator=cpu`.

Lightning's launcher re-runs the command for local rank 1 with the parent's `hydra.run.dir`, so both ranks must
share one run directory (`${now:...}` is resolved once, in the parent) and only rank zero exports and reports.
"""

import csv
import os
import subprocess
import sys

import pytest

FAST_DDP = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=8",
    "method.sampling.max_new_tokens=4",
    "print_config=false",
]


@pytest.mark.multiprocess
def test_ddp_on_cpu_from_the_command_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in [
        name
        for name in env
        if name.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "GROUP_RANK"))
    ]:
        env.pop(name)  # a plain shell: Lightning starts rank 1 itself
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_gkd.cli.train",
            "trainer=ddp",
            "trainer.devices=2",
            "trainer.accelerator=cpu",
            *FAST_DDP,
            f"paths.cache_dir={tmp_path}/cache",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "Starting with 2 processes" in result.stderr + result.stdout  # really two ranks

    runs = [path for path in (tmp_path / "outputs" / "runs").iterdir()]
    assert len(runs) == 1, runs  # rank 1 wrote into the parent's run directory, not a new timestamp
    run_dir = runs[0]
    assert (run_dir / "train_ddp_process_1.log").is_file()  # rank 1's Hydra log: it ran in this directory
    assert (run_dir / "student" / "model.safetensors").is_file() and (run_dir / "held_out.json").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "checkpoints" / "step4.ckpt").is_file()
    # only rank zero reports and exports (both ranks share this stdout)
    assert result.stdout.count("== lightning_gkd summary ==") == 1
    assert result.stdout.count("trained model exported to:") == 1
    assert f"trained model exported to: {run_dir / 'student'}" in result.stdout

    with open(run_dir / "logs" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert max(int(row["step"]) for row in rows) == 4  # global step reached trainer.max_steps
    assert len([row for row in rows if row.get("train/loss")]) == 4  # one training row per step, rank 0 only
    assert "devices: 2" in (run_dir / ".hydra" / "config.yaml").read_text()
