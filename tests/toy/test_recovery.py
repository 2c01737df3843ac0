"""lightning_gkd.toy.recovery: its rows, its tool (errors on wrong codes, through the rollout's tool runner), the
teacher's error->retry rows, and the failure classifier on hand-built transcripts."""

import json
import random

import pytest

from lightning_gkd.rollouts.parsers import HermesToolCallParser
from lightning_gkd.rollouts.tools import ToolCall, build_tools, run_tool_call, using_row_state
from lightning_gkd.toy.recovery import (
    OUTCOMES,
    SUCCESSES,
    failure_kind,
    lookup,
    miscopy,
    recovery_rows,
    teacher_rows,
    transcript,
)
from lightning_gkd.toy.tools import tool_call


def test_rows_are_clean_two_read_transcripts_with_disjoint_splits():
    rows = {split: recovery_rows(split, 50) for split in ("train", "val", "test")}
    for row in rows["train"]:
        records = json.loads(row["records"])
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        start = row["messages"][0]["content"]
        assert row["messages"][2]["content"] == records[start]
        assert row["messages"][4]["content"] == records[records[start]] == row["answer"]
        assert row["messages"][-1]["content"] == row["answer"] and "error" not in json.dumps(row["messages"])
    prompts = {split: {row["records"] for row in r} for split, r in rows.items()}
    assert not prompts["train"] & prompts["test"] and not prompts["val"] & prompts["test"]
    assert recovery_rows("test", 5) == rows["test"][:5]
    with pytest.raises(ValueError, match="split must be one of"):
        recovery_rows("dev")


def test_read_answers_wrong_codes_with_an_error():
    row = recovery_rows("test", 1)[0]
    start = row["messages"][0]["content"]
    with using_row_state({"records": row["records"]}):
        assert lookup(start) == row["messages"][2]["content"]
        with pytest.raises(KeyError):
            lookup(next(c for c in ("zzzz", "yyyy") if c not in json.loads(row["records"])))
        with pytest.raises(ValueError, match="bad key"):
            lookup(start[:3])
    tools = {tool.name: tool for tool in build_tools([lookup])}
    result = run_tool_call(tools, ToolCall("lookup", {"key": "QQQQ"}), timeout=5, state={"records": row["records"]})
    assert result.failure == "exception" and json.loads(result.content)["error"] == "lookup raised ValueError: bad key"
    result = run_tool_call(tools, ToolCall("lookup", {"key": "zzzz"}), timeout=5, state={"records": "{}"})
    assert json.loads(result.content)["error"] == "lookup raised KeyError: "  # names no key to copy


def test_miscopy_is_never_the_code():
    rng = random.Random(0)
    assert all(miscopy("abcd", rng) != "abcd" for _ in range(200))
    assert any(len(miscopy("abcd", rng)) != 4 for _ in range(200))  # dropped or doubled letters too


def test_teacher_rows_mark_each_injected_miscopy_followed_by_its_error_and_the_retry():
    rows = teacher_rows(200, error_share=0.5, seed=1)
    parser = HermesToolCallParser()
    for row in rows:
        records = json.loads(row["records"])
        turns = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        for index, position in enumerate(turns[:-1]):
            key = parser.parse(row["messages"][position]["content"])[0].arguments["key"]
            assert (key not in records) == (index in row["mistake_turns"])
            if index in row["mistake_turns"]:
                assert "error" in json.loads(row["messages"][position + 1]["content"])
        assert row["messages"][-1]["content"] == row["answer"]
        assert failure_kind(row["messages"], row) == ("correct after an error" if row["mistake_turns"] else "correct")
    assert 0.3 < sum(bool(row["mistake_turns"]) for row in rows) / len(rows) < 0.7
    assert any(len(row["mistake_turns"]) == 2 for row in rows)
    with pytest.raises(ValueError, match="error_share"):
        teacher_rows(1, error_share=2)


def _row() -> dict:
    return recovery_rows("val", 1)[0]


def test_failure_kind_counts_a_recovery_and_its_failures():
    row = _row()
    records, start = json.loads(row["records"]), row["messages"][0]["content"]
    wrong = "zzzz" if "zzzz" not in records else "yyyy"
    assert failure_kind(row["messages"], row) == "correct"
    recovered = transcript(records, start, [(1, wrong)])
    assert failure_kind(recovered, row) == "correct after an error"
    gave_up = [*recovered[:5], {"role": "assistant", "content": "12" if row["answer"] != "12" else "13"}]
    assert failure_kind(gave_up, row) == "error not recovered"
    malformed = [row["messages"][0], {"role": "assistant", "content": '<tool_call>{"name":"read"</tool_call>'}]
    assert failure_kind([*malformed, {"role": "assistant", "content": "10"}], row) == "malformed call"
    other_tool = [row["messages"][0], {"role": "assistant", "content": tool_call("open", key=start)}]
    assert failure_kind(other_tool, row) == "malformed call"
    misread = [*row["messages"][:-1], {"role": "assistant", "content": "100"}]
    assert failure_kind(misread, row) == "wrong answer"
    assert failure_kind(row["messages"][:4], row) == "not stopping"
    assert set(SUCCESSES) < set(OUTCOMES)


def test_mistake_masking_leaves_the_miscopies_unlabelled():
    from lightning_gkd import ChatDataModule
    from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_bpe_tokenizer
    from lightning_gkd.rollouts import build_environment
    from lightning_gkd.toy.recovery import TOOLS, MistakeMasking

    tokenizer = build_chatml_bpe_tokenizer([], merges=0)
    tokenizer.chat_template = TOOLS_CHATML_TEMPLATE
    rows = [row for row in teacher_rows(100, error_share=0.5) if row["mistake_turns"]][:2] + teacher_rows(1)
    data = ChatDataModule(tokenizer, rows, batch_size=4, max_length=512, assistant_turns="all")
    data.use_rollouts(build_environment(list(TOOLS), None, tokenizer, timeout=5)[1])
    batch = MistakeMasking(data.collator)(rows)
    for row, labels in zip(rows, batch["labels"], strict=True):
        text = tokenizer.decode([token for token in labels.tolist() if token >= 0])
        correct = [m["content"] for i, m in enumerate(m for m in row["messages"] if m["role"] == "assistant")]
        wrong = [correct[i] for i in row["mistake_turns"]]
        kept = [c for i, c in enumerate(correct) if i not in row["mistake_turns"]]
        assert all(c in text for c in kept) and not any(w in text for w in wrong)
    with pytest.raises(ValueError, match="assistant_turns='all'"):
        MistakeMasking(ChatDataModule(tokenizer, rows, batch_size=4, max_length=512).collator)


def test_the_recovery_assets_act_with_their_tool():
    """assets/toy_recovery: the manifest's figures (a teacher far above the student's start), the size, the tools
    task's tokenizer, and on held-out rows the teacher succeeds where the start mostly does not."""
    from helpers.paths import ROOT

    from lightning_gkd.data.tokenizer import load_tokenizer
    from lightning_gkd.models.loading import load_causal_lm
    from lightning_gkd.rollouts.evaluate import rollout_rows
    from lightning_gkd.toy.recovery import MAX_NEW_TOKENS, task_rollout
    from lightning_gkd.toy.tiny import asset_path

    folder = ROOT / "lightning_gkd" / "assets" / "toy_recovery"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["teacher"]["test_success"] >= 0.9 and 0.2 <= manifest["student_init"]["test_success"] <= 0.5
    assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < 10 * 2**20
    tokenizer = load_tokenizer(asset_path("toy_recovery/teacher"))
    assert tokenizer.get_vocab() == load_tokenizer(asset_path("toy_tools/teacher")).get_vocab()
    rows = recovery_rows("test", 32)
    scores = {}
    for who in ("teacher", "student_init"):
        model = load_causal_lm(asset_path(f"toy_recovery/{who}"))
        transcripts, _ = rollout_rows(model, tokenizer, rows, task_rollout(tokenizer), max_new_tokens=MAX_NEW_TOKENS)
        kinds = [failure_kind(t, row) for t, row in zip(transcripts, rows, strict=True)]
        scores[who] = sum(kind in SUCCESSES for kind in kinds) / len(rows)
    assert scores["teacher"] >= 0.8 and scores["student_init"] <= 0.6
