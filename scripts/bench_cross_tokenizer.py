"""Cross-tokenizer speed and memory: a training step of GKD's one-tokenizer loss against the cross-tokenizer
``projected`` loss (lightning_gkd/losses/cross_tokenizer.py), at the toy task's shapes (the shipped toy models, batch
32) and at 2k-token completions (random 2x64 / 4x128 models, 2 rows); the projection tables of a pair of
152k-token byte-level BPE tokenizers (cold build, and read back from their cache); and the peak memory of a
``projected`` step at 2,048 completion tokens with V = 152k.

Every measurement runs in a fresh subprocess (one harness, importing the package from a tree), so with ``--before
REV`` the same harness also measures the package as of git revision ``REV`` (``git archive``): the figures print side
by side. Writes docs/cross_tokenizer_speed.md and .json.

The 152k tokenizers: ``data.tokenizer.build_chatml_bpe_tokenizer`` (the project's byte-level BPE builder, the
tokenizers library's trainer, about 10 s each) on 10 MB of generated text (1.5M draws from 300k made-up words of 1-5
syllables, and numbers), a different draw for the student and the teacher; saved under ``--work`` and reused.

    python scripts/bench_cross_tokenizer.py --before 08a62bd     # about 5 minutes on 2 cores
    python scripts/bench_cross_tokenizer.py --fast --out /tmp/x  # a smoke test (no 152k part)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIG_VOCAB = 152_000
LONG_TOKENS = 2048


# --------------------------------------------------------------------------- the harness (runs in a subprocess)


def _rss_peak_reset() -> None:
    """Reset the process's peak resident set size (Linux: ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _text(rng: random.Random, length: int) -> str:
    """About ``length`` bytes of the toy task's kind of text (sums, words, numbers)."""
    words = ["the", "sum", "of", "is", "and", "then", "carry", "add", "number", "digits"]
    out: list[str] = []
    while sum(map(len, out)) < length:
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        out.append(f"{a}+{b}={a + b} {rng.choice(words)} {rng.choice(words)}\n")
    return "".join(out)[:length]


def _batch(tokenizer: Any, rows: list[dict], max_length: int) -> dict:
    from lightning_gkd.data.chat import ChatMLCollator

    return ChatMLCollator(tokenizer, max_length=max_length, carry_prompt_messages=True)(rows)


#: What the cross-tokenizer loss calls (losses/cross_tokenizer.py), timed apart: re-tokenizing for the teacher, and
#: the alignment and loss (per row before the vectorisation, the batch at once after it).
PARTS = {
    "student_completions": "retokenize",
    "teacher_batch": "retokenize",
    "cross_tokenizer_row_terms": "loss",
    "cross_tokenizer_batch_loss": "loss",
}


def _time_steps(losses: dict[str, Any], student: Any, batch: dict, repeats: int) -> dict[str, float]:
    """Median seconds per step of each loss, the losses' steps interleaved (shared cores slow both alike), and the
    cross-tokenizer loss's parts (``PARTS``), seconds per step."""
    import torch

    import lightning_gkd.losses.cross_tokenizer as cross

    parts = {"retokenize": 0.0, "loss": 0.0}
    timing = [False]

    def wrap(function: Any, part: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if timing[0]:
                    parts[part] += time.perf_counter() - started

        return timed

    for name, part in PARTS.items():
        if hasattr(cross, name):
            setattr(cross, name, wrap(getattr(cross, name), part))
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {name: [] for name in losses}
    for step in range(repeats + 1):  # the first is a warm-up
        for name, loss in losses.items():
            timing[0] = step > 0
            started = time.perf_counter()
            out = loss(student, batch)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {**medians, **{f"projected_{part}": value / repeats for part, value in parts.items()}}


def _losses(
    student_tokenizer: Any,
    same_teacher: Any,
    cross_teacher: Any,
    cross_tokenizer: Any,
    student: Any,
    cache: str | None = None,
):
    from lightning_gkd.losses.cross_tokenizer import CrossTokenizerDistillation
    from lightning_gkd.losses.cross_tokenizer_plan import CrossTokenizerSettings
    from lightning_gkd.losses.dense import DenseDistillation
    from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import CrossTokenizerLoss
    from lightning_gkd.teachers.local import LocalTeacher

    try:  # the package's settings groups; a revision from before them (--before) takes beta directly
        from lightning_gkd.losses.settings import DivergenceSettings

        divergence: dict[str, Any] = {"divergence": DivergenceSettings(beta=0.0)}
    except ImportError:
        divergence = {"beta": 0.0}
    one = DenseDistillation(LocalTeacher(same_teacher), **divergence) if same_teacher is not None else None
    options = (
        {"projection_cache": cache}
        if cache and "projection_cache" in CrossTokenizerSettings.__dataclass_fields__
        else {}
    )
    settings = CrossTokenizerSettings(loss=CrossTokenizerLoss(loss="projected", beta=0.0), **options)
    cross = CrossTokenizerDistillation(
        LocalTeacher(cross_teacher), student_tokenizer, cross_tokenizer, settings, student=student
    )
    return one, cross


def job_steps(shape: str, repeats: int, threads: int) -> dict:
    """Seconds per step (median) of the one-tokenizer and the projected loss at ``shape`` (toy | long)."""
    import torch

    torch.set_num_threads(threads)

    from lightning_gkd.data.tokenizer import load_tokenizer
    from lightning_gkd.models.loading import load_causal_lm
    from lightning_gkd.toy.tiny import TOY_STUDENT, TOY_TEACHER, asset_path, tiny_causal_lm

    torch.manual_seed(0)
    student_tokenizer = load_tokenizer(asset_path("toy/student_init"))
    teacher_tokenizer = load_tokenizer(asset_path("toy_bpe/teacher"))
    rng = random.Random(0)
    if shape == "toy":
        student = load_causal_lm(asset_path("toy/student_init"))
        same, cross = load_causal_lm(asset_path("toy/teacher")), load_causal_lm(asset_path("toy_bpe/teacher"))
        rows = []
        for _ in range(32):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            rows.append(
                {"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
            )
        max_length = 64
    else:
        positions = {"max_position_embeddings": LONG_TOKENS + 256}
        student = tiny_causal_lm({**TOY_STUDENT, **positions}, student_tokenizer, seed=0)
        same = tiny_causal_lm({**TOY_TEACHER, **positions}, student_tokenizer, seed=1)
        cross = tiny_causal_lm({**TOY_TEACHER, **positions}, teacher_tokenizer, seed=2)
        rows = [
            {
                "messages": [
                    {"role": "user", "content": "add"},
                    {"role": "assistant", "content": _text(rng, LONG_TOKENS - 2)},
                ]
            }
            for _ in range(2)
        ]
        max_length = LONG_TOKENS + 64
    for model in (student, same, cross):
        model.train(False)
    batch = _batch(student_tokenizer, rows, max_length)
    one, projected = _losses(student_tokenizer, same, cross, teacher_tokenizer, student)
    completion = int((batch["labels"] != -100).sum())
    seconds = _time_steps({"one_tokenizer": one, "projected": projected}, student, batch, repeats)
    return {"completion_tokens": completion, "rows": len(rows), **seconds}


def job_memory(tokenizers: str, cache: str) -> dict:
    """Peak resident memory (bytes above the process's before the step) of one ``projected`` step (forward and
    backward) at 2,048 student completion tokens with both vocabularies 152k, random 2x64 / 4x128 models."""
    import torch

    from lightning_gkd.data.tokenizer import load_tokenizer
    from lightning_gkd.toy.tiny import TOY_STUDENT, TOY_TEACHER, tiny_causal_lm

    torch.manual_seed(0)
    student_tokenizer = load_tokenizer(Path(tokenizers) / "student")
    teacher_tokenizer = load_tokenizer(Path(tokenizers) / "teacher")
    positions = {"max_position_embeddings": LONG_TOKENS + 256}
    student = tiny_causal_lm({**TOY_STUDENT, **positions}, student_tokenizer, seed=0)
    cross = tiny_causal_lm({**TOY_TEACHER, **positions}, teacher_tokenizer, seed=2)
    rng = random.Random(0)
    text = _text(rng, 4 * LONG_TOKENS)
    ids = student_tokenizer(text, add_special_tokens=False)["input_ids"][: LONG_TOKENS - 2]
    text = student_tokenizer.decode(ids)
    rows = [{"messages": [{"role": "user", "content": "add"}, {"role": "assistant", "content": text}]}]
    batch = _batch(student_tokenizer, rows, LONG_TOKENS + 64)
    started = time.perf_counter()
    _, projected = _losses(student_tokenizer, None, cross, teacher_tokenizer, student, cache)
    setup = time.perf_counter() - started
    _rss_peak_reset()
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    out = projected(student, batch)
    out.loss.backward()
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    return {
        "completion_tokens": int((batch["labels"] != -100).sum()),
        "vocab": [len(student_tokenizer), len(teacher_tokenizer)],
        "peak_bytes": (peak - before) * 1024,
        "step_seconds": seconds,
        "loss_setup_seconds": setup,
    }


def job_tables(tokenizers: str, cache: str) -> dict:
    """The projection tables of the 152k pair: a cold build (written to ``cache``), then read back."""
    from lightning_gkd.data.token_projection import projection_tables
    from lightning_gkd.data.tokenizer import load_tokenizer

    student = load_tokenizer(Path(tokenizers) / "student")
    teacher = load_tokenizer(Path(tokenizers) / "teacher")
    started = time.perf_counter()
    tables = projection_tables(student, teacher, cache_dir=cache)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    projection_tables(student, teacher, cache_dir=cache)
    cached = time.perf_counter() - started
    size = sum(p.stat().st_size for p in Path(cache).iterdir())
    return {
        "cold_seconds": cold,
        "cached_seconds": cached,
        "cache_bytes": size,
        "extensions": int(tables.extension_ids.numel()),
        "vocab": [len(student), len(teacher)],
    }


def job_build_tokenizers(out: str, vocab: int) -> dict:
    """Two byte-level BPE tokenizers of ``vocab`` tokens on two generated corpora (saved under ``out``)."""
    from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer

    seconds = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        started = time.perf_counter()
        rng = random.Random(seed)
        syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiouy"] + list("aeiou")
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 5))) for _ in range(300_000)]
        corpus = [" ".join(rng.choices(words, k=1000)) + f" {rng.randint(0, 10**6)}\n" for _ in range(1500)]
        tokenizer = build_chatml_bpe_tokenizer(corpus, merges=vocab - 259)
        tokenizer.save_pretrained(Path(out) / name)
        seconds[name] = {"seconds": time.perf_counter() - started, "vocab": len(tokenizer)}
    return seconds


JOBS = {"steps": job_steps, "memory": job_memory, "tables": job_tables, "build_tokenizers": job_build_tokenizers}


# --------------------------------------------------------------------------- the driver


def run_job(tree: Path, job: str, **kwargs: Any) -> dict:
    """``job`` in a fresh process importing the package from ``tree``; its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, __file__, "--job", json.dumps({"name": job, **kwargs})]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        why = "killed (-9: out of memory?)" if done.returncode == -9 else f"exit {done.returncode}"
        raise RuntimeError(f"job {job} under {tree} failed, {why}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkout(revision: str, into: Path) -> Path:
    """The package as of ``revision`` (``git archive``), under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "lightning_gkd"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def render(report: dict) -> str:
    trees = list(report["steps"])
    lines = [
        "# Cross-tokenizer speed and memory",
        "",
        "Generated by `scripts/bench_cross_tokenizer.py` (do not edit by hand; rerun the script).",
        "",
        f"- Command: `{report['command']}`; machine: {report['machine']}; total {report['seconds'] / 60:.1f} min",
        "- A step: the loss (both models' forwards at the completion positions, re-tokenizing for the teacher, the "
        "alignment and the loss), its backward and an AdamW step, median of "
        f"{report['repeats']} (toy: {4 * report['repeats']}) after a warm-up, {report['threads']} torch thread(s), "
        "the two losses' steps interleaved. One tokenizer: GKD's generalized JSD (β=0) against a teacher that "
        "shares the student's tokenizer (chunked, from hidden states). Projected: the cross-tokenizer default (β=0) "
        "against the byte-level BPE teacher (toy_bpe).",
        "",
        "| shapes | code | completion tokens | one tokenizer (s/step) | projected (s/step) | ratio | projected: "
        "re-tokenizing (s/step) | projected: alignment, projection and loss (s/step) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tree in trees:
        for shape, row in report["steps"][tree].items():
            label = {"toy": "toy task (batch 32)", "long": f"2k-token completions (batch {row['rows']})"}[shape]
            lines.append(
                f"| {label} | {tree} | {row['completion_tokens']} | {row['one_tokenizer']:.4f} | "
                f"{row['projected']:.4f} | {row['projected'] / row['one_tokenizer']:.2f}× | "
                f"{row['projected_retokenize']:.4f} | {row['projected_loss']:.4f} |"
            )
    if report.get("tables"):
        tables, built = report["tables"], report["tokenizers"]
        lines += [
            "",
            f"Projection tables of two byte-level BPE tokenizers of {tables['vocab'][0]:,} and "
            f"{tables['vocab'][1]:,} tokens (`build_chatml_bpe_tokenizer` on two generated corpora; built in "
            + ", ".join(f"{name} {v['seconds']:.0f} s" for name, v in built.items())
            + (", read from --work" if report.get("tokenizers_reused") else "")
            + f"): cold build **{tables['cold_seconds']:.1f} s**, read from the cache "
            f"**{tables['cached_seconds']:.2f} s** ({tables['cache_bytes'] / 2**20:.0f} MiB on disk, "
            f"{tables['extensions']:,} prefix extensions).",
        ]
    if report.get("memory"):
        lines += [
            "",
            f"Peak memory of one projected step (forward and backward, random 2x64 / 4x128 models) at "
            f"{LONG_TOKENS} completion tokens, V = 152k on both sides (resident memory above the process's before "
            "the step):",
            "",
            "| code | completion tokens | peak memory | step (s) |",
            "|---|---|---|---|",
        ]
        for tree, row in report["memory"].items():
            if "error" in row:
                lines.append(f"| {tree} | – | failed: {row['error']} | – |")
                continue
            lines.append(
                f"| {tree} | {row['completion_tokens']} | {row['peak_bytes'] / 2**30:.2f} GiB | "
                f"{row['step_seconds']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a git revision to measure as well (the package before a change)")
    parser.add_argument("--repeats", type=int, default=5, help="steps timed per loss (4x at the toy shapes)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the step timings (1: steadier on shared cores)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_cross_tokenizer")
    parser.add_argument("--fast", action="store_true", help="2 repeats, no 152k part")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        spec = json.loads(args.job)
        print(json.dumps(JOBS[spec.pop("name")](**spec)))
        return 0
    if args.fast:
        args.repeats = 2
    started = time.perf_counter()
    trees = {"this tree": REPO}
    scratch = Path(tempfile.mkdtemp(prefix="bench_xtok_"))
    if args.before:
        trees = {f"before ({args.before})": checkout(args.before, scratch / "before"), **trees}
    report: dict[str, Any] = {
        "command": "python scripts/bench_cross_tokenizer.py"
        + (f" --before {args.before}" if args.before else "")
        + (" --fast" if args.fast else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "repeats": args.repeats,
        "threads": args.threads,
        "steps": {},
    }
    for name, tree in trees.items():
        report["steps"][name] = {
            shape: run_job(
                tree, "steps", shape=shape, repeats=args.repeats * (4 if shape == "toy" else 1), threads=args.threads
            )
            for shape in ("toy", "long")
        }
        print(name, report["steps"][name], flush=True)
    if not args.fast:
        tokenizers = args.work / f"tokenizers_{BIG_VOCAB}"
        report["tokenizers_reused"] = (tokenizers / "teacher" / "tokenizer.json").is_file()
        if report["tokenizers_reused"]:
            report["tokenizers"] = json.loads((tokenizers / "built.json").read_text())
        else:
            report["tokenizers"] = run_job(REPO, "build_tokenizers", out=str(tokenizers), vocab=BIG_VOCAB)
            (tokenizers / "built.json").write_text(json.dumps(report["tokenizers"]))
        print("tokenizers", report["tokenizers"], flush=True)
        report["tables"] = run_job(REPO, "tables", tokenizers=str(tokenizers), cache=str(scratch / "cache"))
        print("tables", report["tables"], flush=True)
        report["memory"] = {}
        for name, tree in trees.items():
            try:
                report["memory"][name] = run_job(
                    tree, "memory", tokenizers=str(tokenizers), cache=str(scratch / "cache")
                )
            except RuntimeError as error:  # e.g. killed for memory: say so in the table
                report["memory"][name] = {"error": str(error).strip().splitlines()[0].split(", ", 1)[-1][:200]}
        print("memory", report["memory"], flush=True)
    report["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cross_tokenizer_speed.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "cross_tokenizer_speed.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
