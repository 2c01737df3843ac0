"""The supervised GKD loss on hidden states at a large vocabulary and long answers, against its FLOP floor.

``ops.chunked_jsd.projected_jsd_loss`` forward + backward (both heads' projections, the chunked generalized JSD and
the folding of its logit gradient into the student's hidden-state and head-weight gradients) at N = 512 supervised
positions, V = 151936, a Qwen2.5-0.5B-shaped student (H = 896, float32, its head trainable) and a Qwen2.5-1.5B-shaped
teacher (H = 1536) in bfloat16 (``frozen_dtype: auto`` on a CPU with AVX512-BF16 or AMX, ``models/precision.py``) and
in float32, at beta 0 and 0.5, with the shipped ``loss_chunk_size`` (64, ``conf/method_defaults/on_policy.yaml``).

The floor, measured in the same run for exactly these shapes and dtypes (the fastest of the calls made):

* matrix products: the student logits ``(N, H) @ (H, V)`` (2NHV FLOPs), the teacher logits in the teacher's dtype
  (2NH_tV), the hidden-state gradient ``(N, V) @ (V, H)`` (2NHV) and the head-weight gradient ``(V, N) @ (N, H)``
  (2NHV), each one ``torch.mm`` over all N rows at once;
* elementwise: the least memory traffic any implementation has, reading the student's float32 logits and the
  teacher's logits (in its dtype) once and writing the float32 logit gradient once, at the copy bandwidth measured
  on a 256 MB copy.

Nothing else counts (no softmax arithmetic, no allocations, no reductions). The configurations alternate within each
repetition and the floor's products are timed between them, so the machine's drifts (other jobs on shared cores)
hit both alike; the ratio is best step / floor. A profiled step per configuration (torch.profiler, self time per
op) splits the step into the products, the softmax and exp passes, the other elementwise passes, copies and
conversions, fills, and the rest (the Python loop over chunks and blocks). Writes docs/benchmarks_loss.md and
docs/benchmarks_loss.json.

    python scripts/bench_loss.py                 # about 5 minutes on 2 shared cores
    python scripts/bench_loss.py --tiny --out /tmp/loss   # a smoke test (tiny shapes: checks the script)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_gkd.models.precision import bf16_matmul_is_fast
from lightning_gkd.ops.divergence.chunked_jsd import projected_jsd_loss

REPO = Path(__file__).resolve().parents[1]
REAL = {"positions": 512, "vocab": 151936, "student_hidden": 896, "teacher_hidden": 1536}
TINY = {"positions": 24, "vocab": 300, "student_hidden": 16, "teacher_hidden": 24}
GROUPS = {  # profiler op name -> the share it is reported under
    "products (mm, addmm)": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::matmul"),
    "log-softmax": ("aten::_log_softmax",),
    "exp, logaddexp": ("aten::exp", "aten::logaddexp"),
    "other elementwise (add, sub, mul, div, dot, row sums)": (
        "aten::add",
        "aten::add_",
        "aten::sub",
        "aten::sub_",
        "aten::mul",
        "aten::mul_",
        "aten::div",
        "aten::div_",
        "aten::neg_",
        "aten::dot",
        "aten::bmm",
        "aten::sum",
    ),
    "copies, dtype conversions": ("aten::copy_",),
    "fills, allocations": ("aten::fill_", "aten::zero_", "aten::empty", "aten::empty_strided", "aten::empty_like"),
}


def best_seconds(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class Inputs:
    """The step's tensors: student hidden states and head (float32, trainable), teacher hidden states and head."""

    def __init__(self, shape: dict, teacher_dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)
        n, v, h, ht = shape["positions"], shape["vocab"], shape["student_hidden"], shape["teacher_hidden"]
        self.hidden = torch.randn(n, h, generator=g).requires_grad_()
        self.weight = (torch.randn(v, h, generator=g) * 0.02).requires_grad_()
        self.teacher_hidden = torch.randn(n, ht, generator=g).to(teacher_dtype)
        self.teacher_weight = (torch.randn(v, ht, generator=g) * 0.02).to(teacher_dtype)

    def step(self, beta: float, chunk_size: int) -> None:
        self.hidden.grad = self.weight.grad = None
        loss = projected_jsd_loss(
            self.hidden, self.weight, self.teacher_hidden, self.teacher_weight, beta=beta, chunk_size=chunk_size
        )
        loss.backward()


def floor_parts(inputs: Inputs, calls: int) -> dict[str, float]:
    """Seconds of each product of the floor (fastest of ``calls``), over all N rows at once."""
    h, w = inputs.hidden.detach(), inputs.weight.detach()
    th, tw = inputs.teacher_hidden, inputs.teacher_weight
    grad = torch.randn(h.shape[0], w.shape[0])
    logits, teacher_logits = torch.empty(h.shape[0], w.shape[0]), th.new_empty(h.shape[0], w.shape[0])
    hidden_grad, weight_grad = torch.empty_like(h), torch.empty_like(w)
    return {
        "student logits": best_seconds(lambda: torch.mm(h, w.t(), out=logits), calls),
        "teacher logits": best_seconds(lambda: torch.mm(th, tw.t(), out=teacher_logits), calls),
        "hidden gradient": best_seconds(lambda: torch.mm(grad, w, out=hidden_grad), calls),
        "weight gradient": best_seconds(lambda: torch.mm(grad.t(), h, out=weight_grad), calls),
    }


def copy_bandwidth(calls: int, elements: int) -> float:
    source = torch.randn(elements)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / best_seconds(lambda: target.copy_(source), calls)  # bytes read + written


def profile_shares(inputs: Inputs, beta: float, chunk_size: int) -> dict[str, float]:
    """Seconds of a profiled step by op group (self time), and the rest of its wall time."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        inputs.step(beta, chunk_size)
        wall = time.perf_counter() - start
    self_us = {event.key: event.self_cpu_time_total for event in prof.key_averages()}
    shares = {name: sum(self_us.get(op, 0.0) for op in ops) / 1e6 for name, ops in GROUPS.items()}
    grouped = {op for ops in GROUPS.values() for op in ops}
    shares["other ops"] = sum(t for op, t in self_us.items() if op.startswith("aten::") and op not in grouped) / 1e6
    shares["Python, loop, autograd (the rest of the wall time)"] = max(0.0, wall - sum(shares.values()))
    shares["wall"] = wall
    return shares


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2, help="timed steps per configuration")
    parser.add_argument(
        "--chunk-sizes", type=int, nargs="+", default=[64, 512], help="loss_chunk_size values (shipped: 64)"
    )
    parser.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.5])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script, not the speed")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="folder for benchmarks_loss.md and .json")
    parser.add_argument("--render", action="store_true", help="rewrite the page from --out's JSON (no measurement)")
    args = parser.parse_args(argv)
    if args.render:
        (args.out / "benchmarks_loss.md").write_text(
            render(json.loads((args.out / "benchmarks_loss.json").read_text()))
        )
        return 0
    shape = TINY if args.tiny else REAL
    started = time.perf_counter()
    auto = torch.bfloat16 if bf16_matmul_is_fast("cpu") else torch.float32
    dtypes = [auto] + [d for d in (torch.bfloat16, torch.float32) if d != auto]
    inputs = {dtype: Inputs(shape, dtype) for dtype in dtypes}
    configs = [(dtype, beta, chunk) for dtype in dtypes for beta in args.betas for chunk in args.chunk_sizes]
    steps: dict[tuple, list[float]] = {c: [] for c in configs}
    floors: dict[torch.dtype, list[dict[str, float]]] = {d: [] for d in dtypes}
    copies = []
    for dtype in dtypes:  # warm-up: the first call of the kernels
        inputs[dtype].step(args.betas[0], args.chunk_sizes[0])
    for _ in range(args.reps):  # each dtype's floor products right before its steps
        copies.append(copy_bandwidth(2, 1 << 16 if args.tiny else 64 << 20))
        for dtype in dtypes:
            floors[dtype].append(floor_parts(inputs[dtype], 1))
            for _, beta, chunk in (c for c in configs if c[0] == dtype):
                steps[dtype, beta, chunk].append(best_seconds(lambda d=dtype, b=beta, c=chunk: inputs[d].step(b, c), 1))
    copy_rate = max(copies)
    shares = {c: profile_shares(inputs[c[0]], c[1], c[2]) for c in configs}
    n, v = shape["positions"], shape["vocab"]
    rows = []
    for dtype, beta, chunk in configs:
        parts = {name: min(f[name] for f in floors[dtype]) for name in floors[dtype][0]}
        traffic = n * v * (4 + torch.finfo(dtype).bits // 8 + 4)
        floor_products = sum(parts.values())
        floor = floor_products + traffic / copy_rate
        best = min(steps[dtype, beta, chunk])
        rows.append(
            {
                "teacher_dtype": str(dtype).removeprefix("torch."),
                "beta": beta,
                "chunk_size": chunk,
                "step_s": best,
                "step_median_s": statistics.median(steps[dtype, beta, chunk]),
                "floor_s": floor,
                "floor_products_s": floor_products,
                "floor_parts_s": parts,
                "floor_elementwise_s": traffic / copy_rate,
                "ratio": best / floor,
                "profile_s": shares[dtype, beta, chunk],
            }
        )
    flops = {
        "student (each of 3 products)": 2 * n * shape["student_hidden"] * v,
        "teacher": 2 * n * shape["teacher_hidden"] * v,
    }
    result = {
        "shape": shape,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "copy_GBps": copy_rate / 1e9,
        "flops": flops,
        "rows": rows,
        "seconds": time.perf_counter() - started,
        "command": "python scripts/bench_loss.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmarks_loss.json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    (args.out / "benchmarks_loss.md").write_text(text)
    print(text)
    return 0


def render(result: dict) -> str:
    shape = result["shape"]
    lines = [
        "# Benchmark: the hidden-state GKD loss at a large vocabulary",
        "",
        "Generated by `scripts/bench_loss.py` (its docstring says what the floor counts); do not edit by hand.",
        f"Command: `{result['command'].strip()}`, {result['seconds']:.0f} s, torch {result['torch']}, "
        f"{result['machine']['threads']} threads.",
        "",
        f"`projected_jsd_loss` forward + backward: N = {shape['positions']} positions, V = {shape['vocab']}, "
        f"student H = {shape['student_hidden']} (float32, head trainable), teacher H = {shape['teacher_hidden']}. "
        "The floor: the four matrix products over all N rows at once (student logits 2NHV, teacher logits 2NH_tV, "
        "hidden gradient 2NHV, weight gradient 2NHV FLOPs) at the rates measured here for exactly those shapes and "
        "dtypes, plus one read of both logits and one write of the logit gradient at the copy bandwidth "
        f"({result['copy_GBps']:.1f} GB/s).",
        "",
        "| teacher | beta | chunk | step s (best) | median | floor s | products | elementwise | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['teacher_dtype']} | {row['beta']:g} | {row['chunk_size']} | {row['step_s']:.2f} | "
            f"{row['step_median_s']:.2f} | {row['floor_s']:.2f} | {row['floor_products_s']:.2f} | "
            f"{row['floor_elementwise_s']:.2f} | {row['ratio']:.2f}x |"
        )
    lines += ["", "Floor products, seconds (fastest call) and GFLOP/s:", ""]
    lines += [
        "| teacher | student logits | teacher logits | hidden gradient | weight gradient |",
        "|---|---|---|---|---|",
    ]
    student_flops, teacher_flops = result["flops"]["student (each of 3 products)"], result["flops"]["teacher"]
    for row in [
        r
        for i, r in enumerate(result["rows"])
        if i == 0 or r["teacher_dtype"] != result["rows"][i - 1]["teacher_dtype"]
    ]:
        parts = row["floor_parts_s"]
        names = ("student logits", "teacher logits", "hidden gradient", "weight gradient")
        flops = [teacher_flops if name == "teacher logits" else student_flops for name in names]
        cells = [f"{parts[name]:.2f} ({f / parts[name] / 1e9:.0f})" for name, f in zip(names, flops, strict=True)]
        lines.append(f"| {row['teacher_dtype']} | " + " | ".join(cells) + " |")
    lines += ["", "Where a profiled step's time goes (seconds of op self time; the profiler adds a little):", ""]
    names = [name for name in result["rows"][0]["profile_s"] if name != "wall"]
    heads = [f"{r['teacher_dtype'][:4]}, beta {r['beta']:g}, chunk {r['chunk_size']}" for r in result["rows"]]
    lines += ["| part | " + " | ".join(heads) + " |"]
    lines += ["|---" * (len(result["rows"]) + 1) + "|"]
    for name in [*names, "wall"]:
        lines.append(f"| {name} | " + " | ".join(f"{r['profile_s'][name]:.2f}" for r in result["rows"]) + " |")
    lines += [
        "",
        "Above the floor, seconds of the profiled step (profiled products minus the floor's products; the rest):",
        "",
    ]
    lines += [
        "| teacher | beta | chunk | products | softmax, exp, elementwise, copies | loop, Python |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        p = r["profile_s"]
        elementwise = sum(
            v for k, v in p.items() if k not in ("products (mm, addmm)", "wall") and not k.startswith("Python")
        )
        lines.append(
            f"| {r['teacher_dtype']} | {r['beta']:g} | {r['chunk_size']} | "
            f"{p['products (mm, addmm)'] - r['floor_products_s']:+.2f} | "
            f"{elementwise - r['floor_elementwise_s']:+.2f} | "
            f"{p['Python, loop, autograd (the rest of the wall time)']:.2f} |"
        )
    lines += ["", *NOTES]
    return "\n".join(lines) + "\n"


NOTES = [
    "Reading: a chunk's products multiply C rows by the whole head, so each chunk reads the student's float32 head "
    "(V x H, 545 MB here) for its logits and its hidden-state gradient, reads and writes the float32 head-weight "
    "gradient (545 MB) and reads the teacher's head; with C = 64 that is 8 times per step at N = 512, and thin "
    "(64-row) products run well below the rate of the floor's all-rows products. The elementwise work (two "
    "log-softmaxes, the exps, the mixture's logaddexp, the dot products and the gradient) runs on row blocks of "
    "at most 2**23 logits in scratch buffers reused across blocks and chunks (`ops/divergence/chunked_jsd.py`), "
    "so it makes no fresh C x V tensor; its remaining cost is arithmetic (exp and log per logit) the floor does not "
    "count.",
]


if __name__ == "__main__":
    sys.exit(main())
