"""ValidationSettings (lightning_gkd/evaluation/settings.py): the defaults, Hydra's null metrics, and the checks."""

import pytest

from lightning_gkd.evaluation import ValidationSettings, exact_match


def test_the_defaults_and_null_metrics():
    assert ValidationSettings() == ValidationSettings(metrics={}, max_new_tokens=32)
    assert ValidationSettings(metrics=None).metrics == {}  # method.validation.metrics=null: the loss alone
    given = {"accuracy": exact_match}
    settings = ValidationSettings(metrics=given)
    assert settings.metrics == given and settings.metrics is not given  # a copy of its own
    # a metric set to null is left out: an experiment drops a default (experiment=toy_tools: accuracy: null)
    assert ValidationSettings(metrics={"accuracy": None, "success": exact_match}).metrics == {"success": exact_match}


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"metrics": {"accuracy": "exact_match"}}, TypeError, r"validation\.metrics: accuracy must be callables"),
        ({"max_new_tokens": 0}, ValueError, r"validation\.max_new_tokens must be an integer >= 1, got 0"),
    ],
)
def test_each_option_is_checked(options, error, match):
    with pytest.raises(error, match=match):
        ValidationSettings(**options)
