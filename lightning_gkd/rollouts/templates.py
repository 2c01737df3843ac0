"""Checks that a chat template can carry a multi-turn rollout, run before any model loads."""

from __future__ import annotations

from typing import Any

_PROBE_RESULT = "probe-tool-result-7319"


def check_template_renders_tools(tokenizer: Any, tools: list[dict] | None) -> None:
    """ValueError naming the template and what it leaves out when it cannot render ``tools`` (their names must appear
    in a rendered prompt) or tool messages (a tool message's content must appear, after an assistant turn)."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    fix = (
        "Use a chat template that renders tools and tool messages (e.g. Qwen2.5's; lightning_gkd.data.tokenizer."
        "TOOLS_CHATML_TEMPLATE for ChatML), set through data.chat_template (ChatDataModule(chat_template=...)) "
        "and the tokenizer the method is given."
    )
    user = {"role": "user", "content": "probe"}
    if tools:
        try:
            text = tokenizer.apply_chat_template([user], tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as error:
            raise ValueError(f"The chat template of {name!r} fails to render tools ({error}). {fix}") from error
        missing = [tool["function"]["name"] for tool in tools if tool["function"]["name"] not in str(text)]
        if missing:
            raise ValueError(
                f"The chat template of {name!r} does not render tools: a prompt rendered with tools={missing} "
                f"leaves their names out, so the student would never see them. {fix}"
            )
    messages = [
        user,
        {"role": "assistant", "content": "call"},
        {"role": "tool", "name": "probe", "content": _PROBE_RESULT},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as error:
        raise ValueError(f"The chat template of {name!r} fails to render a tool message ({error}). {fix}") from error
    if _PROBE_RESULT not in str(text):
        raise ValueError(
            f"The chat template of {name!r} does not render tool messages (role 'tool'): their content is left out, "
            f"so the student would never read a tool's result. {fix}"
        )
