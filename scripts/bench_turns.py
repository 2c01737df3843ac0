"""The per-turn sampling cost of a multi-turn rollout with ``sampler=hf``: re-prefilling every turn against reusing
each row's KV cache across turns, side by side in one run (lightning_gkd.studies.turn_bench). Writes
docs/benchmarks_turns.md and docs/benchmarks_turns.json.

    .venv/bin/python scripts/bench_turns.py                      # the small shape's student, 4 turns, 5 repeats
    .venv/bin/python scripts/bench_turns.py --shape real         # Qwen2.5-0.5B's shape (slow on a CPU)
    .venv/bin/python scripts/bench_turns.py --tiny --out /tmp/bt # the same code at toy sizes (a check)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from lightning_gkd.studies.turn_bench import TurnBenchConfig, page, run

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small", help="a lightning_gkd.studies.bench_models shape")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: a check of the script, not a measurement")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens sampled per row and turn")
    parser.add_argument("--reply-tokens", type=int, default=96, help="tokens of the environment's reply")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args(argv)
    tiny = {"prompt_min": 12, "prompt_max": 20, "new_tokens": 6, "reply_tokens": 5} if args.tiny else {}
    options = {"new_tokens": args.new_tokens, "reply_tokens": args.reply_tokens, **tiny}
    config = TurnBenchConfig(
        shape=args.shape,
        tiny=args.tiny,
        turns=args.turns,
        repeats=args.repeats,
        threads=args.threads or None,
        **options,
    )
    before = os.getloadavg()
    started = time.perf_counter()
    result = run(config)
    minutes = (time.perf_counter() - started) / 60
    after = os.getloadavg()
    load = f"1-minute load average {before[0]:.1f} before and {after[0]:.1f} after on {os.cpu_count()} cores"
    command = shlex.join(["python", "scripts/bench_turns.py", *(argv if argv is not None else sys.argv[1:])])
    result.update({"command": command, "load": load, "minutes": minutes})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmarks_turns.json").write_text(json.dumps(result, indent=2) + "\n")
    text = page(result, command=command, load=load, minutes=minutes)
    (args.out / "benchmarks_turns.md").write_text(text)
    print(text)
    return 0 if result["transcripts_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
