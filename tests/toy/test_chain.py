"""lightning_gkd.toy.chain: the step-by-step chain-of-additions task, its metric and its error positions."""

import pytest

from lightning_gkd.toy.chain import (
    chain_row,
    chain_rows,
    chain_steps,
    final_answer,
    final_answer_match,
    first_error_position,
    operand_order,
    prompt_operands,
    valid_completions,
)
from lightning_gkd.toy.tasks import TOY_TASKS, toy_task


def digits_first(text: str) -> int:
    return int(text[::-1])


def test_steps_add_left_to_right_with_every_number_units_digit_first():
    # 32 + 7 = 39, + 52 = 91, + 8 = 99
    assert chain_steps([32, 7, 52, 8]) == "23+7=93,93+25=19,19+8=99"
    row = chain_row([32, 7, 52, 8], "backward")
    assert row["messages"][0]["content"] == "23+7+25+8="
    assert row["messages"][1]["content"] == "8+25=06,06+7=76,76+23=99" == row["answers"][1]
    assert row["answer"] == "99"
    with pytest.raises(ValueError, match="order must be one of"):
        chain_row([1, 2], "sideways")


def test_every_step_is_a_correct_sum_in_both_orders():
    for row in chain_rows("val"):
        operands = [digits_first(v) for v in row["messages"][0]["content"].rstrip("=").split("+")]
        for answer in row["answers"]:
            partial = None
            for step in answer.split(","):
                left, total = step.split("=")
                a, b = (digits_first(v) for v in left.split("+"))
                assert a + b == digits_first(total)
                assert partial is None or a == partial  # each step starts from the previous partial sum
                partial = a + b
            assert partial == sum(operands) == digits_first(row["answer"])


def test_splits_are_disjoint_fixed_and_use_both_orders_about_equally():
    test, val = chain_rows("test"), chain_rows("val")
    train = chain_rows("train", 5000)
    prompts = [{r["messages"][0]["content"] for r in split} for split in (test, val, train)]
    assert sum(len(p) for p in prompts) == len(set().union(*prompts)) == len(test) + len(val) + len(train)
    assert chain_rows("test") == test and chain_rows("train", 100) == train[:100]  # growing train keeps the rest
    forward = sum(r["messages"][1]["content"] == r["answers"][0] for r in train) / len(train)
    assert 0.47 < forward < 0.53
    lengths = [len(r["messages"][1]["content"]) for r in train]
    assert 20 <= min(lengths) and max(lengths) <= 40


def test_final_answer_match_scores_the_final_sum_whichever_order():
    references = ["23+7=93,93+25=19,19+8=99", "23+7=93,93+25=19,19+8=99", "1+1=2", "1+1=2"]
    predictions = ["8+25=06,06+7=76,76+23=99", "23+7=93,93+25=19,19+8=98", "2", ""]
    assert final_answer("a=b=12 ") == "12" and final_answer("12") == ""
    assert final_answer_match(predictions, references) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        final_answer_match(["a", "b"], ["c"])


def test_first_error_position_follows_the_order_the_prediction_took():
    answers = ["23+7=93,93+25=19", "25+7=23,23+23=19"]
    assert first_error_position("23+7=93,93+25=19", answers) is None
    assert first_error_position("25+7=24,24+23=29", answers) == 6  # the backward order, a wrong sum digit
    assert first_error_position("23+7=9", answers) == 6  # stopped early
    assert first_error_position("x", answers) == 0


def test_the_tasks_registry_names_both_tasks():
    assert set(TOY_TASKS) >= {"addition", "chain"}
    assert toy_task("chain").rows is chain_rows and toy_task("chain").max_new_tokens > 31
    with pytest.raises(ValueError, match="Unknown toy task 'nope'"):
        toy_task("nope")


def test_valid_completions_are_every_order_and_orders_are_named():
    row = chain_row([32, 7, 52, 8], "forward")
    operands = prompt_operands(row)
    assert operands == [32, 7, 52, 8]
    valid = valid_completions(operands)
    assert len(valid) == 24 and set(row["answers"]) < set(valid)
    blended = chain_steps([8, 7, 52, 32])  # starts backward, then takes the forward order's second operand
    assert blended in valid and first_error_position(blended, row["answers"]) == 2  # "8+" then 7, not 25
    assert first_error_position(blended, valid) is None
    assert operand_order(row["answers"][0], operands) == "forward"
    assert operand_order(row["answers"][1], operands) == "backward"
    assert operand_order(blended, operands) == "other"
    assert operand_order("8+25=06,06+8=", operands) == "invalid"  # 8 taken twice, 7 never
    # the first operand's units digit with the last one's tens digit, and the other way round: a digit-level blend
    # of the two orders whose final sum is still right
    blend = "82+91=74,74+65=301,301+96=271"
    assert operand_order(blend, [68, 19, 56, 29]) == "blend" and final_answer(blend) == "271" == str(172)[::-1]
    assert operand_order("garbage", operands) == "invalid"
