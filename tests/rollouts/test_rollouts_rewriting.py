"""Multi-turn rollouts with chat templates that rewrite earlier turns (lightning_gkd.rollouts.rollout): each turn is
trained in the context the template rendered when it was written, a transcript becomes several rows (segments)
where the template rewrites, the step's token mean stays exact over them; reasoning kept, dropped or capped; a
teacher of another tokenizer scoring every turn in its own rendering."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, GKDModule, OPDModule, RolloutSettings
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.chat_tokens import render_chat
from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_bpe_tokenizer
from lightning_gkd.methods.on_policy import rollout_settings_for_teacher
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.sampling import completion_batch
from lightning_gkd.rollouts import MultiTurnRollout, build_environment, reasoning_span, rollout_transcripts
from lightning_gkd.samplers import Sampler
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm
from lightning_gkd.toy.tools import TOOLS, tool_rows
from tests.helpers.rewriting_templates import DROPS_EARLIER_REASONING, REWRITES_TOOL_CALLS, tokenizer_with
from tests.helpers.scripted_sampler import ScriptedSampler
from tests.helpers.tool_runs import grouped_tool_run, reference_script


@pytest.fixture(scope="module")
def reasoning_tokenizer():
    return tokenizer_with(DROPS_EARLIER_REASONING)


@pytest.fixture(scope="module")
def rewriting_tokenizer():
    return tokenizer_with(REWRITES_TOOL_CALLS)


def thinking_rows(count: int, split: str = "train") -> list[dict]:
    """Toy tool rows whose assistant turns start with a short reasoning block."""
    rows = tool_rows(split, count)
    for row in rows:
        for k, message in enumerate(m for m in row["messages"] if m["role"] == "assistant"):
            message["content"] = f"<think>step {k}</think>" + message["content"]
    return rows


def rollout_for(tokenizer, **options) -> MultiTurnRollout:
    environment, schemas = build_environment(list(TOOLS), None, tokenizer, timeout=5.0)
    return MultiTurnRollout(
        tokenizer,
        environment,
        eos_token_ids=[tokenizer.eos_token_id],
        max_iterations=4,
        tools=schemas,
        state_columns=["facts"],
        **options,
    )


def roll(tokenizer, rows, rollout=None, sampler=None):
    rollout = rollout or rollout_for(tokenizer)
    collator = ChatMLCollator(
        tokenizer, columns=["facts"], carry_prompt_messages=True, tools=rollout.tools, first_turn_prompts=True
    )
    sampler = sampler or ScriptedSampler(tokenizer, reference_script(rows))
    return rollout.run(lambda i, m, s: sampler.sample(None, i, m, seed=s), collator(rows), seed=0)


def row_ids(out, r: int, key: str = "input_ids") -> list[int]:
    return out[key][r][out["attention_mask"][r].bool()].tolist()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- segments --------------------------------------------------------------------------------------------------------
def test_a_template_that_drops_earlier_reasoning_trains_each_turn_in_the_context_it_was_written_in(
    reasoning_tokenizer,
):
    """The Qwen3-style template keeps a turn's reasoning while it is the last assistant turn: turns 1-2 share the
    first context (one row), then each later turn's context is the template's new render (earlier reasoning gone),
    a row each. Hand-built ids and labels for every row."""
    tok = reasoning_tokenizer
    row = thinking_rows(1)[0]
    out, stats = roll(tok, [row])
    messages, schemas = row["messages"], rollout_for(tok).tools
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]  # 1, 3, 5, 7
    assert stats.segments == [3] and stats.turns == [4] and stats.calls == [3]
    assert out["segment"].tolist() == [0, 1, 2] and out["transcript_row"].tolist() == [0, 0, 0]
    eos = tok.eos_token_id

    def turn_ids(k: int) -> list[int]:
        return encode(tok, messages[k]["content"]) + [eos]

    # row 0: the prompt, turn 1, the tool reply and the next prompt as ChatML continues them, turn 2
    context = encode(tok, render_chat(tok, messages[:1], True, schemas))
    between = encode(tok, render_chat(tok, messages[:3], True, schemas))[len(context) + len(turn_ids(1)) :]
    assert row_ids(out, 0) == context + turn_ids(1) + between + turn_ids(3)
    assert [t for t in row_ids(out, 0, "labels") if t != IGNORE_INDEX] == turn_ids(1) + turn_ids(3)
    # rows 1 and 2: the template's render of everything before the turn, then the turn; only the turn is labelled
    for r, k in ((1, turns[2]), (2, turns[3])):
        context = encode(tok, render_chat(tok, messages[:k], True, schemas))
        assert "step 0" not in tok.decode(context)  # earlier reasoning dropped by the template
        assert row_ids(out, r) == context + turn_ids(k)
        labels = row_ids(out, r, "labels")
        assert labels == [IGNORE_INDEX] * len(context) + turn_ids(k)
        assert out["prompt_messages"][r] == messages[:k]
    # the prompt columns are each row's context; the rollout's transcript is whole, once per transcript
    assert out["prompts"].shape[0] == 3 and rollout_transcripts(out) == [messages]
    assert out["facts"] == [row["facts"]] * 3


def test_a_template_that_rewrites_tool_calls_makes_every_later_turn_a_row(rewriting_tokenizer):
    rows = tool_rows("train", 3)
    out, stats = roll(rewriting_tokenizer, rows)
    assert stats.segments == [4, 4, 4]  # every turn after a reply is rewritten once a later turn exists
    assert out["transcript_row"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # every student token a label exactly once: 4 turns per transcript, each ending with its EOS
    eos = rewriting_tokenizer.eos_token_id
    per_transcript = (out["labels"] == eos).sum(dim=1).view(3, 4).sum(dim=1)
    assert per_transcript.tolist() == [4, 4, 4]
    written = sum(len(encode(rewriting_tokenizer, m["content"])) + 1 for m in rows[0]["messages"][1::2])
    assert int((out["labels"][:4] != IGNORE_INDEX).sum()) == written
    assert '"args":' in rewriting_tokenizer.decode(row_ids(out, 3))  # its context: the rewritten calls


def test_a_prefix_keeping_template_stays_one_row_per_transcript_and_split_turns_makes_a_row_per_turn():
    tok = tokenizer_with(TOOLS_CHATML_TEMPLATE)
    rows = tool_rows("train", 2)
    whole, stats = roll(tok, rows)
    assert stats.segments == [1, 1] and whole["segment"].tolist() == [0, 0]
    split, stats = roll(tok, rows, rollout_for(tok, split_turns=True))
    assert stats.segments == [4, 4]
    # the same labelled tokens, in as many rows as turns
    assert sorted(whole["labels"][whole["labels"] != IGNORE_INDEX].tolist()) == sorted(
        split["labels"][split["labels"] != IGNORE_INDEX].tolist()
    )


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_teachers_score_of_each_turn_equals_scoring_that_turn_alone_in_its_context(reasoning_tokenizer, beta):
    """GKD's token-summed loss over a transcript's segments equals the sum, over its turns, of each turn scored
    alone (its context as rendered when it was written, the turn labelled): the split changes nothing a token
    sees."""
    tok = reasoning_tokenizer
    rows = thinking_rows(2)
    module = GKDModule(
        tiny_causal_lm(TINY_STUDENT, tok, seed=0),
        tiny_causal_lm(TINY_TEACHER, tok, seed=1),
        tok,
        lmbda=1.0,
        divergence={"beta": beta},
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"]},
    )
    out, stats = roll(tok, rows, module.rollout)
    assert stats.segments == [3, 3]
    together = module.distillation_loss(out)
    alone_sum, alone_count = torch.zeros(()), 0
    for r in range(out["input_ids"].shape[0]):
        ids, labels = row_ids(out, r), row_ids(out, r, "labels")
        starts = [i for i, t in enumerate(labels) if t != IGNORE_INDEX and (i == 0 or labels[i - 1] == IGNORE_INDEX)]
        for start in starts:  # each turn of the row alone: its context, then the turn, nothing after
            end = next((i for i in range(start, len(labels)) if labels[i] == IGNORE_INDEX), len(labels))
            single = {
                "input_ids": torch.tensor([ids[:end]]),
                "attention_mask": torch.ones(1, end, dtype=torch.long),
                "labels": torch.tensor([[IGNORE_INDEX] * start + labels[start:end]]),
            }
            part = module.distillation_loss(single)
            alone_sum, alone_count = alone_sum + part.loss * part.count, alone_count + int(part.count)
    assert int(together.count) == alone_count
    assert torch.allclose(together.loss * together.count, alone_sum, atol=1e-4)


# -- reasoning -------------------------------------------------------------------------------------------------------
def test_dropped_reasoning_is_read_but_never_trained(reasoning_tokenizer):
    tok = reasoning_tokenizer
    row = thinking_rows(1)[0]
    out, _ = roll(tok, [row], rollout_for(tok, reasoning="drop"))
    kept, _ = roll(tok, [row])
    assert torch.equal(out["input_ids"], kept["input_ids"])  # the same transcript
    trained = tok.decode([t for t in out["labels"][out["labels"] != IGNORE_INDEX].tolist()])
    assert "<think>" not in trained and "step" not in trained and trained.count(tok.eos_token) == 4
    assert "<think>step 0</think>" in tok.decode([t for t in kept["labels"][kept["labels"] != IGNORE_INDEX].tolist()])


class _LongThinker(Sampler):
    """Writes ``<think>`` and 30 ``x`` then ``</think>ok`` and EOS after a generation prompt; after a closing
    marker (the cap's), writes ``done`` and EOS."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.contexts = tokenizer, []

    def sample(self, model, prompts, prompt_attention_mask, *, seed, vision=None):
        turns = []
        for row, mask in zip(prompts, prompt_attention_mask, strict=True):
            text = self.tokenizer.decode(row[mask.bool()].tolist())
            self.contexts.append(text)
            written = "done" if text.endswith("</think>") else "<think>" + "x" * 30 + "</think>ok"
            turns.append(self.tokenizer(written, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        width = max(len(t) for t in turns)
        completion = torch.tensor([t + [self.tokenizer.pad_token_id] * (width - len(t)) for t in turns])
        return completion_batch(
            prompts, prompt_attention_mask, completion, self.tokenizer.eos_token_id, torch.full(completion.shape, -0.5)
        )


def test_a_reasoning_budget_closes_the_reasoning_for_the_student_and_lets_it_write_on(reasoning_tokenizer):
    tok = reasoning_tokenizer
    rows = tool_rows("train", 2)
    sampler = _LongThinker(tok)
    out, stats = roll(tok, rows, rollout_for(tok, max_reasoning_tokens=5), sampler)
    assert stats.reasoning_capped == 2 and stats.turns == [1, 1]
    written = tok.decode(row_ids(out, 0)[-len(encode(tok, "<think>xxxxx</think>done")) - 1 :])
    assert written == "<think>xxxxx</think>done" + tok.eos_token
    labels = row_ids(out, 0, "labels")
    trained = tok.decode([t for t in labels if t != IGNORE_INDEX])
    assert trained == "<think>xxxxx" + "done" + tok.eos_token  # the closing marker was not the student's
    assert sampler.contexts[-1].endswith("<think>xxxxx</think>")  # the second call wrote on from the cut
    assert out["sampled_logprobs"][0][torch.tensor(labels) == IGNORE_INDEX].abs().sum() == 0
    assert rollout_transcripts(out)[0][-1]["content"] == "<think>xxxxx</think>done"


def test_reasoning_spans_are_found_from_the_markers_or_from_an_opened_context():
    open_ids, close_ids = [7, 8], [9]
    assert reasoning_span([1, 7, 8, 2, 3, 9, 4], open_ids, close_ids) is not None
    span = reasoning_span([1, 7, 8, 2, 3, 9, 4], open_ids, close_ids)
    assert (span.start, span.body, span.end, span.stop(1, 7)) == (1, 3, 5, 6)
    span = reasoning_span([2, 3, 9, 4], open_ids, close_ids, opened=True)
    assert (span.start, span.body, span.end) == (0, 0, 2)
    assert reasoning_span([1, 2], open_ids, close_ids) is None
    span = reasoning_span([7, 8, 2, 2], open_ids, close_ids)
    assert span.end is None and span.stop(1, 4) == 4


@pytest.mark.parametrize(
    "options, match",
    [
        ({"reasoning": "hide"}, r"rollout\.reasoning must be one of \('keep', 'drop'\).*got 'hide'"),
        ({"max_reasoning_tokens": 0}, r"rollout\.max_reasoning_tokens must be an integer >= 1 or null.*got 0"),
        ({"reasoning_markers": ["<think>"]}, r"rollout\.reasoning_markers must be two different non-empty texts"),
    ],
)
def test_the_reasoning_settings_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        RolloutSettings(**options)


# -- through a real Trainer ------------------------------------------------------------------------------------------
def fit(module, tokenizer, rows, tmp_path, steps=2, **data):
    # a template that rewrites earlier turns cannot label them in a dataset row: the dataset's last turn only
    datamodule = ChatDataModule(
        tokenizer, rows, rows[:2], batch_size=2, max_length=400, assistant_turns="last", length_check_rows=4, **data
    )
    trainer = small_trainer(tmp_path, max_steps=steps, limit_val_batches=1, val_check_interval=steps)
    trainer.fit(module, datamodule=datamodule)
    return trainer


@pytest.mark.parametrize("method", ["gkd", "opd"])
def test_gkd_and_opd_steps_train_on_every_segment_of_a_rewritten_transcript(reasoning_tokenizer, method, tmp_path):
    tok = reasoning_tokenizer
    rows = thinking_rows(4)
    common = dict(
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"]},
        sampling={"sampler": ScriptedSampler(tok, reference_script(rows)), "max_new_tokens": 64},
        validation={"metrics": {"success": lambda p, r: sum(a == b for a, b in zip(p, r, strict=True)) / len(p)}},
    )
    student, teacher = tiny_causal_lm(TINY_STUDENT, tok, seed=0), tiny_causal_lm(TINY_TEACHER, tok, seed=1)
    module = (
        OPDModule(student, teacher, tok, **common)
        if method == "opd"
        else GKDModule(student, teacher, tok, lmbda=1.0, **common)
    )
    seen = []
    loss = module.training_loss
    module.training_loss = lambda batch: seen.append(batch) or loss(batch)
    trainer = fit(module, tok, rows, tmp_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/tools/segments"] == 3.0 and metrics["train/tools/turns"] == 4.0
    assert metrics["val/success"] == 1.0  # validation reads each transcript's final answer once
    batch = seen[0]
    assert batch["input_ids"].shape[0] == 6  # 2 transcripts x 3 segments
    assert int((batch["labels"] == tok.eos_token_id).sum()) == 8  # 4 turns each, every one trained once
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_opd_refuses_returns_across_turns_on_transcripts_the_template_splits(reasoning_tokenizer, tmp_path):
    tok = reasoning_tokenizer
    rows = thinking_rows(4)
    student, teacher = tiny_causal_lm(TINY_STUDENT, tok, seed=0), tiny_causal_lm(TINY_TEACHER, tok, seed=1)
    rollout = {"tools": list(TOOLS), "tool_state_columns": ["facts"]}
    with pytest.raises(ValueError, match=r"policy_gradient\.gamma=0\.9.*every turn its own row"):
        OPDModule(student, teacher, tok, rollout={**rollout, "split_turns": True}, policy_gradient={"gamma": 0.9})
    module = OPDModule(
        student,
        teacher,
        tok,
        rollout=rollout,
        policy_gradient={"gamma": 0.9},
        sampling={"sampler": ScriptedSampler(tok, reference_script(rows)), "max_new_tokens": 64},
    )
    with pytest.raises(ValueError, match=r"split 2 transcripts into several rows"):
        fit(module, tok, rows, tmp_path, steps=1)


def test_a_resume_in_the_middle_of_a_group_of_split_transcripts_repeats_the_uninterrupted_run(
    rewriting_tokenizer, tmp_path
):
    """A group of 6 transcripts split into 24 rows is cut into its 3 steps (8 rows each); a resume after step 4
    (inside the second group) trains on the same rows."""
    tok = rewriting_tokenizer
    rows = tool_rows("train", 12)
    full_losses, full_flips = grouped_tool_run(tok, rows, tmp_path / "full", assistant_turns="last", max_steps=8)
    grouped_tool_run(tok, rows, tmp_path / "first", assistant_turns="last", max_steps=8, every=4)
    ckpt = tmp_path / "first" / "ckpt" / "epoch=0-step=4.ckpt"
    resumed_losses, resumed_flips = grouped_tool_run(
        tok, rows, tmp_path / "resumed", assistant_turns="last", max_steps=8, ckpt_path=str(ckpt)
    )
    assert 0 < sum(full_flips) < 8
    assert resumed_flips == full_flips[4:]
    assert resumed_losses == full_losses[4:]


# -- a teacher of another tokenizer ----------------------------------------------------------------------------------
def test_a_teacher_of_another_tokenizer_scores_each_turn_in_its_own_rendering(tmp_path):
    """Tool rollouts with a BPE teacher: every turn its own row; the teacher's batch of each row is its own
    template's render of the turn's context (tools included) and the turn's text; a step through a real Trainer."""
    student_tok = tokenizer_with(TOOLS_CHATML_TEMPLATE)
    rows = tool_rows("train", 4)
    corpus = [json.dumps(row["messages"]) for row in tool_rows("train", 200)]
    teacher_tok = build_chatml_bpe_tokenizer(corpus, merges=80)
    teacher_tok.chat_template = TOOLS_CHATML_TEMPLATE
    module = GKDModule(
        tiny_causal_lm(TINY_STUDENT, student_tok, seed=0),
        tiny_causal_lm(TINY_TEACHER, teacher_tok, seed=1),
        student_tok,
        teacher_tokenizer=teacher_tok,
        lmbda=1.0,
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"]},
        sampling={"sampler": ScriptedSampler(student_tok, reference_script(rows)), "max_new_tokens": 64},
        validation={"metrics": {}},
    )
    assert module.rollout.split_turns and type(module.loss).__name__ == "CrossTokenizerDistillation"
    seen = []
    loss = module.training_loss
    module.training_loss = lambda batch: seen.append(batch) or loss(batch)
    trainer = fit(module, student_tok, rows, tmp_path, steps=1)
    assert float(trainer.callback_metrics["train/tools/segments"]) == 4.0
    batch = seen[0]
    assert batch["input_ids"].shape[0] == 8
    completions, teacher_rows = module.loss.teacher_inputs(batch)
    schemas = module.rollout.tools
    for r in range(8):
        context = batch["prompt_messages"][r]
        prompt = render_chat(teacher_tok, context, True, schemas)
        ids = teacher_rows["input_ids"][r][teacher_rows["attention_mask"][r].bool()].tolist()
        assert teacher_tok.decode(ids) == prompt + completions[r].text + teacher_tok.eos_token
        turn = len([m for m in context if m["role"] == "assistant"])
        assert completions[r].text == reference_script(rows)[context[0]["content"]][turn]
    assert torch.isfinite(torch.tensor(float(trainer.callback_metrics["train/loss"])))


def test_a_teacher_of_another_tokenizer_refuses_reasoning_it_could_not_score_as_one_text():
    capped = RolloutSettings(tools=list(TOOLS), max_reasoning_tokens=8)
    with pytest.raises(ValueError, match=r"rollout\.reasoning=keep and max_reasoning_tokens=null"):
        rollout_settings_for_teacher(capped, same_vocab=False)
    assert rollout_settings_for_teacher(capped, same_vocab=True) is capped
    assert rollout_settings_for_teacher(RolloutSettings(tools=list(TOOLS)), same_vocab=False).split_turns
