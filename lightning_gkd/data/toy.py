"""The bundled toy chat task: integer addition, with fixed-seed, disjoint train/val/test splits.

Rows look like ``{"messages": [{"role": "user", "content": "47+385="}, {"role": "assistant", "content": "432"}],
"answer": "432"}``; the answer is checkable exactly.
"""

from __future__ import annotations

import random

SPLIT_SIZES = {"train": 2000, "val": 200, "test": 200}
_SPLIT_ORDER = ("test", "val", "train")  # test first, so growing train never changes the held-out sets


def addition_rows(split: str = "train", num_rows: int | None = None, *, max_digits: int = 3,
                  seed: int = 1234) -> list[dict]:
    """Rows of ``split`` ("train", "val" or "test"); pairs never repeat across splits for a given seed."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"Unknown toy split {split!r}; use one of {sorted(SPLIT_SIZES)}.")
    sizes = dict(SPLIT_SIZES)
    if num_rows is not None:
        sizes[split] = num_rows
    space = (10 ** max_digits) ** 2
    total = sum(sizes.values())
    if total > space // 2:
        raise ValueError(f"{total} rows need more than half of the {space} pairs with max_digits={max_digits}; "
                         "raise max_digits or ask for fewer rows.")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    rows_by_split: dict[str, list[dict]] = {}
    for name in _SPLIT_ORDER:
        rows: list[dict] = []
        while len(rows) < sizes[name]:
            a, b = rng.randrange(10 ** max_digits), rng.randrange(10 ** max_digits)
            if (a, b) in seen:
                continue
            seen.add((a, b))
            rows.append({"messages": [{"role": "user", "content": f"{a}+{b}="},
                                      {"role": "assistant", "content": str(a + b)}],
                         "answer": str(a + b)})
        rows_by_split[name] = rows
        if name == split:
            return rows
    raise AssertionError("unreachable")
