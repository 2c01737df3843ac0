"""Multi-turn rollouts: the student acts over several turns, an environment (tools, a simulated user) answers, and
the transcript becomes one training row whose labels are the student's tokens only (the tool mask).
``MultiTurnRollout`` runs them through any sampler; ``ToolEnvironment`` runs tool calls (``tools``: schemas, timeouts,
failures as ``{"error": ...}``); ``parsers`` read calls from a turn; ``row_state()`` gives a tool its row's columns.
``RolloutSettings``: a method's or a command's settings of them, which ``build_rollout`` makes a rollout of."""

from lightning_gkd.rollouts.environment import Environment, EnvironmentReply, ToolEnvironment
from lightning_gkd.rollouts.parsers import HermesToolCallParser, ResponseSchemaParser, ToolCallParser, default_parser
from lightning_gkd.rollouts.rollout import (
    MultiTurnRollout,
    RolloutStats,
    build_environment,
    build_rollout,
    continuation_ids,
    first_segments,
    reasoning_span,
    rollout_transcripts,
)
from lightning_gkd.rollouts.settings import RolloutSettings
from lightning_gkd.rollouts.tools import FAILURE_KINDS, Tool, ToolCall, ToolResult, build_tools, row_state

__all__ = [
    "FAILURE_KINDS",
    "Environment",
    "EnvironmentReply",
    "HermesToolCallParser",
    "MultiTurnRollout",
    "ResponseSchemaParser",
    "RolloutSettings",
    "RolloutStats",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolResult",
    "build_environment",
    "build_rollout",
    "build_tools",
    "continuation_ids",
    "default_parser",
    "first_segments",
    "reasoning_span",
    "rollout_transcripts",
    "row_state",
]
