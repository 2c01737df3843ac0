"""data/chat_tokens.py with chat templates whose prompt is not a prefix of the conversation: a hand-written template
that moves the system prompt into the last user turn and opens its generation prompt with an empty reasoning block
(as Qwen3 does without thinking), so neither the prompt nor the earlier turns' prefixes start the conversation's
render. Exact label tokens by the documented rule (the content's start to the end, or the template's own
``{% generation %}`` blocks), the template's prompt for sampling, and a tiny fit through a real Trainer."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, GKDModule, SFTModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.chat_tokens import has_generation_blocks, render_chat, tokenize_chat
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.samplers import Sampler
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm


def template(generation: bool) -> str:
    """System prompt inside the last user turn; an empty think block opens the generation prompt only."""
    open_, close = ("{% generation %}", "{% endgeneration %}") if generation else ("", "")
    return (
        "{%- set ns = namespace(system='', last_user=-1) -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}"
        "{%- elif m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}"
        "{{ '<|im_start|>user\\n' }}"
        "{%- if loop.index0 == ns.last_user and ns.system -%}{{ ns.system + '\\n\\n' }}{%- endif -%}"
        "{{ m['content'] + '<|im_end|>\\n' }}"
        "{%- elif m['role'] == 'assistant' -%}"
        "{{ '<|im_start|>assistant\\n' }}" + open_ + "{{ m['content'] + '<|im_end|>' }}" + close + "{{ '\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    )


CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+5="},
    {"role": "assistant", "content": "8"},
]


@pytest.fixture()
def non_prefix(tokenizer):
    def make(generation: bool):
        out = copy.deepcopy(tokenizer)
        out.chat_template = template(generation)
        return out

    return make


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_template_is_not_a_prefix_template(non_prefix):
    tok = non_prefix(False)
    prompt = render_chat(tok, CONVERSATION[:-1], add_generation_prompt=True)
    full = render_chat(tok, CONVERSATION)
    assert not full.startswith(prompt)
    assert prompt.endswith("<think>\n\n</think>\n\n") and "Answer with a number.\n\n3+5=" in full
    assert not full.startswith(render_chat(tok, CONVERSATION[: 1 + 1], add_generation_prompt=True))  # earlier turns too
    assert not has_generation_blocks(tok) and has_generation_blocks(non_prefix(True))


def test_without_generation_blocks_the_completion_runs_from_the_contents_start(non_prefix):
    tok = non_prefix(False)
    chat = tokenize_chat(tok, CONVERSATION, max_length=512)
    full = render_chat(tok, CONVERSATION)
    assert chat.ids == encode(tok, full)
    completion = encode(tok, "8<|im_end|>\n")
    labels = chat.labels()
    assert labels[-len(completion) :] == completion and set(labels[: -len(completion)]) == {IGNORE_INDEX}
    assert chat.prompt() == encode(tok, render_chat(tok, CONVERSATION[:-1], add_generation_prompt=True))
    with pytest.raises(ValueError, match=r"no \{% generation %\} blocks, so the earlier assistant turns cannot"):
        tokenize_chat(tok, CONVERSATION, max_length=512, assistant_turns="all")


def test_generation_blocks_give_the_templates_own_assistant_tokens(non_prefix):
    tok = non_prefix(True)
    full = render_chat(tok, CONVERSATION)
    last = tokenize_chat(tok, CONVERSATION, max_length=512)
    every = tokenize_chat(tok, CONVERSATION, max_length=512, assistant_turns="all")
    answer = encode(tok, "8<|im_end|>")
    assert last.ids == encode(tok, full)[: len(last.ids)] and last.ids[-len(answer) :] == answer  # trailing \n dropped
    assert [t for t in last.labels() if t != IGNORE_INDEX] == answer
    assert [t for t in every.labels() if t != IGNORE_INDEX] == encode(tok, "4<|im_end|>") + answer
    assert (
        last.prompt() == every.prompt() == encode(tok, render_chat(tok, CONVERSATION[:-1], add_generation_prompt=True))
    )


def test_truncation_keeps_the_completion_and_the_end_of_the_sampling_prompt(non_prefix):
    tok = non_prefix(False)
    whole = tokenize_chat(tok, CONVERSATION, max_length=512)
    cut = tokenize_chat(tok, CONVERSATION, max_length=len(whole.ids) - 10)
    assert cut.ids == whole.ids[10:] and cut.labels() == whole.labels()[10:]
    assert cut.prompt() == whole.prompt()[10:]


def rows(count: int) -> list[dict]:
    out = []
    for i in range(count):
        a, b = i % 7, (3 * i) % 5
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "Add."},
                    {"role": "user", "content": f"{a}+{b}="},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
        )
    return out


class Recording(Sampler):
    def __init__(self, inner):
        self.inner, self.prompts = inner, []

    def sample(self, model, prompts, prompt_attention_mask, *, seed, vision=None):
        self.prompts.append(prompts[prompt_attention_mask.bool()].tolist())
        return self.inner.sample(model, prompts, prompt_attention_mask, seed=seed)


@pytest.mark.parametrize("generation", [False, True])
def test_a_tiny_fit_trains_on_the_template_and_samples_from_its_prompt(non_prefix, generation, tmp_path):
    tok = non_prefix(generation)
    data = ChatDataModule(tok, rows(16), rows(4), batch_size=4, max_length=96, seed=0)
    sft = SFTModule(tiny_causal_lm(TINY_STUDENT, tok, seed=0), tok, validation={"metrics": {}})
    batch = ChatMLCollator(tok, max_length=96)(rows(4))
    with torch.no_grad():
        before = float(sft.completion_loss(batch).loss)
    small_trainer(tmp_path, max_steps=8).fit(sft, datamodule=data)
    with torch.no_grad():
        assert float(sft.completion_loss(batch).loss) < before

    gkd = GKDModule(
        tiny_causal_lm(TINY_STUDENT, tok, seed=0),
        tiny_causal_lm(TINY_TEACHER, tok, seed=1),
        tok,
        lmbda=1.0,
        sampling={"max_new_tokens": 4},
        training={"frozen_dtype": "float32"},
        validation={"metrics": {}},
    )
    gkd.sampler = recorder = Recording(gkd.sampler)
    loss = gkd.training_step(batch, 0)
    assert torch.isfinite(loss)
    think = encode(tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert recorder.prompts and all(len(p) > len(think) for p in recorder.prompts)
    prompt_rows = [p for p in batch["prompts"]]
    for row, mask in zip(prompt_rows, batch["prompt_attention_mask"], strict=True):
        assert row[mask.bool()].tolist()[-len(think) :] == think


def test_a_prefix_template_that_rewrites_earlier_turns_takes_its_generation_blocks_for_every_turn(tokenizer):
    """Earlier assistant turns lose their reasoning (Qwen3-style) once a later turn follows: the prompt is a prefix of
    the conversation, but the renders up to an earlier turn are not; the {% generation %} blocks locate them."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{%- for m in messages -%}"
        "{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] == 'assistant' -%}{% generation %}"
        "{{ (m['content'] if loop.last else m['content'].split('</think>')[-1]) + '<|im_end|>' }}"
        "{% endgeneration %}{{ '\\n' }}"
        "{%- else -%}{{ m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    conversation = [
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "<think>two and two</think>4"},
        {"role": "user", "content": "3+5="},
        {"role": "assistant", "content": "<think>add</think>8"},
    ]
    chat = tokenize_chat(tok, conversation, max_length=512, assistant_turns="all")
    expected = encode(tok, "4<|im_end|>") + encode(tok, "<think>add</think>8<|im_end|>")
    assert [t for t in chat.labels() if t != IGNORE_INDEX] == expected
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    with pytest.raises(ValueError, match="up to assistant message 1 differently"):
        tokenize_chat(tok, conversation, max_length=512, assistant_turns="all")
