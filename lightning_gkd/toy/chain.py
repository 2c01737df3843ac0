"""The second toy chat task, built for on-policy distillation: a chain of additions written out step by step, in
one of two equally valid orders.

``{"messages": [{"role": "user", "content": "23+7+25+8="}, ...], "answer": "99", "answers": [...]}`` asks
32 + 7 + 52 + 8 with every number written units digit first (as in ``addition``). The assistant adds the operands
one at a time, writing each step ``<partial>+<next>=<new partial>`` and separating steps with ``,``:

    forward order:  ``23+7=93,93+25=19,19+8=99``       (32+7=39, then +52=91, then +8=99)
    backward order: ``8+25=06,06+7=76,76+23=99``       (8+52=60, then +7=67, then +32=99)

Each row's reference uses one order, drawn at random, so a model trained on the rows (the teacher) uses both at
random: its distribution is bimodal at the first answer token and, given that token, nearly deterministic. The
answer runs 23–31 tokens with the defaults (one character each with the toy tokenizer); one wrong digit in a
partial sum is copied into every later step, so early mistakes compound into a wrong final sum.
``final_answer_match`` scores the number after the last ``=``, whichever order was used; ``answers`` holds the
teacher's two orders, ``valid_completions`` every order's completion (``first_error_position`` against those shows
where a model's answer first goes wrong).

Splits are drawn from one fixed-seed stream, test first, then val, then train, and no operand tuple repeats across
splits, so growing train never changes the held-out sets.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import permutations

from lightning_gkd.toy.addition import reversed_digits

CHAIN_SPLIT_SIZES = {"train": 50000, "val": 256, "test": 512}
_SPLIT_ORDER = ("test", "val", "train")
ORDERS = ("forward", "backward")


def chain_steps(operands: Sequence[int]) -> str:
    """The step-by-step completion adding ``operands`` in the order given, numbers written units digit first."""
    total = operands[0]
    steps = []
    for value in operands[1:]:
        steps.append(f"{reversed_digits(total)}+{reversed_digits(value)}={reversed_digits(total + value)}")
        total += value
    return ",".join(steps)


def chain_row(operands: Sequence[int], order: str) -> dict:
    """One chat row for ``operands`` whose reference completion uses ``order`` ("forward" or "backward")."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}.")
    answers = [chain_steps(operands), chain_steps(list(reversed(operands)))]
    completion = answers[ORDERS.index(order)]
    return {
        "messages": [
            {"role": "user", "content": "+".join(reversed_digits(v) for v in operands) + "="},
            {"role": "assistant", "content": completion},
        ],
        "answer": reversed_digits(sum(operands)),
        "answers": answers,
    }


def chain_rows(
    split: str = "train",
    num_rows: int | None = None,
    *,
    operands: int = 4,
    digits: int = 2,
    seed: int = 4321,
) -> list[dict]:
    """Rows of ``split`` ("train", "val" or "test"): sums of ``operands`` numbers of up to ``digits`` digits, each
    row's order drawn at random (fair coin, from the same seeded stream).

    ``num_rows`` shortens (or lengthens) the requested split; the splits drawn before it keep their default sizes.
    """
    if split not in CHAIN_SPLIT_SIZES:
        raise ValueError(f"Unknown chain split {split!r}; use one of {sorted(CHAIN_SPLIT_SIZES)}.")
    if operands < 2:
        raise ValueError(f"operands must be >= 2 (one step at least), got {operands}.")
    sizes = dict(CHAIN_SPLIT_SIZES)
    if num_rows is not None:
        sizes[split] = num_rows
    needed = sum(sizes[name] for name in _SPLIT_ORDER[: _SPLIT_ORDER.index(split) + 1])
    if needed > (10**digits) ** operands // 2:
        raise ValueError(f"{needed} rows need more than half of the operand tuples; raise digits or operands.")
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    for name in _SPLIT_ORDER:
        rows: list[dict] = []
        while len(rows) < sizes[name]:
            values = tuple(rng.randrange(10**digits) for _ in range(operands))
            order = ORDERS[rng.randrange(2)]
            if values not in seen:
                seen.add(values)
                rows.append(chain_row(values, order))
        if name == split:
            return rows
    raise AssertionError("unreachable")


def final_answer(text: str) -> str:
    """The text after the last ``=`` (the final sum of a chain completion), stripped; "" without one."""
    return text.rsplit("=", 1)[1].strip() if "=" in text else ""


def final_answer_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of predictions whose final sum (after the last ``=``) equals the reference's, whichever valid order
    either used. A generation metric (``lightning_gkd.evaluation.GenerationMetric``)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references.")
    if not predictions:
        return 0.0
    return sum(final_answer(p) == final_answer(r) != "" for p, r in zip(predictions, references, strict=True)) / len(
        predictions
    )


def first_error_position(prediction: str, answers: Sequence[str]) -> int | None:
    """The first character (= token, with the toy tokenizer) at which ``prediction`` leaves every valid completion
    in ``answers``; None when it equals one of them. A prediction that stops early errs where it stopped."""
    best = 0
    for answer in answers:
        if prediction == answer:
            return None
        common = 0
        while common < min(len(prediction), len(answer)) and prediction[common] == answer[common]:
            common += 1
        best = max(best, common)
    return best


def prompt_operands(row: dict) -> list[int]:
    """The operands of a chain row's question, in the order given."""
    return [int(v[::-1]) for v in row["messages"][0]["content"].rstrip("=").split("+")]


def valid_completions(operands: Sequence[int]) -> list[str]:
    """Every correct step-by-step completion: the operands added in any order (the teacher's two orders among
    them). A model that blends the two orders (e.g. starts with the last operand, then takes the second) writes one
    of the others."""
    return sorted({chain_steps(order) for order in permutations(operands)})


def _place_digits(numbers: Sequence[int]) -> list[list[int]]:
    """The sorted units, tens, hundreds, ... digits of ``numbers``, place by place."""
    width = max((len(str(n)) for n in numbers), default=0)
    return [sorted(n // 10**place % 10 for n in numbers) for place in range(width)]


def operand_order(text: str, operands: Sequence[int]) -> str:
    """Which order a completion adds ``operands`` in: "forward", "backward", "other" (another permutation), "blend"
    (the numbers it adds are not the operands but their digits shuffled within each place, e.g. the first operand's
    units digit with the last one's tens digit: the two orders mixed digit by digit; the sum is unchanged), or
    "invalid" (a miscopied number, a missing one)."""
    try:
        steps = [step.split("=")[0].split("+") for step in text.split(",")]
        used = [int(steps[0][0][::-1])] + [int(step[1][::-1]) for step in steps]
    except (IndexError, ValueError):
        return "invalid"
    if used == list(operands):
        return "forward"
    if used == list(reversed(operands)):
        return "backward"
    if sorted(used) == sorted(operands):
        return "other"
    return "blend" if _place_digits(used) == _place_digits(operands) else "invalid"
