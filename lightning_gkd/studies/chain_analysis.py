"""What a model's completions of the chain task's test prompts (``lightning_gkd.toy.chain``) say beyond the final
sum: where each row's first error falls, whether the whole chain is right, and in which order of the operands it was
written (forward, backward, another order, a digit-by-digit blend of the two, or invalid)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_gkd.toy.chain import first_error_position, operand_order, prompt_operands, valid_completions

#: the ``operand_order`` categories, in the order the tables show them
ORDERS = ("forward", "backward", "other", "blend", "invalid")


def first_errors(texts: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[int | None]:
    """Each completion's first-error position: the first character that leaves every correct completion of its row
    (in any order of the operands); None for a correct one."""
    return [
        first_error_position(text, valid_completions(prompt_operands(row)))
        for text, row in zip(texts, rows, strict=True)
    ]


def cumulative_errors(errors: Sequence[int | None], length: int) -> list[float]:
    """Share of rows whose first error is at a position <= t, for t in 0..length-1."""
    return [sum(e is not None and e <= t for e in errors) / max(len(errors), 1) for t in range(length)]


def completion_scores(texts: Sequence[str], rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The share of ``texts`` that is a fully correct chain (every step right, in any order of the operands), and the
    share in each ``ORDERS`` category."""
    operands = [prompt_operands(row) for row in rows]
    orders = [operand_order(text, ops) for text, ops in zip(texts, operands, strict=True)]
    return {
        "valid_chain": sum(t in valid_completions(ops) for t, ops in zip(texts, operands, strict=True)) / len(rows),
        **{order: orders.count(order) / len(rows) for order in ORDERS},
    }


def orders_text(shares: dict[str, float], names: Sequence[str] = ORDERS) -> str:
    """``completion_scores``' shares of ``names`` as percentages, "a / b / ..."."""
    return " / ".join(f"{shares[name]:.0%}" for name in names)
