"""Writes tests/fixtures/pre_restructure/: a checkpoint saved by the package before its restructure (commit
9cf2b9e's layout: lightning_gkd.modules.gkd, lightning_gkd.signals, ...) after step 3 of a 6-step tiny GKD run
with grouped generation (k=2, so step 3 falls inside a group), plus the uninterrupted run's per-step losses and coin
flips. tests/test_training_checkpoint_compat.py resumes from it with today's code and expects the same steps 3-5.

Run from the repository root: python tests/helpers/make_pre_restructure_checkpoint.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from omegaconf import open_dict

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path[:0] = [str(HERE), str(TESTS)]

from hydra_compose import compose_train  # noqa: E402
from test_training_exact_resume import per_step  # noqa: E402  (and its SigtermAt callback, by Hydra target)

OVERRIDES = [
    "model=tiny",
    "trainer.max_steps=6",
    "trainer.val_check_interval=100",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.steps_per_generation=2",
    "data.test_data=null",
    "method.lmbda=0.6",
    "method.max_new_tokens=6",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "print_config=false",
    "export=false",
    "scheduler.num_warmup_steps=2",
]
STOP_AFTER = 3


def main(out: Path) -> None:
    try:
        from lightning_gkd.cli.train import run
    except ImportError:  # the layout before the restructure
        from lightning_gkd.train import run

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.chdir(work)
        runs = {}
        for name, extra in [
            ("full", []),
            (
                "stopped",
                [
                    "+callbacks.sigterm._target_=test_training_exact_resume.SigtermAt",
                    f"+callbacks.sigterm.step={STOP_AFTER}",
                ],
            ),
        ]:
            cfg = compose_train(work, [*OVERRIDES, *extra])
            with open_dict(cfg):
                cfg.paths.output_dir = str(work / "runs" / name)
            run(cfg)
            runs[name] = work / "runs" / name
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(runs["stopped"] / "checkpoints" / "last.ckpt", out / "last.ckpt")
        expected = {
            "overrides": OVERRIDES,
            "stopped_after_step": STOP_AFTER,
            "loss": per_step(runs["full"], "train/loss"),
            "on_policy": per_step(runs["full"], "train/on_policy"),
        }
        (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    # an argument writes elsewhere (to try the script without replacing the fixture written by the old layout)
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else TESTS / "fixtures" / "pre_restructure")
