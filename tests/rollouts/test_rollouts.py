"""Multi-turn rollouts (lightning_gkd.rollouts): the tool mask on exact transcripts, every failure kind, the caps,
and GKD/OPD steps with tools through a real Lightning Trainer."""

from __future__ import annotations

import json
import time
from functools import partial

import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, GKDModule, OPDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.chat_tokens import tokenize_chat
from lightning_gkd.data.tokenizer import CHATML_TEMPLATE, TOOLS_CHATML_TEMPLATE, build_chatml_tokenizer
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.rollouts import (
    HermesToolCallParser,
    MultiTurnRollout,
    ResponseSchemaParser,
    build_environment,
    build_tools,
    row_state,
)
from lightning_gkd.rollouts.evaluate import final_answers, rollout_rows
from lightning_gkd.samplers import KVCacheSampler
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm
from lightning_gkd.toy.tools import TOOLS, tool_call, tool_rows
from tests.helpers.scripted_sampler import ScriptedSampler
from tests.helpers.tool_runs import grouped_tool_run, reference_script


@pytest.fixture(scope="module")
def tool_tokenizer():
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = TOOLS_CHATML_TEMPLATE
    return tokenizer


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: Any text.
    """
    return text


def fail(reason: str) -> str:
    """Raise an error.

    Args:
        reason: The error message.
    """
    raise RuntimeError(reason)


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "late"


def opaque(n: int) -> object:
    """Return something JSON cannot write.

    Args:
        n: Anything.
    """
    return object()


def rollout_for(tokenizer, tools=TOOLS, *, max_iterations=4, max_transcript_tokens=None, timeout=5.0):
    environment, schemas = build_environment(list(tools), None, tokenizer, timeout=timeout)
    return MultiTurnRollout(
        tokenizer,
        environment,
        eos_token_ids=[tokenizer.eos_token_id],
        max_iterations=max_iterations,
        max_transcript_tokens=max_transcript_tokens,
        tools=schemas,
        state_columns=["facts"],
    )


def run(tokenizer, rows, script, **kwargs):
    rollout = rollout_for(tokenizer, **kwargs)
    sampler = ScriptedSampler(tokenizer, script)
    model = torch.nn.Linear(1, 1)
    return rollout_rows(
        model, tokenizer, rows, rollout, max_new_tokens=64, sample=lambda i, m, s: sampler.sample(model, i, m, seed=s)
    )


# -- the tool mask ---------------------------------------------------------------------------------------------------
def test_a_three_call_transcript_labels_exactly_the_assistant_tokens(tool_tokenizer):
    row = tool_rows("test", 1)[0]
    rollout = rollout_for(tool_tokenizer)
    collator = ChatMLCollator(
        tool_tokenizer, columns=["facts"], carry_prompt_messages=True, tools=rollout.tools, first_turn_prompts=True
    )
    batch = collator([row])
    sampler = ScriptedSampler(tool_tokenizer, reference_script([row]))
    out, stats = rollout.run(lambda i, m, s: sampler.sample(None, i, m, seed=s), batch, seed=0)
    # the transcript is the reference conversation, token for token
    reference = tokenize_chat(tool_tokenizer, row["messages"], 10**6, assistant_turns="all", tools=rollout.tools)
    ids = out["input_ids"][0][out["attention_mask"][0].bool()].tolist()
    assert ids == reference.ids[: len(ids)] and len(ids) == len(reference.ids) - 1  # the template's last "\n"
    assert out["transcripts"][0] == row["messages"]
    # labels: exactly the tokens of the four assistant turns, each up to and including its EOS (hand-checked below)
    labels = out["labels"][0][out["attention_mask"][0].bool()].tolist()
    written = [t for t in labels if t != IGNORE_INDEX]
    expected = []
    for message in row["messages"]:
        if message["role"] == "assistant":
            expected += tool_tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            expected.append(tool_tokenizer.eos_token_id)
    assert written == expected
    # against the dataset path (assistant_turns="all"): the same labels, except the template's "\n" after each EOS,
    # which the dataset labels as part of the turn and the student never writes
    newline = tool_tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    dataset = reference.labels()[: len(labels)]
    eos = tool_tokenizer.eos_token_id
    after_eos = [i for i in range(1, len(dataset)) if dataset[i - 1] == eos and dataset[i] == newline]
    assert [IGNORE_INDEX if i in after_eos else t for i, t in enumerate(dataset)] == labels
    # sampler log-probs only on the student's tokens
    logprobs = out["sampled_logprobs"][0][out["attention_mask"][0].bool()]
    assert torch.equal(logprobs != 0, torch.tensor(labels) != IGNORE_INDEX)
    assert stats.turns == [4] and stats.calls == [3] and sum(stats.failures.values()) == 0
    assert stats.metrics()["turns"] == 4.0 and stats.metrics()["calls"] == 3.0


def test_rows_finish_at_different_turns_and_each_turn_samples_only_the_rows_still_going(tool_tokenizer):
    rows = tool_rows("test", 2)
    script = reference_script(rows)
    first = rows[0]["messages"][0]["content"]
    script[first] = [rows[0]["answer"]]  # answers at once, without tools
    rollout = rollout_for(tool_tokenizer)
    sampler = ScriptedSampler(tool_tokenizer, script)
    transcripts, stats = rollout_rows(
        torch.nn.Linear(1, 1),
        tool_tokenizer,
        rows,
        rollout,
        max_new_tokens=64,
        sample=lambda i, m, s: sampler.sample(None, i, m, seed=s),
    )
    assert sampler.calls == [2, 1, 1, 1]
    assert stats.turns == [1, 4] and stats.calls == [0, 3]
    assert final_answers(transcripts) == [rows[0]["answer"], rows[1]["answer"]]


# -- failures: each kind gives its error message and its counter -------------------------------------------------
@pytest.mark.parametrize(
    ("turn", "kind", "message"),
    [
        ('<tool_call>{"name": "echo", "arguments": </tool_call>', "malformed", "is not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "malformed", "needs a 'name'"),
        ('<tool_call>{"name": "echo"', "malformed", "without </tool_call>"),
        (tool_call("search", query="x"), "unknown_tool", "unknown tool 'search'"),
        (tool_call("echo", words="x"), "bad_arguments", "bad arguments for echo"),
        (tool_call("fail", reason="boom"), "exception", "fail raised RuntimeError: boom"),
        (tool_call("slow", seconds=2), "timeout", "slow timed out after 0.2 s"),
        (tool_call("opaque", n=1), "unserialisable", "unserialisable result"),
    ],
)
def test_each_failure_becomes_an_error_message_and_is_counted(tool_tokenizer, turn, kind, message):
    row = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "done"}], "facts": "{}"}
    transcripts, stats = run(
        tool_tokenizer, [row], {"go": [turn, "done"]}, tools=[echo, fail, slow, opaque], timeout=0.2
    )
    tool_message = transcripts[0][2]
    assert tool_message["role"] == "tool"
    assert message in json.loads(tool_message["content"])["error"]
    assert stats.failures == {kind: 1}
    assert stats.metrics()["failure_rate"] == 1.0 and stats.metrics()[f"failures_{kind}"] == 1.0
    assert transcripts[0][-1] == {"role": "assistant", "content": "done"}  # the student goes on after the error


def test_the_iteration_cap_ends_a_transcript_after_its_last_allowed_turn_and_counts_a_pending_call(tool_tokenizer):
    row = {"messages": [{"role": "user", "content": "go"}], "facts": "{}"}
    transcripts, stats = run(
        tool_tokenizer, [row], {"go": [tool_call("echo", text="again")]}, tools=[echo], max_iterations=2
    )
    assert [m["role"] for m in transcripts[0]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert stats.capped == 1 and stats.calls == [2]


def test_the_token_cap_truncates_at_a_turn_boundary_and_is_counted(tool_tokenizer):
    row = {"messages": [{"role": "user", "content": "go"}], "facts": "{}"}
    rollout = rollout_for(tool_tokenizer, tools=[echo], max_transcript_tokens=150)
    sampler = ScriptedSampler(tool_tokenizer, {"go": [tool_call("echo", text="again")]})
    collator = ChatMLCollator(
        tool_tokenizer, columns=["facts"], carry_prompt_messages=True, tools=rollout.tools, first_turn_prompts=True
    )
    out, stats = rollout.run(lambda i, m, s: sampler.sample(None, i, m, seed=s), collator([row]), seed=0)
    assert stats.truncated == 1
    length = int(out["attention_mask"][0].sum())
    assert length <= 150
    # it ends right after a tool reply's generation prompt: the last tokens are "<|im_start|>assistant\n"
    assert tool_tokenizer.decode(out["input_ids"][0, :length].tolist()).endswith("<|im_start|>assistant\n")


def test_tools_read_their_rows_state(tool_tokenizer):
    rows = tool_rows("test", 3)
    transcripts, stats = run(tool_tokenizer, rows, reference_script(rows))
    for row, transcript in zip(rows, transcripts, strict=True):
        assert transcript == row["messages"]
    with pytest.raises(RuntimeError, match="only available inside a tool"):
        row_state()


# -- bad input --------------------------------------------------------------------------------------------------------
def untyped(x):
    """No type hints.

    Args:
        x: Anything.
    """
    return x


def test_tool_lists_that_cannot_be_described_are_refused_naming_the_tool():
    with pytest.raises(ValueError, match=r"tools\[1\] .* is not callable"):
        build_tools([echo, 3])
    with pytest.raises(ValueError, match=r"tools\[0\] 'untyped': its JSON schema cannot be built"):
        build_tools([untyped])
    with pytest.raises(ValueError, match=r"several tools named \['echo'\]"):
        build_tools([echo, echo])
    with pytest.raises(ValueError, match="cannot be imported"):
        build_tools(["lightning_gkd.nowhere.lookup"])
    assert [t.name for t in build_tools(list(TOOLS))] == ["lookup", "add"]


def test_a_template_without_tools_is_refused_before_any_model_loads(tmp_path):
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE  # renders tool messages, but never the tools
    with pytest.raises(ValueError, match=r"does not render tools: a prompt rendered with tools=\['lookup', 'add'\]"):
        GKDModule(
            str(tmp_path / "no-model-here"), str(tmp_path / "no-teacher"), tokenizer, rollout={"tools": list(TOOLS)}
        )
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="does not render tool messages"):
        GKDModule(
            str(tmp_path / "no-model-here"),
            str(tmp_path / "no-teacher"),
            tokenizer,
            rollout={"environment": lambda m, r: None},
        )


def test_tools_and_an_environment_together_are_refused(tool_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="not both"):
        GKDModule(
            str(tmp_path / "x"),
            str(tmp_path / "y"),
            tool_tokenizer,
            rollout={"tools": [echo], "environment": lambda m, r: None},
        )


def test_parsers_read_hermes_calls_and_a_response_schema():
    calls = HermesToolCallParser().parse('a <tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call> b')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1}, None)]

    class SchemaTokenizer:
        def parse_response(self, text):
            return {
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}],
            }

    assert [(c.name, c.arguments) for c in ResponseSchemaParser(SchemaTokenizer()).parse("x")] == [("add", {"a": 2})]


def test_an_environment_without_tools_plays_a_simulated_user(tool_tokenizer):
    def user(messages, row):
        turns = sum(m["role"] == "assistant" for m in messages)
        return None if turns == 2 else [{"role": "user", "content": "more"}]

    rollout = MultiTurnRollout(tool_tokenizer, user, eos_token_ids=[tool_tokenizer.eos_token_id], max_iterations=5)
    sampler = ScriptedSampler(tool_tokenizer, {"hi": ["one", "two", "three"]})
    row = {"messages": [{"role": "user", "content": "hi"}]}
    transcripts, stats = rollout_rows(
        torch.nn.Linear(1, 1),
        tool_tokenizer,
        [row],
        rollout,
        max_new_tokens=8,
        sample=lambda i, m, s: sampler.sample(None, i, m, seed=s),
    )
    assert [(m["role"], m["content"]) for m in transcripts[0]] == [
        ("user", "hi"),
        ("assistant", "one"),
        ("user", "more"),
        ("assistant", "two"),
    ]
    assert stats.turns == [2] and stats.calls == [0]


# -- methods with tools, through a real Trainer -----------------------------------------------------------------------
def fit_with_tools(module, tokenizer, rows, tmp_path, steps=2, batch_size=2, **data):
    datamodule = ChatDataModule(
        tokenizer,
        rows,
        rows[:2],
        batch_size=batch_size,
        max_length=400,
        assistant_turns="all",
        length_check_rows=4,
        **data,
    )
    trainer = small_trainer(
        tmp_path, max_steps=steps, limit_val_batches=1, val_check_interval=steps, num_sanity_val_steps=0
    )
    trainer.fit(module, datamodule=datamodule)
    return trainer


@pytest.mark.parametrize("method", ["gkd", "seq_kd", "opd"])
def test_an_on_policy_step_trains_on_the_whole_transcript_and_logs_tool_metrics(tool_tokenizer, method, tmp_path):
    rows = tool_rows("train", 4)
    sampler = ScriptedSampler(tool_tokenizer, reference_script(rows))
    student = tiny_causal_lm({**TINY_STUDENT}, tool_tokenizer, seed=0)
    teacher = tiny_causal_lm({**TINY_TEACHER}, tool_tokenizer, seed=1)
    common = dict(
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"]},
        sampling={"sampler": sampler, "max_new_tokens": 64},
        validation={"metrics": {"success": lambda p, r: sum(a == b for a, b in zip(p, r, strict=True)) / len(p)}},
    )
    if method == "opd":
        module = OPDModule(student, teacher, tool_tokenizer, **common)
    else:  # seq_kd: the teacher acts, with the same tools
        module = GKDModule(
            student, teacher, tool_tokenizer, lmbda=float(method == "gkd"), seq_kd=method == "seq_kd", **common
        )
    seen = []
    loss = module.training_loss

    def record(batch):
        seen.append(batch)
        return loss(batch)

    module.training_loss = record
    trainer = fit_with_tools(module, tool_tokenizer, rows, tmp_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/tools/calls"] == 3.0 and metrics["train/tools/turns"] == 4.0
    assert metrics["train/tools/failures"] == 0.0 and metrics["train/tools/failure_rate"] == 0.0
    assert metrics["train/tools/transcript_length"] > 100
    assert metrics["val/success"] == 1.0  # validation scores greedy rollouts' final answers (the script is right)
    batch = seen[0]
    # the step trained on four assistant turns per row: 4 EOS among the labels
    assert ((batch["labels"] == tool_tokenizer.eos_token_id).sum(dim=1) == 4).all()
    assert (batch["labels"] != IGNORE_INDEX).sum() < batch["attention_mask"][:, batch["prompts"].shape[1] :].sum()


def test_a_real_sampler_rolls_out_with_tools_and_counts_what_a_random_student_gets_wrong(tool_tokenizer, tmp_path):
    rows = tool_rows("train", 4)
    student = tiny_causal_lm({**TINY_STUDENT}, tool_tokenizer, seed=0)
    teacher = tiny_causal_lm({**TINY_TEACHER}, tool_tokenizer, seed=1)
    module = GKDModule(
        student,
        teacher,
        tool_tokenizer,
        lmbda=1.0,
        sampling={"max_new_tokens": 8, "sampler": KVCacheSampler},
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"], "max_tool_calling_iterations": 2},
    )
    trainer = fit_with_tools(module, tool_tokenizer, rows, tmp_path, steps=1)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/tools/turns"] >= 1.0 and "train/tools/calls" in metrics


def test_a_cache_teacher_is_refused_with_tools(tool_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="cache holds the teacher's signal for the dataset completions only"):
        GKDModule(
            str(tmp_path / "s"),
            {"kind": "cache", "path": str(tmp_path / "cache")},
            tool_tokenizer,
            lmbda=1.0,
            rollout={"tools": list(TOOLS)},
        )


def test_a_resume_in_the_middle_of_a_group_of_transcripts_repeats_the_uninterrupted_run(tool_tokenizer, tmp_path):
    rows = tool_rows("train", 12)  # batch 2, k=3: two groups of 6 transcripts per epoch
    full_losses, full_flips = grouped_tool_run(tool_tokenizer, rows, tmp_path / "full", max_steps=8)
    grouped_tool_run(tool_tokenizer, rows, tmp_path / "first", max_steps=8, every=4)
    ckpt = tmp_path / "first" / "ckpt" / "epoch=0-step=4.ckpt"
    resumed_losses, resumed_flips = grouped_tool_run(
        tool_tokenizer, rows, tmp_path / "resumed", max_steps=8, ckpt_path=str(ckpt)
    )
    assert 0 < sum(full_flips) < 8  # sampled (transcript) groups and dataset groups both happened
    assert resumed_flips == full_flips[4:]
    assert resumed_losses == full_losses[4:]


def test_the_toy_task_names_where_a_transcript_went_wrong():
    from lightning_gkd.toy.tools import failure_kind

    row = tool_rows("test", 1)[0]
    reference = row["messages"]
    first, second = reference[0]["content"].split("+")
    facts = json.loads(row["facts"])

    def with_turns(*turns):  # the reference transcript with its assistant turns from index 1 replaced
        return [reference[0], *({"role": "assistant", "content": t} for t in turns)]

    assert failure_kind(reference, row) == "correct"
    assert failure_kind(with_turns('<tool_call>{"name": "lookup"'), row) == "malformed call"
    assert failure_kind(with_turns(tool_call("search", key=first)), row) == "wrong tool or arguments"
    assert failure_kind(with_turns(str(int(row["answer"]) + 1)), row) == "invented a tool result"
    wrong_add = [*reference[:5], {"role": "assistant", "content": tool_call("add", a=facts[first], b=1)}]
    assert failure_kind(wrong_add, row) == "ignored a lookup result"
    assert failure_kind([*reference[:-1], {"role": "assistant", "content": "7"}], row) == "ignored the sum"
    assert failure_kind(reference[:-2], row) == "not stopping"


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_teachers_score_of_a_transcript_equals_scoring_it_as_a_dataset_row(tool_tokenizer, beta):
    """GKD's loss on a rolled-out transcript equals its loss on the same conversation collated as a dataset row
    (assistant_turns="all") with the same positions supervised: one forward over the whole transcript, the tool
    tokens unscored."""
    rows = tool_rows("test", 2)
    student = tiny_causal_lm(TINY_STUDENT, tool_tokenizer, seed=0)
    teacher = tiny_causal_lm(TINY_TEACHER, tool_tokenizer, seed=1)
    module = GKDModule(
        student,
        teacher,
        tool_tokenizer,
        lmbda=1.0,
        divergence={"beta": beta},
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"]},
    )
    rollout = module.rollout
    collator = ChatMLCollator(
        tool_tokenizer, columns=["facts"], carry_prompt_messages=True, tools=rollout.tools, first_turn_prompts=True
    )
    sampler = ScriptedSampler(tool_tokenizer, reference_script(rows))
    sampled, _ = rollout.run(lambda i, m, s: sampler.sample(None, i, m, seed=s), collator(rows), seed=0)
    dataset = ChatMLCollator(tool_tokenizer, assistant_turns="all", tools=rollout.tools)(rows)
    # the dataset row labels the template's newline after each end-of-turn token; the student never wrote it
    labels = dataset["labels"].clone()
    eos = tool_tokenizer.eos_token_id
    labels[:, 1:][labels[:, :-1] == eos] = IGNORE_INDEX
    # both batches are left-padded the same way (the prompts here have equal lengths): compare on the shared width
    width = sampled["input_ids"].shape[1]
    assert torch.equal(sampled["input_ids"], dataset["input_ids"][:, :width])
    assert torch.equal(sampled["labels"], labels[:, :width])
    as_rollout = module.distillation_loss(sampled)
    as_dataset = module.distillation_loss({**dataset, "labels": labels})
    assert as_rollout.count == as_dataset.count
    assert torch.allclose(as_rollout.loss, as_dataset.loss, atol=1e-6)


def test_the_asynchronous_producer_runs_whole_rollouts_with_tools_one_step_ahead(tool_tokenizer, tmp_path):
    """Multi-turn rollouts through the producer (max_staleness 1): every turn of a batch's transcripts is sampled by
    the producer's engine, the tools run from its thread, and the step logs the rollout's figures with the batch's
    staleness."""
    from lightning_gkd.asynchronous import InProcessEngine

    rows = tool_rows("train", 6)
    scripted = ScriptedSampler(tool_tokenizer, reference_script(rows))
    module = GKDModule(
        tiny_causal_lm({**TINY_STUDENT}, tool_tokenizer, seed=0),
        tiny_causal_lm({**TINY_TEACHER}, tool_tokenizer, seed=1),
        tool_tokenizer,
        lmbda=1.0,
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"]},
        sampling={"sampler": scripted, "max_new_tokens": 64},
        asynchronous={"max_staleness": 1, "engine": partial(InProcessEngine, sampler=scripted)},
        validation={"metrics": {}},
    )
    seen = []
    loss = module.training_loss

    def record(batch):
        seen.append(batch)
        return loss(batch)

    module.training_loss = record
    trainer = fit_with_tools(module, tool_tokenizer, rows, tmp_path, steps=3)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/tools/calls"] == 3.0 and metrics["train/tools/turns"] == 4.0
    assert metrics["train/async/staleness"] == 1.0 and metrics["train/async/staleness/1"] == 2.0
    assert all(((batch["labels"] == tool_tokenizer.eos_token_id).sum(dim=1) == 4).all() for batch in seen)
