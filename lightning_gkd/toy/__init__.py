"""The bundled toy tasks: 3-digit addition written units digit first (``addition``), preference pairs made from it
(``preference``), sums of four numbers written step by step in one of two orders (``chain``), an agentic task
whose answers need the ``lookup`` and ``add`` tools (``tools``), and one where a miscopied key is a tool error to
recover from (``recovery``)."""

from lightning_gkd.toy.addition import SPLIT_SIZES, addition_row, addition_rows, reversed_digits
from lightning_gkd.toy.chain import chain_rows, final_answer_match
from lightning_gkd.toy.preference import addition_preference_rows, wrong_answer
from lightning_gkd.toy.recovery import recovery_rows
from lightning_gkd.toy.shapes import shape_rows
from lightning_gkd.toy.tools import tool_rows

__all__ = [
    "SPLIT_SIZES",
    "addition_preference_rows",
    "addition_row",
    "addition_rows",
    "chain_rows",
    "final_answer_match",
    "recovery_rows",
    "reversed_digits",
    "shape_rows",
    "tool_rows",
    "wrong_answer",
]
