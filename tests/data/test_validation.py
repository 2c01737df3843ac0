"""check_prompt_truncation: rows whose prompt loses its beginning to max_length are counted at setup; an error
(count, first row, the max_length that fits) unless the user opts in, then a warning."""

import pytest

from lightning_gkd.data.validation import check_prompt_truncation, prompt_start


def rows_of(lengths: list[tuple[int, int]]) -> list[dict]:
    """Rows carrying their own (prompt, completion) token counts; the prompt text names the row."""
    return [{"prompt": f"prompt {i}", "n": n} for i, n in enumerate(lengths)]


def by_field(row: dict) -> tuple[int, int]:
    return row["n"]


def check(rows: list[dict], max_length: int, truncate_prompts: bool = False, max_rows: int | None = None) -> None:
    check_prompt_truncation(
        rows, by_field, name="train_data", max_length=max_length, truncate_prompts=truncate_prompts, max_rows=max_rows
    )


def test_rows_that_fit_pass_silently(recwarn):
    check(rows_of([(10, 5), (12, 4), (16, 0)]), max_length=16)
    assert not recwarn.list


def test_cut_prompts_are_an_error_with_count_example_and_needed_length():
    rows = rows_of([(10, 5), (30, 4), (12, 4), (50, 9)])
    with pytest.raises(ValueError) as caught:
        check(rows, max_length=16)
    message = str(caught.value)
    assert message.startswith(
        "train_data: max_length=16 cuts the beginning off the prompt of 2 of 4 checked rows, so they would train "
        "on prompts without their start. First: row 1, 30 prompt + 4 completion tokens, prompt starts 'prompt 1'. "
        "max_length=59 fits every checked row: raise max_length (Hydra: data.max_length=59)"
    )
    assert "set truncate_prompts=True (Hydra: data.truncate_prompts=true)" in message
    assert "rows not checked" not in message


def test_a_sample_says_so():
    rows = rows_of([(10, 5), (30, 4), (40, 4), (12, 4), (10, 5), (10, 5)])
    with pytest.raises(ValueError) as caught:
        check(rows, max_length=16, max_rows=3)  # rows 0, 2, 4
    message = str(caught.value)
    assert "1 of 3 checked rows (a sample of the 6 rows: length_check_rows=3)" in message
    assert "First: row 2, 40 prompt + 4 completion tokens" in message
    assert "max_length=44 fits every checked row (rows not checked may need more)" in message


def test_opting_in_warns_with_the_count():
    rows = rows_of([(10, 5), (30, 4), (50, 9)])
    with pytest.warns(
        UserWarning,
        match=r"^train_data: max_length=16 cuts the beginning off the prompt of 2 of 3 "
        r"checked rows, first row 1 \(30 prompt \+ 4 completion tokens\); truncate_prompts=True, so "
        r"they train on their prompts' last tokens\. max_length=59 fits every checked row\.$",
    ):
        check(rows, max_length=16, truncate_prompts=True)


@pytest.mark.parametrize("truncate_prompts", [False, True])
def test_a_prompt_truncated_away_is_an_error_either_way(truncate_prompts):
    rows = rows_of([(30, 4), (3, 16)])
    with pytest.raises(
        ValueError,
        match=r"^train_data row 1: max_length=16 truncates away the whole prompt: the completion alone has 16 "
        r"tokens\. Raise max_length \(Hydra: data\.max_length\) or shorten the completion\. "
        r"Prompt starts 'prompt 1'\.$",
    ):
        check(rows, max_length=16, truncate_prompts=truncate_prompts)


def test_errors_of_the_length_function_name_the_row():
    def lengths(row: dict) -> tuple[int, int]:
        if row["prompt"] == "prompt 1":
            raise ValueError("the template cannot split it")
        return row["n"]

    with pytest.raises(ValueError, match=r"^train_data row 1: the template cannot split it$"):
        check_prompt_truncation(
            rows_of([(1, 1), (1, 1)]), lengths, name="train_data", max_length=8, truncate_prompts=False, max_rows=None
        )


@pytest.mark.parametrize(
    "row, start",
    [
        ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}, "Be brief."),
        ({"prompt": "Q: 2+2=", "chosen": " 4"}, "Q: 2+2="),
        ({"prompt": [{"role": "user", "content": "hey"}], "completion": "x"}, "hey"),
        ({"prompt_input_ids": [1, 2]}, ""),
        ({"prompt": "x" * 100}, "x" * 60),
    ],
)
def test_prompt_start(row, start):
    assert prompt_start(row) == start
