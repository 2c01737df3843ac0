"""docs/results.md's toy studies (addition, chain, the toy vision task): SFT vs supervised KD vs SeqKD vs on-policy
GKD and OPD, run as ``lightning-gkd -m`` sweeps of recipes (conf/recipe) x seeds x learning rates, and their page
sections.

Every run starts from the task's shipped student and distils its shipped teacher with the same budget
(conf/experiment/study_addition.yaml, study_chain.yaml); each recipe's learning rate is the best validation accuracy
on the first seed, every seed is reported at that rate (lightning_gkd.studies.study). The chain study adds a
low-data arm (5% of the training rows) for SFT, supervised KD, GKD β=1 and OPD at their chosen rates, and two arms
against a teacher served with one log-prob per token (the stand-in server, lightning_gkd.testing.fake_vllm_server).

    python scripts/reproduce_gkd.py --task addition     # its sweeps, then docs/results.json and the addition section
    python scripts/reproduce_gkd.py --task chain        # docs/results_chain.json and the chain section
    python scripts/reproduce_gkd.py --task vlm          # docs/results_vlm.json and the toy vision section
    python scripts/reproduce_gkd.py --task chain --sweep outputs/multirun/<folder> ...  # sweeps you ran yourself
    python scripts/reproduce_gkd.py --rerender          # both sections (and plots) from docs/results*.json
    python scripts/reproduce_gkd.py --task chain --fast --out /tmp/repro   # 1 seed, 1 rate, 6 steps: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from lightning_gkd.cli.sweep import collect_jobs, sweep_command
from lightning_gkd.studies.results_page import write_section
from lightning_gkd.studies.study import merged_study, study_from_jobs
from lightning_gkd.toy.tasks import toy_task
from lightning_gkd.toy.tiny import asset_path

REPO = Path(__file__).resolve().parents[1]
#: task -> its JSON under --out
RESULTS = {"addition": "results.json", "chain": "results_chain.json", "vlm": "results_vlm.json"}
#: task -> the sweeps of its study: (recipes, learning rates); a served-teacher recipe gets its own sweep
GRIDS = {
    "addition": [
        (
            "sft,supervised_kd,seqkd,gkd_beta0,gkd_beta05,gkd_beta09,gkd_beta1,mixed_lambda05,skd_k5,skd_k25,"
            "skd_k5_lambda05",
            "3e-4,1e-3,3e-3",
        )
    ],
    "chain": [
        ("sft,seqkd,supervised_kd", "3e-4,1e-3,3e-3,1e-2"),  # the off-policy methods' best rate was the grid's top
        ("gkd_beta0,gkd_beta05,gkd_beta1,mixed_lambda05,skd_k5,skd_k25,skd_k5_lambda05", "3e-4,1e-3,3e-3"),
        # a single-sample policy gradient is far noisier than the full-distribution losses: its sweep sits lower
        ("opd,opd_gamma1,opd_gamma1_normalised,opd_gamma1_normalised_baseline", "1e-4,3e-4,1e-3"),
        ("opd_top1_server", "1e-4,3e-4,1e-3"),
        ("gkd_top1_server", "3e-4,1e-3,3e-3"),
    ],
    # the toy vision task (experiment=study_vlm): the three arms
    "vlm": [("sft,supervised_kd,gkd_beta0", "1e-3,3e-3")],
}
SEEDS = {"addition": "0,1,2,3,4", "chain": "0,1,2", "vlm": "0,1,2"}
LOW_DATA = {"chain": ("SFT", "Supervised KD", "GKD β=1", "OPD")}  # recipe names at their chosen rates
LOW_DATA_ROWS = 2500  # 5% of the chain task's 50,000 training rows
RECIPE_FILES = {"SFT": "sft", "Supervised KD": "supervised_kd", "GKD β=1": "gkd_beta1", "OPD": "opd"}
FAST = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "+data.train_data.num_rows=256",
    "+data.val_data.num_rows=32",
    "+data.test_data.num_rows=64",
]


def multirun(overrides: list[str], sweep_dir: Path) -> str:
    """Run ``lightning-gkd -m <overrides>`` into ``sweep_dir`` (its output in ``sweep_dir``.log); its command."""
    command = [sys.executable, "-m", "lightning_gkd.cli.train", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"]
    sweep_dir.parent.mkdir(parents=True, exist_ok=True)
    print(" ".join(["lightning-gkd -m", *overrides]), flush=True)
    with open(f"{sweep_dir}.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = Path(f"{sweep_dir}.log").read_text()[-3000:]
        raise SystemExit(f"the sweep into {sweep_dir} failed ({done.returncode}):\n{tail}")
    return " ".join(["lightning-gkd -m", *overrides])


class ServedTeacher:
    """The stand-in vLLM server of the task's teacher with one log-prob per token, as a process (its URL)."""

    def __init__(self, task: str, log: Path) -> None:
        teacher = asset_path(f"{toy_task(task).assets}/teacher")
        command = [sys.executable, "-m", "lightning_gkd.testing.fake_vllm_server", "--model", teacher]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as errors:
            self.process = subprocess.Popen(
                [*command, "--max-logprobs", "1"], stdout=subprocess.PIPE, stderr=errors, text=True
            )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("serving "):
            self.process.kill()
            raise SystemExit(f"the stand-in server did not start: {line!r}")
        self.url = line.split(" at ")[-1].strip()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def run_study(task: str, work: Path, *, fast: bool, recipes: list[str] | None) -> list[Path]:
    """The study's sweeps into ``work`` (then its low-data arm at the chosen rates); the sweep folders."""
    base = [f"experiment=study_{task}", "print_config=false", *(FAST if fast else [])]
    seeds = SEEDS[task].split(",")[0] if fast else SEEDS[task]
    folders, server = [], None
    try:
        for index, (grid, lrs) in enumerate(GRIDS[task]):
            chosen = [r for r in grid.split(",") if recipes is None or r in recipes]
            if not chosen:
                continue
            extra = []
            if any(name.endswith("_server") for name in chosen):
                server = server or ServedTeacher(task, work / "server.log")
                extra.append(f"teacher.url={server.url}")
            folder = work / f"sweep{index}"
            rates = lrs.split(",")[0] if fast else lrs
            multirun([*base, f"recipe={','.join(chosen)}", f"seed={seeds}", f"optimizer.lr={rates}", *extra], folder)
            folders.append(folder)
    finally:
        if server is not None:
            server.stop()
    if task in LOW_DATA:
        study = study_from_jobs([job for folder in folders for job in collect_jobs(folder, final=True)])
        rates = {run["method"]: run["lr"] for run in study["runs"]}
        names = [name for name in LOW_DATA[task] if name in rates]
        rows = 16 if fast else LOW_DATA_ROWS
        for lr in dict.fromkeys(rates[name] for name in names):
            group = ",".join(RECIPE_FILES[name] for name in names if rates[name] == lr)
            folder = work / f"low_data_{lr:g}"
            low = [f"recipe={group}", f"seed={seeds}", f"optimizer.lr={lr:g}", "study.arm=low-data"]
            low += [o for o in base if not o.startswith("+data.train_data")] + [f"+data.train_data.num_rows={rows}"]
            multirun(low, folder)
            folders.append(folder)
    return folders


def write_from_sweeps(task: str, folders: list[Path], out: Path, *, add: bool, seconds: float | None) -> None:
    """``task``'s study from the sweep folders: its JSON under ``out`` (merged into the earlier one with ``add``) and
    its results.md section with plots."""
    jobs = [job for folder in folders for job in collect_jobs(folder, final=True)]
    commands = [sweep_command(folder) or f"(a sweep in {folder})" for folder in folders]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    study = study_from_jobs(jobs, command=" && ".join(commands), machine=machine)
    if seconds is not None:
        study["seconds"] = seconds
    path = out / RESULTS[task]
    if add:
        study = merged_study(json.loads(path.read_text()), study)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(study, indent=2) + "\n" if task == "addition" else json.dumps(study))
    write_section(out, study)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(RESULTS), default="addition")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="where results.md and the JSON go")
    parser.add_argument("--work", type=Path, default=None, help="the sweeps' folder (default: <out>/.sweeps/<task>)")
    parser.add_argument("--sweep", type=Path, nargs="+", help="read these sweep folders instead of running the study")
    parser.add_argument("--recipes", nargs="+", default=None, help="run only these recipes (conf/recipe names)")
    parser.add_argument("--add", action="store_true", help="merge into <out>'s JSON: its other methods stay")
    parser.add_argument("--rerender", action="store_true", help="rewrite both sections from <out>/results*.json")
    parser.add_argument("--fast", action="store_true", help="1 seed, 1 rate, 6 steps, few rows: a smoke test")
    args = parser.parse_args(argv)
    if args.rerender:
        for name in RESULTS.values():
            if (args.out / name).exists():
                write_section(args.out, json.loads((args.out / name).read_text()))
        return 0
    started = time.perf_counter()
    folders = args.sweep or run_study(
        args.task, args.work or args.out / ".sweeps" / args.task, fast=args.fast, recipes=args.recipes
    )
    seconds = None if args.sweep else time.perf_counter() - started
    write_from_sweeps(args.task, folders, args.out, add=args.add, seconds=seconds)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
