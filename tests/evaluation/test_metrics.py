"""lightning_gkd.evaluation.metrics: the recovered fraction of the teacher–student gap."""

import math

import pytest

from lightning_gkd.evaluation.metrics import gap_closed, gaps_closed


@pytest.mark.parametrize(
    "after, before, teacher, expected",
    [
        (0.5, 0.25, 0.75, 0.5),  # half-way
        (0.75, 0.25, 0.75, 1.0),  # reached the teacher
        (0.25, 0.25, 0.75, 0.0),  # no change
        (0.125, 0.25, 0.75, -0.25),  # worse than its start
        (0.875, 0.25, 0.75, 1.25),  # past the teacher
        (0.570, 0.162, 0.980, 0.408 / 0.818),  # docs/results.md, chain task: GKD β=1 against its start and teacher
    ],
)
def test_gap_closed_is_the_share_of_the_teacher_student_gap(after, before, teacher, expected):
    assert gap_closed(after, before, teacher) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "before, teacher",
    [(0.5, 0.5), (0.6, 0.5), (0.0, 0.0), (math.nan, 0.5), (0.5, math.nan)],
)
def test_no_gap_to_close_when_the_teacher_does_not_score_above_the_start(before, teacher):
    assert gap_closed(0.7, before, teacher) is None


def test_gaps_closed_per_metric_present_in_all_three():
    after = {"accuracy": 0.5, "f1": 0.4, "only_after": 1.0}
    before = {"accuracy": 0.25, "f1": 0.4}
    teacher = {"accuracy": 0.75, "f1": 0.3, "only_teacher": 1.0}
    assert gaps_closed(after, before, teacher) == {"accuracy": 0.5, "f1": None}
