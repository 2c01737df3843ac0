"""lightning_gkd.studies.chain_analysis: first errors, correct chains and operand orders of chain completions."""

import pytest

from lightning_gkd.studies.chain_analysis import (
    ORDERS,
    completion_scores,
    cumulative_errors,
    first_errors,
    orders_text,
)
from lightning_gkd.toy.chain import chain_row

OPERANDS = [12, 34, 56, 78]


def test_completions_are_scored_by_chain_and_by_the_order_of_their_operands():
    row = chain_row(OPERANDS, "forward")
    forward, backward = row["answers"]  # the teacher's two orders
    other = "43+21=64,64+65=201,201+87=081"  # the second operand first: another valid order
    miscopied = forward.replace("21+", "22+", 1)
    texts = [forward, backward, other, miscopied]
    scores = completion_scores(texts, [row] * 4)
    assert scores["valid_chain"] == 0.75
    assert {order: scores[order] for order in ORDERS} == {
        "forward": 0.25,
        "backward": 0.25,
        "other": 0.25,
        "blend": 0.0,
        "invalid": 0.25,
    }
    assert orders_text(scores) == "25% / 25% / 25% / 0% / 25%"
    assert orders_text(scores, ("forward", "backward")) == "25% / 25%"


def test_the_first_error_is_where_a_completion_leaves_every_correct_one():
    row = chain_row(OPERANDS, "forward")
    correct = row["answers"][0]  # 21+43=64,...
    assert first_errors([correct, "21+43=65,65+65=301,301+87=091", "21+4", ""], [row] * 4) == [None, 7, 4, 0]


@pytest.mark.parametrize(
    "errors, length, expected",
    [([None, 0, 2, 2], 4, [0.25, 0.25, 0.75, 0.75]), ([], 2, [0.0, 0.0]), ([1], 1, [0.0])],
)
def test_cumulative_errors_are_the_share_of_rows_gone_wrong_by_each_position(errors, length, expected):
    assert cumulative_errors(errors, length) == expected
