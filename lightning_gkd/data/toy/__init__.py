"""The bundled toy tasks: 3-digit addition written units digit first (``addition``) and preference pairs made
from it (``preference``)."""

from lightning_gkd.data.toy.addition import SPLIT_SIZES, addition_row, addition_rows, reversed_digits
from lightning_gkd.data.toy.preference import addition_preference_rows, wrong_answer

__all__ = [
    "SPLIT_SIZES",
    "addition_preference_rows",
    "addition_row",
    "addition_rows",
    "reversed_digits",
    "wrong_answer",
]
