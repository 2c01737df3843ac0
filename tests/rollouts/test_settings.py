"""RolloutSettings (lightning_gkd/rollouts/settings.py): TRL's names and defaults, the ranges checked when made, and
``enabled`` (tools or an environment)."""

import pytest

from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_tokenizer
from lightning_gkd.rollouts import RolloutSettings, build_rollout
from lightning_gkd.toy.tools import TOOLS


@pytest.fixture(scope="module")
def tool_tokenizer():
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = TOOLS_CHATML_TEMPLATE
    return tokenizer


def test_the_defaults_and_hydras_nulls():
    settings = RolloutSettings()
    assert settings.tools == () and settings.environment is None and not settings.enabled
    assert (settings.max_tool_calling_iterations, settings.tool_timeout) == (5, 10.0)
    assert settings.max_transcript_tokens is None and settings.tool_state_columns == () and settings.tool_parser is None
    from_hydra = RolloutSettings(tools=None, tool_state_columns=["facts"])  # method.rollout.tools: null, a list
    assert from_hydra.tools == () and from_hydra.tool_state_columns == ("facts",)
    assert RolloutSettings(tools=["lightning_gkd.toy.tools.add"]).enabled
    assert RolloutSettings(environment=lambda messages, row: None).enabled


@pytest.mark.parametrize(
    "options, match",
    [
        ({"max_tool_calling_iterations": -1}, r"rollout\.max_tool_calling_iterations must be an integer >= 0, got -1"),
        ({"max_tool_calling_iterations": 2.0}, r"rollout\.max_tool_calling_iterations must be an integer >= 0"),
        ({"tool_timeout": 0}, r"rollout\.tool_timeout must be > 0 seconds, got 0"),
        ({"max_transcript_tokens": 0}, r"rollout\.max_transcript_tokens must be an integer >= 1 or null .*got 0"),
    ],
)
def test_each_range_is_checked(options, match):
    with pytest.raises(ValueError, match=match):
        RolloutSettings(**options)


def test_build_rollout_makes_the_rollout_the_settings_describe(tool_tokenizer):
    assert build_rollout(tool_tokenizer, RolloutSettings(), eos_token_ids=[]) is None
    settings = RolloutSettings(tools=list(TOOLS), max_tool_calling_iterations=3, max_transcript_tokens=99)
    rollout = build_rollout(tool_tokenizer, settings, eos_token_ids=[tool_tokenizer.eos_token_id])
    assert rollout is not None and rollout.max_iterations == 3 and rollout.max_transcript_tokens == 99
    both = RolloutSettings(tools=list(TOOLS), environment=lambda messages, row: None)
    with pytest.raises(ValueError, match=r"Give tools .* or an environment .*not both"):
        build_rollout(tool_tokenizer, both, eos_token_ids=[])
