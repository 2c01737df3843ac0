"""Hand-made jobs of a study sweep: what `lightning-gkd -m experiment=study_* recipe=...` writes into each job's
result.json (``lightning_gkd.cli.sweep.write_job_result`` with ``StudyRecord``'s ``study``), with figures chosen by
the test."""

from __future__ import annotations

from typing import Any

TEACHER, START = 0.9, 0.1  # the held-out accuracies of the teacher and of the student's start


def study_result(
    recipe: str,
    seed: int,
    lr: float,
    *,
    curve: list[list[float]],
    test: float,
    compute: list[list[float]] | None = None,
    arm: str = "full",
    train_rows: int = 1000,
    on_policy: bool = False,
) -> dict[str, Any]:
    """``lightning_gkd.cli.train.run``'s result of one study run: ``curve`` ([step, val accuracy]), held-out ``test``
    accuracy after training (the teacher's and the start's: ``TEACHER``, ``START``), ``compute`` ([step, FLOPs,
    seconds]; default 1e9 FLOPs and 0.1 s a step)."""
    compute = compute or [[step, step * 1e9, step * 0.1] for step, _ in curve]
    return {
        "global_step": int(curve[-1][0]),
        "metrics": {"train/loss": 0.5, "val/accuracy": curve[-1][1]},
        "held_out": {"teacher": {"accuracy": TEACHER}, "before": {"accuracy": START}, "after": {"accuracy": test}},
        "fit_seconds": 10.0,
        "stopped_by_signal": False,
        "study": {
            "recipe": {"name": recipe, "description": f"what {recipe} is", "on_policy": on_policy},
            "task": None,
            "arm": arm,
            "seed": seed,
            "lr": lr,
            "settings": {
                "steps": int(curve[-1][0]),
                "batch_size": 8,
                "eval_every": int(curve[0][0]),
                "train_rows": train_rows,
            },
            "curve": curve,
            "compute": compute,
            "tokens": {"generated": 0, "teacher_scored": 0, "trained": 100},
            "train_flops": compute[-1][1],
            "train_seconds": compute[-1][2],
            "metrics": {"train/loss": 0.5, "val/accuracy": curve[-1][1]},
            "length_guard_alerts": [],
            "completions": {},
        },
    }


def study_job(num: int, recipe: str, seed: int, lr: float, **figures: Any) -> dict[str, Any]:
    """One entry of ``lightning_gkd.cli.sweep.collect_jobs`` for a finished study run (``study_result``)."""
    return {"num": num, "status": "finished", **study_result(recipe, seed, lr, **figures)}
