"""The bundled toy chat task: multi-digit addition written digit by digit, least-significant digit first.

``{"messages": [{"role": "user", "content": "743+58="}, {"role": "assistant", "content": "234"}],
"answer": "234"}`` asks 347 + 85 = 432 with every number, in the question and the answer, written units digit
first (347 -> "743"). Written this way each answer digit depends on two question digits and
the carry from the digit just produced, so a model that writes one wrong digit tends to derail the rest: the
compounding of its own mistakes that on-policy distillation targets. Answers are checked by exact match.

Splits are drawn from one fixed-seed stream, test first, then val, then train, and no (a, b) pair repeats
across splits, so growing train never changes the held-out sets.
"""

from __future__ import annotations

import random

SPLIT_SIZES = {"train": 20000, "val": 256, "test": 512}
_SPLIT_ORDER = ("test", "val", "train")


def reversed_digits(number: int) -> str:
    """347 -> "743"."""
    return str(number)[::-1]


def addition_row(a: int, b: int) -> dict:
    answer = reversed_digits(a + b)
    return {
        "messages": [
            {"role": "user", "content": f"{reversed_digits(a)}+{reversed_digits(b)}="},
            {"role": "assistant", "content": answer},
        ],
        "answer": answer,
    }


def addition_rows(
    split: str = "train", num_rows: int | None = None, *, digits: int = 3, seed: int = 1234
) -> list[dict]:
    """Rows of ``split`` ("train", "val" or "test"), operands with up to ``digits`` digits.

    ``num_rows`` shortens (or lengthens) the requested split; the splits drawn before it keep their default
    sizes, so a short train split still never overlaps the default val/test splits.
    """
    if split not in SPLIT_SIZES:
        raise ValueError(f"Unknown toy split {split!r}; use one of {sorted(SPLIT_SIZES)}.")
    sizes = dict(SPLIT_SIZES)
    if num_rows is not None:
        sizes[split] = num_rows
    space = (10**digits) ** 2
    needed = sum(sizes[name] for name in _SPLIT_ORDER[: _SPLIT_ORDER.index(split) + 1])
    if needed > space // 2:
        raise ValueError(
            f"{needed} rows need more than half of the {space} operand pairs with digits={digits}; "
            "raise digits or ask for fewer rows."
        )
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    for name in _SPLIT_ORDER:
        rows: list[dict] = []
        while len(rows) < sizes[name]:
            a, b = rng.randrange(10**digits), rng.randrange(10**digits)
            if (a, b) not in seen:
                seen.add((a, b))
                rows.append(addition_row(a, b))
        if name == split:
            return rows
    raise AssertionError("unreachable")
