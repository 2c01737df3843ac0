"""Chat templates that rewrite earlier turns, for rollout tests: a Qwen3-style one (every assistant turn but the
last loses its ``<think>`` block) and one that rewrites earlier tool calls (``"arguments"`` becomes ``"args"``). Both
render tools like ``TOOLS_CHATML_TEMPLATE``."""

from __future__ import annotations

from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_tokenizer

_TOOLS_HEADER = TOOLS_CHATML_TEMPLATE[: TOOLS_CHATML_TEMPLATE.index("{% for message in messages %}")]

#: Qwen3-style: the reasoning (``<think>...</think>``) of every assistant turn but the last is dropped.
DROPS_EARLIER_REASONING = (
    _TOOLS_HEADER + "{% set ns = namespace(last=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set ns.last = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.index0 != ns.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Earlier tool calls rewritten: every assistant message but the conversation's last renders ``"args"`` for
#: ``"arguments"`` (as templates that re-serialise structured tool calls change their text).
REWRITES_TOOL_CALLS = (
    _TOOLS_HEADER + "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content | replace('\"arguments\":', '\"args\":') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_with(template: str):
    """The byte-level ChatML tokenizer with ``template``."""
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = template
    return tokenizer
