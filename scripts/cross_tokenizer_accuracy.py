"""Cross-tokenizer distillation on the toy task: the shipped byte-tokenizer student distilled from a teacher with
another tokenizer (a byte-level BPE with merges, lightning_gkd/assets/toy_bpe/teacher), against the same student
distilled from the same-size teacher that shares its tokenizer (lightning_gkd/assets/toy/teacher), and SFT alone.

Each row is a run of the addition study (``experiment=study_addition``: 200 steps of batch 32, the same seeds) of a
recipe (conf/recipe) at its learning rate there: Supervised KD (λ=0: the dataset answers) and on-policy GKD (λ=1:
the student's samples, decoded and re-tokenized for the BPE teacher), forward KL (β=0) on the shared-tokenizer path;
on the cross-tokenizer path (``model=toy_bpe cross_tokenizer=...``) GOLD's hybrid (β=0 on the token strings both
vocabularies hold, ULD on the rest; once with TRL's default of leaving the end tokens out of the loss, once with them
in), ULD alone, and ours: the chunk likelihoods and the projected first token (β=0). Also: the training steps' wall
time against the same-tokenizer run (the alignment's overhead), and where a cross-tokenizer step's time goes. Writes
docs/cross_tokenizer.md and .json.

    python scripts/cross_tokenizer_accuracy.py                    # 3 seeds (about 17 minutes on 2 cores)
    python scripts/cross_tokenizer_accuracy.py --fast --out /tmp/x  # a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import lightning_gkd.losses.cross_tokenizer as cross_step
import lightning_gkd.teachers.local as local_teacher
from lightning_gkd.cli.compose import held_out_after, train_seeds
from lightning_gkd.studies.reports import generated_by, write_report
from lightning_gkd.toy.tiny import asset_path

REPO = Path(__file__).resolve().parents[1]
LR = 3e-3  # docs/results.md's choice for all three (task 1)
#: The end tokens kept in the loss (our default) or left out (TRL's GOLD default: uld_skip_*_eos=True).
KEEP = {"skip_student_eos": False, "skip_teacher_eos": False}
SKIP = {"skip_student_eos": True, "skip_teacher_eos": True}
#: the addition study's recipes (conf/recipe) each row runs, by the name docs/results.md gives them
RECIPES = {"SFT": "sft", "Supervised KD": "supervised_kd", "GKD β=0": "gkd_beta0"}
#: (row label, recipe name, teacher asset, cross-tokenizer settings or None for the shared-tokenizer path)
ROWS: list[tuple[str, str, str | None, dict[str, Any] | None]] = [("SFT (no teacher)", "SFT", None, None)]
for _name, _method in (("Supervised KD", "Supervised KD"), ("On-policy GKD", "GKD β=0")):
    bpe = "toy_bpe/teacher"
    ROWS += [
        (f"{_name}, same tokenizer", _method, "toy/teacher", None),
        (
            f"{_name}, BPE teacher, hybrid, end tokens skipped (TRL's defaults)",
            _method,
            bpe,
            {"loss": "hybrid", **SKIP},
        ),
        (f"{_name}, BPE teacher, hybrid", _method, bpe, {"loss": "hybrid", **KEEP}),
        (f"{_name}, BPE teacher, ULD", _method, bpe, {"loss": "uld", **KEEP}),
        (f"{_name}, BPE teacher, likelihood", _method, bpe, {"loss": "likelihood", **KEEP}),
        (f"{_name}, BPE teacher, projected (the default)", _method, bpe, {"loss": "projected", **KEEP}),
        (f"{_name}, BPE teacher, projected, end tokens skipped", _method, bpe, {"loss": "projected", **SKIP}),
    ]
FAST_ROWS = ["+data.train_data.num_rows=256", "+data.val_data.num_rows=32", "+data.test_data.num_rows=64"]
#: The cross-tokenizer step's parts, timed by wrapping the functions losses/cross_tokenizer.py calls.
TIMED = {
    "student_completions": "decode the student's completions (byte spans)",
    "teacher_batch": "re-tokenize for the teacher (its chat template)",
    "hidden_states_and_head": "forwards (student and teacher, completion positions)",
    "cross_tokenizer_row_terms": "alignment, merging and the loss (hybrid, ULD: per row; likelihood, projected: the "
    "batch at once)",
}
#: Functions timed into another's column: the likelihood and projected losses run over the batch at once.
TIMED_AS = {"cross_tokenizer_batch_loss": "cross_tokenizer_row_terms"}


@contextmanager
def timed_parts(seconds: dict[str, float]) -> Iterator[None]:
    """Accumulate the wall time of the TIMED functions as ``losses.cross_tokenizer`` calls them."""
    # the teacher's forward goes through LocalTeacher.hidden_states (teachers/local.py), the student's through ours
    modules = {name: [cross_step] for name in (*TIMED, *TIMED_AS)}
    modules["hidden_states_and_head"].append(local_teacher)
    originals = {(module, name): getattr(module, name) for name, found in modules.items() for module in found}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[TIMED_AS.get(name, name)] += time.perf_counter() - started

        return timed

    for (module, name), fn in originals.items():
        setattr(module, name, wrap(name, fn))
    try:
        yield
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def manifest(assets: str) -> dict[str, Any]:
    """The manifest.json scripts/train_toy_teacher.py wrote next to the shipped ``assets`` (e.g. ``toy_bpe``)."""
    return json.loads(Path(asset_path(f"{assets}/manifest.json")).read_text())


def run_overrides(recipe: str, teacher: str | None, cross_tokenizer: dict[str, Any] | None) -> list[str]:
    """A row's ``lightning-gkd`` overrides: the recipe, and the BPE teacher (model=toy_bpe) with its loss."""
    overrides = [f"recipe={RECIPES[recipe]}"]
    if teacher == "toy_bpe/teacher":
        overrides.append("model=toy_bpe")
    if cross_tokenizer is not None:
        overrides.append(f"cross_tokenizer={cross_tokenizer['loss']}")
        overrides += [f"cross_tokenizer.{key}={str(cross_tokenizer[key]).lower()}" for key in KEEP]
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--fast", action="store_true", help="1 seed, 6 steps, few rows")
    args = parser.parse_args(argv)
    if args.fast:
        args.steps, args.seeds = 6, args.seeds[:1]
    started = time.perf_counter()
    base = ["experiment=study_addition", f"optimizer.lr={LR}", f"data.batch_size={args.batch_size}"]
    base += [f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}"]
    base += FAST_ROWS if args.fast else []
    results: dict[str, dict[str, Any]] = {}
    for index, (label, recipe, teacher, cross_tokenizer) in enumerate(ROWS):
        parts: dict[str, float] = defaultdict(float)
        overrides = [*base, *run_overrides(recipe, teacher, cross_tokenizer)]
        with timed_parts(parts):
            runs = train_seeds(overrides, args.seeds, output_dir=args.out / ".runs" / "cross_tokenizer" / f"row{index}")
        accuracies = [held_out_after(run) for run in runs]
        step_seconds = [run["study"]["train_seconds"] / args.steps for run in runs]
        results[label] = {
            "method": recipe,
            "teacher": teacher,
            "loss": loss_label(cross_tokenizer, teacher),
            "test_accuracy": accuracies,
            "step_seconds": step_seconds,
            "parts_seconds_per_step": {name: value / (args.steps * len(args.seeds)) for name, value in parts.items()},
        }
        print(
            f"{label}: test {[round(a, 3) for a in accuracies]}, {statistics.mean(step_seconds):.3f} s/step", flush=True
        )
    report = {
        "command": "python scripts/cross_tokenizer_accuracy.py" + (" --fast" if args.fast else ""),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "student_start": manifest("toy")["student_init"]["test_accuracy"],
        "teacher_accuracy": {
            "toy/teacher": manifest("toy")["teacher"]["test_accuracy"],
            "toy_bpe/teacher": manifest("toy_bpe")["teacher"]["test_accuracy"],
        },
        # how the two tokenizers split the 512 test answers (computed by train_toy_teacher.py when it made the asset)
        "pairing": manifest("toy_bpe")["pairing"],
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    write_report(args.out / "cross_tokenizer.md", render(report), report)
    print(render(report))
    return 0


def loss_label(cross_tokenizer: dict[str, Any] | None, teacher: str | None) -> str:
    if cross_tokenizer is None:
        return "forward KL (β=0)" if teacher else "cross-entropy"
    skipped = cross_tokenizer["skip_student_eos"]
    return f"{cross_tokenizer['loss']} (β=0), end tokens {'skipped' if skipped else 'kept'}"


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def render(report: dict) -> str:
    pairing, results = report["pairing"], report["results"]
    reference = {
        "Supervised KD": statistics.mean(results["Supervised KD, same tokenizer"]["step_seconds"]),
        "GKD β=0": statistics.mean(results["On-policy GKD, same tokenizer"]["step_seconds"]),
    }
    lines = [
        "# Cross-tokenizer distillation on the toy task",
        "",
        generated_by("scripts/cross_tokenizer_accuracy.py"),
        "",
        f"- Command: `{report['command']}`; machine: {report['machine']}; total {report['seconds'] / 60:.1f} min",
        f"- Budget: {report['args']['steps']} steps of batch {report['args']['batch_size']}, lr {LR}, seeds "
        f"{report['args']['seeds']}; the student starts at {report['student_start']:.3f} test accuracy "
        "(512 held-out prompts, greedy).",
        f"- Tokenizers: the student's byte-level ChatML tokenizer ({pairing['student_vocabulary']} tokens) and the "
        f"teacher's byte-level BPE ({pairing['teacher_vocabulary']} tokens); {pairing['shared_token_strings']} token "
        f"strings are in both. A test answer is {pairing['student_tokens_per_answer']:.2f} student tokens and "
        f"{pairing['teacher_tokens_per_answer']:.2f} teacher tokens; "
        f"{pairing['answers_split_differently']:.0%} of the answers are split differently.",
        f"- Teachers (4x128, same shape): the shared-tokenizer one (`toy/teacher`) answers "
        f"{report['teacher_accuracy']['toy/teacher']:.3f} of the test prompts, the BPE one (`toy_bpe/teacher`) "
        f"{report['teacher_accuracy']['toy_bpe/teacher']:.3f}.",
        "",
        "| run | loss | test accuracy (mean ± std) | s / training step | vs same tokenizer |",
        "|---|---|---|---|---|",
    ]
    for label, row in results.items():
        mean, std = _mean_std(row["test_accuracy"])
        step = statistics.mean(row["step_seconds"])
        ratio = f"{step / reference[row['method']]:.2f}×" if row["method"] in reference else "–"
        lines.append(
            f"| {label} | {row['loss']} | {mean:.3f} ± {std:.3f} (n={len(row['test_accuracy'])}) | {step:.3f} | "
            f"{ratio} |"
        )
    lines += ["", "Where a cross-tokenizer training step's time goes (s per step, mean over seeds):", ""]
    lines += ["| run | " + " | ".join(TIMED.values()) + " |", "|---|" + "---|" * len(TIMED)]
    for label, row in results.items():
        parts = row["parts_seconds_per_step"]
        if any(parts.values()):
            lines.append(f"| {label} | " + " | ".join(f"{parts.get(name, 0.0):.4f}" for name in TIMED) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
