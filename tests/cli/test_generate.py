"""lightning-gkd-generate: the shipped toy teacher completes addition prompts read from a jsonl file, a text file
and stdin with its known answers (greedy, deterministic); prompt formats; errors raised before the model loads."""

import io
import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from lightning_gkd.cli.generate import add_system_prompt, main, parse_prompts
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.metrics import evaluate_generations, exact_match
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

TEACHER = asset_path("toy/teacher")
ROWS = addition_rows("test", 8)
QUESTIONS = [row["messages"][0]["content"] for row in ROWS]
ANSWERS = [row["answer"] for row in ROWS]


@pytest.fixture(scope="module")
def greedy_answers():
    """What evaluate_generations (the held-out evaluation) decodes for these rows: the reference to match."""
    seen = {}

    def keep(predictions, references):
        seen["texts"] = list(predictions)
        return exact_match(predictions, references)

    model = load_causal_lm(TEACHER)
    scores = evaluate_generations(model, load_tokenizer(TEACHER), ROWS, metrics={"accuracy": keep}, max_new_tokens=8)
    return seen["texts"], scores["accuracy"]


def test_jsonl_rows_complete_with_the_teachers_answers(tmp_path, greedy_answers):
    texts, accuracy = greedy_answers
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in ROWS))
    out = tmp_path / "out.jsonl"
    main([TEACHER, "--prompts", str(prompts), "--output", str(out), "--batch-size", "3", "--max-new-tokens", "8"])
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["completion"] for w in written] == texts
    assert [w["reference"] for w in written] == ANSWERS  # the rows' assistant turns, not part of the prompts
    assert written[0]["prompt"] == [ROWS[0]["messages"][0]]
    assert accuracy >= 7 / 8 and exact_match([w["completion"] for w in written], ANSWERS) == accuracy


def test_a_text_file_and_stdin_give_the_same_greedy_completions(tmp_path, greedy_answers):
    texts, _ = greedy_answers
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(QUESTIONS[:4]) + "\n\n")  # a blank line is skipped
    from_file, from_stdin = io.StringIO(), io.StringIO()
    main([TEACHER, "--prompts", str(prompts), "--max-new-tokens", "8"], stdout=from_file)
    main([TEACHER, "--max-new-tokens", "8", "--output", "-"], stdin=io.StringIO(prompts.read_text()), stdout=from_stdin)
    assert from_file.getvalue().splitlines() == texts[:4]
    assert [json.loads(line) for line in from_stdin.getvalue().splitlines()] == [
        {"prompt": question, "completion": text} for question, text in zip(QUESTIONS[:4], texts[:4], strict=True)
    ]


def test_sampling_is_seeded(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(QUESTIONS[:4]) + "\n")

    def sample(seed):
        out = io.StringIO()
        main(
            [TEACHER, "--prompts", str(prompts), "--temperature", "3.0", "--seed", str(seed), "--max-new-tokens", "6"],
            stdout=out,
        )
        return out.getvalue()

    assert sample(0) == sample(0) and sample(0) != sample(1)


def test_prompt_rows_and_system_message():
    rows = parse_prompts(
        '{"prompt": "1+1="}\n'
        '{"prompt": [{"role": "user", "content": "2+2="}], "completion": "4"}\n'
        '{"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "3+3="}]}\n',
        "jsonl",
        "rows.jsonl",
    )
    add_system_prompt(rows, "Answer with digits.")
    assert [r.messages[0] for r in rows] == [{"role": "system", "content": "Answer with digits."}] * 2 + [
        {"role": "system", "content": "own"}
    ]
    assert rows[0].prompt == "1+1=" and rows[1].reference == "4" and rows[2].reference is None
    with pytest.raises(ValueError, match="rows.jsonl line 2: no 'messages' or 'prompt' key"):
        parse_prompts('{"prompt": "x"}\n{"text": "y"}\n', "jsonl", "rows.jsonl")
    with pytest.raises(ValueError, match="line 1 is not JSON .*use --format text"):
        parse_prompts("743+58=\n", "jsonl", "stdin")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([TEACHER, "--prompts", "missing.txt"], "--prompts 'missing.txt' does not exist"),
        ([TEACHER, "--prompts", "{empty}"], "holds no prompt (every line is blank)"),
        (
            ["outputs/no_such_run/student", "--prompts", "{prompts}"],
            "model: 'outputs/no_such_run/student' does not exist",
        ),
        (["{run}", "--prompts", "{prompts}"], "its exported model is {run}/student"),
        ([TEACHER, "--prompts", "{prompts}", "--temperature", "-1"], "--temperature must be >= 0"),
    ],
)
def test_errors_before_the_model_loads(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setattr("lightning_gkd.cli.generate.load", lambda args: pytest.fail("the model was loaded"))
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "prompts.txt").write_text("743+58=\n")
    (tmp_path / "run" / "student").mkdir(parents=True)
    (tmp_path / "run" / "student" / "config.json").write_text("{}")
    names = {"empty": tmp_path / "empty.txt", "prompts": tmp_path / "prompts.txt", "run": tmp_path / "run"}
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([arg.format(**names) for arg in args])
    assert exit_.value.code == 2
    assert message.format(**names) in capsys.readouterr().err


def test_a_tokenizer_without_chat_template_needs_one(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    shutil.copytree(TEACHER, folder)
    template = tmp_path / "template.jinja"
    (folder / "chat_template.jinja").rename(template)
    (tmp_path / "prompts.txt").write_text("743+58=\n")
    args = [str(folder), "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "8"]
    with monkeypatch.context() as patched:
        patched.setattr("lightning_gkd.cli.generate.load", lambda args: pytest.fail("the model was loaded"))
        with pytest.raises(SystemExit):
            main(args)
    assert "has no chat template; pass one with --chat-template <file.jinja>" in capsys.readouterr().err
    out = io.StringIO()
    main([*args, "--chat-template", str(template)], stdout=out)
    assert out.getvalue() == "234\n"


@pytest.mark.slow
def test_the_console_script_reads_stdin():
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "lightning-gkd-generate"]
    assert script.value == "lightning_gkd.cli.generate:main"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lightning-gkd-generate"), TEACHER, "--max-new-tokens", "8"],
        input="743+58=\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "234\n"  # 347 + 85 = 432, digits reversed


def test_with_tools_each_prompt_is_rolled_out_and_its_transcript_written(tmp_path):
    from lightning_gkd.toy import tool_rows
    from lightning_gkd.toy.tools import TOOLS

    rows = tool_rows("test", 8)
    prompts = tmp_path / "agent.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = io.StringIO()
    tools = ["--tools", *TOOLS, "--tool-state-columns", "facts", "--max-tool-calling-iterations", "4"]
    main(
        [asset_path("toy_tools/teacher"), "--prompts", str(prompts), "--output", "-", "--max-new-tokens", "24", *tools],
        stdout=out,
    )
    items = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [item["reference"] for item in items] == [row["answer"] for row in rows]
    assert sum(item["completion"] == item["reference"] for item in items) >= 7  # the shipped teacher, with its tools
    for item in items:
        assert item["transcript"][-1] == {"role": "assistant", "content": item["completion"]}
    assert [m["role"] for m in items[0]["transcript"]].count("tool") == 3  # lookup, lookup, add


def test_with_tools_a_state_column_as_a_json_object_works_and_failures_are_reported(tmp_path, capsys):
    """`"facts": {"b": 37, ...}` in agent.jsonl (natural JSON) reaches the toy lookup as an object and works; a tool
    that fails is reported on stderr with how many calls failed and the first error, not left in the transcripts."""
    from lightning_gkd.toy import tool_rows
    from lightning_gkd.toy.tools import TOOLS

    rows = [{**row, "facts": json.loads(row["facts"])} for row in tool_rows("test", 4)]
    prompts = tmp_path / "agent.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = [asset_path("toy_tools/teacher"), "--prompts", str(prompts), "--output", "-", "--max-new-tokens", "24"]
    out = io.StringIO()
    main([*common, "--tools", *TOOLS, "--tool-state-columns", "facts"], stdout=out)
    items = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sum(item["completion"] == item["reference"] for item in items) >= 3
    assert "tool calls: 12 in 4 transcripts, 0 failed" in capsys.readouterr().err
    # the state column left out: every lookup raises, and the run says so
    main([*common, "--tools", *TOOLS], stdout=io.StringIO())
    err = capsys.readouterr().err
    assert re.search(r"warning: \d+ of \d+ tool calls failed \(exception \d+\); the first: \{\"error\": ", err), err
