"""lightning-gkd-generate: complete prompts with a model folder (an exported student) or a hub id.

lightning-gkd-generate outputs/runs/<run>/student --prompts prompts.txt              # one prompt per line
lightning-gkd-generate outputs/runs/<run>/student --prompts rows.jsonl --output out.jsonl
echo "743+58=" | lightning-gkd-generate outputs/runs/<run>/student                  # stdin, one per line
python -m lightning_gkd.cli.generate ...                                             # the same

Prompts: a text file or stdin holds one prompt per line (blank lines skipped); a ``.jsonl`` file (or
``--format jsonl``) holds one JSON object per line with ``messages`` (a chat; a final assistant turn is the
reference, not part of the prompt) or ``prompt`` (a string, or a list of messages). Each prompt goes through the
model folder's chat template with the generation prompt. Decoding is our KV-cache decoder: greedy at
``--temperature 0`` (the default, deterministic), else sampling seeded by ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.cli.model_source import check_model_folder
from lightning_gkd.data.chat import ChatMLCollator, prepare_tokenizer
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.metrics import decode_until_eos
from lightning_gkd.models.loading import check_hub_id_reachable, load_causal_lm
from lightning_gkd.ops.decoding.sampling import complete_prompts, derive_seed, eos_ids
from lightning_gkd.ops.hf.forward import resolve_eos_token_id
from lightning_gkd.rollouts import MultiTurnRollout, RolloutSettings, RolloutStats, build_rollout
from lightning_gkd.rollouts.evaluate import final_answers, rollout_rows
from lightning_gkd.rollouts.rollout import SampleTurn

Messages = list[dict[str, str]]


@dataclass
class PromptRow:
    """One prompt: the messages to complete, what the user gave as the prompt, and a reference answer if any."""

    messages: Messages
    prompt: Any
    reference: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other keys (a tool's row_state())


# -- reading prompts ---------------------------------------------------------------------------------------------------
def _messages(value: Any, where: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of messages, got {value!r}.")
    messages = []
    for message in value:
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), str) or not message.get("role"):
            raise ValueError(f"{where}: each message needs a 'role' and a string 'content', got {message!r}.")
        messages.append({"role": str(message["role"]), "content": message["content"]})
    return messages


def prompt_row(row: Any, where: str) -> PromptRow:
    """A jsonl row (``messages``, or ``prompt`` as a string or messages, with an optional ``completion``) as a
    :class:`PromptRow`; ValueError naming ``where`` otherwise."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object with 'messages' or 'prompt', got {row!r}.")
    columns = {key: value for key, value in row.items() if key not in ("messages", "prompt", "completion")}
    if "messages" in row:
        messages = _messages(row["messages"], where)
        if messages[-1]["role"] == "assistant":
            if len(messages) == 1:
                raise ValueError(f"{where}: the only message is the assistant's; there is nothing to complete.")
            return PromptRow(messages[:-1], messages[:-1], messages[-1]["content"], columns)
        return PromptRow(messages, messages, columns=columns)
    if "prompt" in row:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, where)
        completion = row.get("completion")
        reference = completion if isinstance(completion, str) else None
        return PromptRow(messages, prompt, reference, columns)
    raise ValueError(f"{where}: no 'messages' or 'prompt' key (keys: {sorted(row)}).")


def parse_prompts(text: str, fmt: str, source: str) -> list[PromptRow]:
    """Prompts from ``text``: ``fmt`` "text" (one per line) or "jsonl" (one JSON object per line)."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if fmt == "text":
            rows.append(PromptRow([{"role": "user", "content": line}], line))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{source} line {number} is not JSON ({error.msg}); for one plain prompt per line use --format text."
            ) from None
        rows.append(prompt_row(row, f"{source} line {number}"))
    return rows


def read_prompts(path: str, fmt: str = "auto", stdin: TextIO | None = None) -> list[PromptRow]:
    """Prompts from a file, or from stdin for ``-``; ``fmt`` "auto": jsonl for ``.jsonl``/``.json`` files, else text.
    Raises before any model loads when the file does not exist or holds no prompt."""
    if path == "-":
        stream = stdin or sys.stdin
        if stream.isatty():
            print("reading prompts from stdin, one per line; end with Ctrl-D", file=sys.stderr, flush=True)
        text, source = stream.read(), "stdin"
        fmt = "text" if fmt == "auto" else fmt
    else:
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(
                f"--prompts {path!r} does not exist (relative to {Path.cwd()})"
                if not file.exists()
                else f"--prompts {path!r} is not a file"
            )
        text, source = file.read_text(), str(path)
        if fmt == "auto":
            fmt = "jsonl" if file.suffix in (".jsonl", ".json") else "text"
    rows = parse_prompts(text, fmt, source)
    if not rows:
        raise ValueError(f"{source} holds no prompt (every line is blank).")
    return rows


def add_system_prompt(rows: Sequence[PromptRow], system: str | None) -> None:
    """Start each conversation without a system message with ``system``."""
    if system is None:
        return
    for row in rows:
        if row.messages[0]["role"] != "system":
            row.messages.insert(0, {"role": "system", "content": system})


# -- completing them ---------------------------------------------------------------------------------------------------
def decoding_turn(model: nn.Module, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> SampleTurn:
    """The command's decoding of a batch of prompts (a rollout's turn, with tools): up to ``--max-new-tokens``
    tokens by our KV-cache decoder, greedy at ``--temperature 0``, else sampled (``--top-k``, ``--top-p``) with the
    seed it is given."""

    sampling: dict[str, Any] = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}

    def turn(ids: torch.Tensor, mask: torch.Tensor, seed: int) -> Mapping[str, torch.Tensor]:
        return complete_prompts(model, tokenizer, ids, mask, max_new_tokens=args.max_new_tokens, seed=seed, **sampling)

    return turn


def complete(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Messages],
    turn: SampleTurn,
    *,
    seed: int = 0,
    batch_size: int = 16,
    max_length: int = 1024,
) -> list[str]:
    """The model's completion of each conversation (through the tokenizer's chat template with the generation
    prompt) by ``turn`` (``decoding_turn``), decoded up to EOS; batch ``i`` seeded from ``seed`` and its first row,
    so a rerun gives the same texts."""
    collator = ChatMLCollator(tokenizer, max_length=max_length, name="prompts")
    eos = resolve_eos_token_id(model, tokenizer)
    device = next(model.parameters()).device
    texts: list[str] = []
    for start in range(0, len(conversations), batch_size):
        rows = [{"messages": messages} for messages in conversations[start : start + batch_size]]
        batch = {key: value.to(device) for key, value in collator(rows).items()}
        prompts = batch["prompts"]
        out = turn(prompts, batch["prompt_attention_mask"], derive_seed(seed, start))
        texts += decode_until_eos(tokenizer, out["input_ids"][:, prompts.shape[1] :].tolist(), eos)
    return texts


def act(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[PromptRow],
    rollout: MultiTurnRollout,
    turn: SampleTurn,
    *,
    max_new_tokens: int,
    batch_size: int = 16,
) -> tuple[list[list[dict[str, Any]]], RolloutStats]:
    """Each conversation rolled out with ``rollout``'s tools, each model turn by ``turn`` (seeded by the rollout):
    the transcripts, and what the tools did."""
    chats = [{"messages": row.messages, **row.columns} for row in rows]
    return rollout_rows(
        model, tokenizer, chats, rollout, max_new_tokens=max_new_tokens, batch_size=batch_size, sample=turn
    )


def tool_report(transcripts: Sequence[Sequence[Mapping[str, Any]]], stats: RolloutStats) -> list[str]:
    """What a user of ``--tools`` must hear on stderr: the calls made, and when any failed, how many of each kind
    and the first failure's message (a tool that raised on every row, e.g. given a state column of another type,
    would otherwise leave only garbage answers)."""
    calls, failures = sum(stats.calls), sum(stats.failures.values())
    lines = [f"tool calls: {calls} in {len(transcripts)} transcripts, {failures} failed"]
    if failures:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(stats.failures.items()) if count)
        first = next(
            (
                str(message["content"])
                for transcript in transcripts
                for message in transcript
                if message.get("role") == "tool" and str(message.get("content", "")).startswith('{"error"')
            ),
            None,
        )
        lines.append(f"warning: {failures} of {calls} tool calls failed ({kinds}); the first: {first}")
    return lines


def output_rows(
    rows: Sequence[PromptRow], completions: Sequence[str], transcripts: Sequence[Any] | None = None
) -> list[dict[str, Any]]:
    """``{"prompt", "completion"}`` per prompt (the prompt as given), with ``reference`` where the row had one and
    ``transcript`` (every message) for a rollout with tools."""
    out = []
    for index, (row, completion) in enumerate(zip(rows, completions, strict=True)):
        item: dict[str, Any] = {"prompt": row.prompt, "completion": completion}
        if row.reference is not None:
            item["reference"] = row.reference
        if transcripts is not None:
            item["transcript"] = transcripts[index]
        out.append(item)
    return out


# -- the command -------------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-gkd-generate",
        description="Complete prompts with a model folder (e.g. the student a lightning-gkd run exported) or hub id.",
    )
    p.add_argument("model", help="model folder written by save_pretrained (outputs/runs/<run>/student) or a hub id")
    p.add_argument(
        "--prompts",
        default="-",
        help="prompts file (.txt: one per line; .jsonl: rows with messages or prompt), or - for stdin (default)",
    )
    p.add_argument(
        "--format",
        choices=["auto", "text", "jsonl"],
        default="auto",
        help="how to read the prompts (auto: jsonl for .jsonl/.json files, else text)",
    )
    p.add_argument("--system", default=None, help="system message for prompts without one")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per forward")
    p.add_argument("--max-length", type=int, default=1024, help="longer prompts keep their last tokens")
    p.add_argument(
        "--output",
        default=None,
        help="write jsonl {prompt, completion} here (- for stdout); default: print each completion on its own line "
        "(use jsonl when completions span several lines)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", help="auto (as saved), float32, bfloat16, float16")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file, for a tokenizer without one")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own code to run")
    tools = p.add_argument_group("tools (multi-turn rollouts: docs/tools.md)")
    tools.add_argument(
        "--tools", nargs="+", default=None, help="import paths of the tools the model may call (package.module.fn)"
    )
    tools.add_argument("--max-tool-calling-iterations", type=int, default=5, help="tool replies per transcript")
    tools.add_argument("--tool-timeout", type=float, default=10.0, help="seconds a tool call may take")
    tools.add_argument("--max-transcript-tokens", type=int, default=None, help="cap on a transcript's tokens")
    tools.add_argument(
        "--tool-state-columns", nargs="+", default=[], help="jsonl row keys a tool reads through row_state()"
    )
    return p


def check_options(args: argparse.Namespace) -> None:
    """Option values, before anything loads (ValueError naming the option)."""
    for name in ("max_new_tokens", "batch_size", "max_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}.")
    if not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ValueError(f"--top-p must be in (0, 1] and --top-k >= 0, got {args.top_p} and {args.top_k}.")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise FileNotFoundError(f"--chat-template {args.chat_template!r} does not exist.")
    if args.output not in (None, "-") and not Path(args.output).expanduser().parent.is_dir():
        raise FileNotFoundError(f"--output {args.output!r}: its folder does not exist.")


def chat_tokenizer(args: argparse.Namespace) -> PreTrainedTokenizerBase:
    """The model's tokenizer with a chat template (``--chat-template`` or its own) and a pad token."""
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    if args.chat_template is not None:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer of {args.model!r} has no chat template; pass one with --chat-template <file.jinja>."
        )
    return prepare_tokenizer(tokenizer)


def load(args: argparse.Namespace) -> nn.Module:
    """The model, in eval mode, on ``--device``."""
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    spec = {"name_or_path": args.model, "init_kwargs": {"dtype": args.dtype}}
    model = load_causal_lm(spec, trust_remote_code=args.trust_remote_code, role="model")
    return model.to(device).eval()


def write(items: Sequence[Mapping[str, Any]], output: str | None, stdout: TextIO) -> None:
    if output is None:
        for item in items:
            stdout.write(item["completion"] + "\n")
    elif output == "-":
        for item in items:
            stdout.write(json.dumps(item) + "\n")
    else:
        with open(Path(output).expanduser(), "w") as handle:
            for item in items:
                handle.write(json.dumps(item) + "\n")
        print(f"wrote {len(items)} completions to {output}", file=sys.stderr, flush=True)
    stdout.flush()


def main(argv: Sequence[str] | None = None, *, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    try:  # what can be checked before the model loads
        check_options(args)
        folder = check_model_folder(args.model, "model")
        rows = read_prompts(args.prompts, args.format, stdin)
        if folder is None:  # a hub id: fail now when it can be neither downloaded nor found in the cache
            check_hub_id_reachable("model", args.model)
        tokenizer = chat_tokenizer(args)
        rollout_settings = RolloutSettings(
            tools=args.tools or (),
            max_tool_calling_iterations=args.max_tool_calling_iterations,
            tool_timeout=args.tool_timeout,
            max_transcript_tokens=args.max_transcript_tokens,
            tool_state_columns=args.tool_state_columns or (),
        )
        if args.tools:  # the tools and the template, before the model loads
            build_rollout(tokenizer, rollout_settings, eos_token_ids=[])
    except (FileNotFoundError, ValueError) as error:
        p.error(str(error))
    add_system_prompt(rows, args.system)
    model = load(args)
    turn = decoding_turn(model, tokenizer, args)
    if args.tools:
        rollout = build_rollout(
            tokenizer, rollout_settings, eos_token_ids=eos_ids(resolve_eos_token_id(model, tokenizer))
        )
        transcripts, stats = act(
            model,
            tokenizer,
            rows,
            cast(MultiTurnRollout, rollout),
            turn,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
        )
        items = output_rows(rows, final_answers(transcripts), transcripts)
        write(items, args.output, stdout or sys.stdout)
        for line in tool_report(transcripts, stats):
            print(line, file=sys.stderr, flush=True)
        return
    conversations = [row.messages for row in rows]
    completions = complete(
        model, tokenizer, conversations, turn, seed=args.seed, batch_size=args.batch_size, max_length=args.max_length
    )
    write(output_rows(rows, completions), args.output, stdout or sys.stdout)


if __name__ == "__main__":
    main()
