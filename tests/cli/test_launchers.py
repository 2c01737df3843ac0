"""Scale-out launchers: Hydra's submitit launcher (hydra/launcher=slurm|local) and the shipped sbatch script
(lightning_gkd/assets/slurm/train.sbatch, what `lightning-gkd-sbatch` prints).

No SLURM cluster here: the SLURM launcher is checked through the sbatch script submitit renders from our config,
the local launcher by a real multirun, and the sbatch script by running it with a fake `srun` (runs its
arguments) and `scontrol` (records them) under a fake single-task SLURM job, which Lightning takes for real SLURM.
"""

import csv
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit
import torch
from helpers.hydra_compose import compose_train
from helpers.paths import ROOT
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

SBATCH = ROOT / "lightning_gkd" / "assets" / "slurm" / "train.sbatch"
FAST = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.val_batch_size=8",
    "method.sampling.max_new_tokens=4",
    "print_config=false",
    "callbacks.held_out_eval=null",
]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("SLURM_", "SUBMITIT_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def test_slurm_launcher_maps_the_trainer_onto_the_job(tmp_path, monkeypatch):
    cfg = compose_train(tmp_path, ["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=2", "trainer.devices=4"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
    assert launcher.signal_delay_s == 90 and launcher.max_num_timeout == 0
    assert launcher.partition is None

    # The sbatch script submitit writes for this config, built as the launcher builds it ("on a cluster": srun).
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    plugin = instantiate(launcher)
    params = dict(plugin.params)
    params.pop("submitit_folder")
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=tmp_path / "submitit", slurm_max_num_timeout=params.pop("max_num_timeout")
    )
    base = set(OmegaConf.structured(submitit_conf().BaseQueueConf).keys())
    executor.update_parameters(**{key if key in base else f"slurm_{key}": value for key, value in params.items()})
    script = executor._executor._make_submission_file_text("python -m lightning_gkd.cli.train", "0")
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --signal=USR1@90",
        "#SBATCH --requeue",
        "#SBATCH --time=240",
    ]:
        assert line in script.splitlines(), (line, script)
    assert "USR2" not in script  # one owner of requeue: Lightning (SIGUSR1), not submitit
    assert "--partition" not in script

    local = compose_train(tmp_path, ["hydra/launcher=local"]).hydra.launcher
    assert local._target_.endswith("LocalLauncher") and local.tasks_per_node == 1 and local.timeout_min == 60


def submitit_conf():
    from hydra_plugins.hydra_submitit_launcher import config

    return config


@pytest.mark.multiprocess
def test_local_submitit_multirun_runs_every_job(tmp_path, monkeypatch):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_gkd.cli.train",
            "-m",
            "hydra/launcher=local",
            "method.divergence.beta=0,1",
            *FAST,
            f"paths.cache_dir={tmp_path}/cache",
        ],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    (sweep,) = (tmp_path / "outputs" / "multirun").iterdir()
    jobs = sorted(path for path in sweep.iterdir() if (path / ".hydra").is_dir())
    assert [job.name for job in jobs] == [
        "0_method.divergence.beta=0",
        "1_method.divergence.beta=1",
    ]  # named by the swept key
    for job, beta in zip(jobs, [0, 1], strict=True):
        assert OmegaConf.load(job / ".hydra" / "config.yaml").method.divergence.beta == beta
        assert (job / "student" / "model.safetensors").is_file()
        assert max(int(row["step"]) for row in _metrics(job)) == 2
        assert (job / "checkpoints" / "last.ckpt").is_file()
    submitted = sorted(sweep.glob(".submitit/*/*_submitted.pkl"))
    assert len(submitted) == 2  # each sweep point ran as its own submitit job
    # each job wrote its result in its own process; the launching process summarized and printed them
    with open(sweep / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["method.divergence.beta"], row["status"], row["steps"]) for row in rows] == [
        ("0", "0", "finished", "2"),
        ("1", "1", "finished", "2"),
    ]
    assert "== lightning_gkd sweep summary" in result.stdout and "| 1 | 1 | finished | 2 |" in result.stdout

    # A requeued job re-runs its pickled submission later: it must land in the same job directory (the sweep
    # dir's ${now:...} was resolved at submission and its cache travels in the pickle).
    time.sleep(1.1)
    monkeypatch.chdir(tmp_path)  # where the requeued job runs (the sweep folder's multirun.yaml names the swept keys)
    from hydra.core.singleton import Singleton
    from hydra.core.utils import setup_globals

    for path in submitted:
        with open(path, "rb") as handle:
            delayed = cloudpickle.load(handle)
        overrides, _, num, _, singletons = delayed.args
        Singleton.set_state(singletons)
        setup_globals()
        launcher = delayed.function
        again = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        with open_dict(again.hydra.job):
            again.hydra.job.num = num
        assert tmp_path / again.hydra.sweep.dir / str(again.hydra.sweep.subdir) == jobs[num]


def _fake_slurm(tmp_path: Path, job_id: str) -> dict[str, str]:
    """A fake single-task SLURM job: srun runs its arguments (recording the pid), scontrol records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scripts = {
        "srun": '#!/bin/bash\necho $$ > "$FAKE_SLURM_DIR/srun.pid"\nexec "$@"\n',
        "scontrol": '#!/bin/bash\necho "$@" >> "$FAKE_SLURM_DIR/scontrol.log"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    return _clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_DIR=str(tmp_path),
        PYTHON=sys.executable,
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NAME="lightning-gkd",
        SLURM_NNODES="1",
        SLURM_NTASKS="1",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_NODELIST="localhost",
        MASTER_PORT="29671",
    )


def test_sbatch_script_lines():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    for line in [
        "#SBATCH --signal=SIGUSR1@90",
        "#SBATCH --requeue",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
    ]:
        assert line in text.splitlines()
    assert 'hydra.run.dir="$run_dir"' in text and 'trainer.devices="$SLURM_NTASKS_PER_NODE"' in text


@pytest.mark.multiprocess
def test_sbatch_requeue_resumes_in_the_job_directory(tmp_path):
    """SIGUSR1 -> Lightning saves hpc_ckpt_1.ckpt and calls `scontrol requeue <job id>`; SLURM's SIGTERM -> the
    step finishes, last.ckpt is saved, exit 0; the requeued script resumes in outputs/slurm/<job id>."""
    env = _fake_slurm(tmp_path, "4242")
    command = ["bash", str(SBATCH), *FAST, f"paths.cache_dir={tmp_path}/cache", "callbacks.sample_table=null"]
    run_dir = tmp_path / "outputs" / "slurm" / "4242"
    # Far more steps than it will take: the signals stop it.
    first = subprocess.Popen(
        [*command, "trainer.max_steps=5000"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "last.ckpt").is_file():  # training is under way (step 2 saved)
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-4000:]
            time.sleep(0.2)
        pid = int((tmp_path / "srun.pid").read_text())
        os.kill(pid, signal.SIGUSR1)  # what --signal=SIGUSR1@90 sends before the time limit
        while not (tmp_path / "scontrol.log").is_file():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-4000:]
            time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)  # what SLURM sends when the requeue takes the job off its node
        output, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, output[-4000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert (run_dir / "hpc_ckpt_1.ckpt").is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert "Handling auto-requeue signal" in output and "not exported" in output
    assert not (run_dir / "student").exists()
    stopped_at = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 2 <= stopped_at < 5000

    # The requeued job: same job id, same script; it picks the newest checkpoint of outputs/slurm/4242.
    second = subprocess.run(
        [*command, f"trainer.max_steps={stopped_at + 2}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-4000:]
    assert f"resuming from {run_dir.relative_to(tmp_path)}/checkpoints/last.ckpt" in second.stdout
    assert f"steps: {stopped_at + 2}" in second.stdout and (run_dir / "student" / "model.safetensors").is_file()
    assert [path.name for path in (tmp_path / "outputs" / "slurm").iterdir()] == ["4242"]  # one stable run dir
