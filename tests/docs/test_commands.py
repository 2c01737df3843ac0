"""Every command the docs show is either run by a test or marked as needing what a CPU-only machine lacks.

Scanned: the fenced ``bash``/``sh``/``shell``/``console`` blocks of README.md and of every page under docs/, for the
entry points ``lightning-gkd``, ``lightning-gkd-cache``, ``lightning-gkd-eval``, ``lightning-gkd-generate`` and
``lightning-gkd-sbatch`` (also behind ``&&``, ``|``, a path such as ``.venv/bin/``, or ``python -m
lightning_gkd.cli.<name>``).

The marker convention (docs/developing.md, "Commands in the docs"): a command that cannot run here carries
``needs: <what>[, <what>...]`` in a comment at the end of its last line, or in a comment line directly above it,
with each <what> one of ``NEEDS`` below, e.g. ``lightning-gkd trainer=gpu   # one GPU (needs: gpu)``.

- Fast: each ``lightning-gkd`` / ``-cache`` / ``-eval`` command, marked or not, composes with Hydra (every point of
  a ``-m`` sweep; ``<placeholders>`` and a bare ``...`` filled in), its config resolves, and every ``_target_`` in it
  imports, so a renamed option, key or class fails here. ``lightning-gkd-generate`` arguments parse with its parser;
  ``lightning-gkd-sbatch`` commands run (they only write a file).
- Slow: every unmarked command runs, in process, through its console script, in a fresh folder per block (a block's
  commands in order: a later one may read what an earlier one wrote), shortened to 2 optimizer steps on a few toy rows.
"""

from __future__ import annotations

import io
import itertools
import re
import shlex
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from helpers.hydra_compose import compose_train
from helpers.paths import ROOT
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf, open_dict

# docs/customization.md's commands name modules its own python blocks write (my_dpo.HingeDPO, ...):
# tests/docs/test_customization.py writes them, then composes those commands and imports their targets.
CHECKED_ELSEWHERE = {"docs/customization.md"}
PAGES = [
    path
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    if path.relative_to(ROOT).as_posix() not in CHECKED_ELSEWHERE
]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
EXECUTABLE_PAGES = {
    "docs/asynchronous.md",
    "docs/customization.md",
    "docs/python_api.md",
    "docs/vision.md",
}  # run by their own tests
NEEDS = {
    "gpu",
    "real model",
    "network",
    "vllm",
    "vllm server",
    "slurm",
    "several processes",
    "your data",
    "earlier run",
    "published release",
}
# entry point -> the config it composes (None: not a Hydra command)
ENTRY_POINTS = {
    "lightning-gkd": "train",
    "lightning-gkd-cache": "cache_teacher",
    "lightning-gkd-eval": "evaluate",
    "lightning-gkd-generate": None,
    "lightning-gkd-sbatch": None,
}
MODULES = {
    "lightning_gkd.cli.train": "lightning-gkd",
    "lightning_gkd.cli.cache_teacher": "lightning-gkd-cache",
    "lightning_gkd.cli.evaluate": "lightning-gkd-eval",
    "lightning_gkd.cli.generate": "lightning-gkd-generate",
    "lightning_gkd.cli.sbatch": "lightning-gkd-sbatch",
}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"\bneeds:\s*([^);]*)")
PLACEHOLDER = re.compile(r"<[^<>\n]+>")
SEPARATORS = {";", "&", "&&", "|", "||"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class DocCommand:
    page: str  # relative to the repository root
    line: int  # the command's first line in the page
    block: int  # the first line of its fenced block
    program: str  # the entry point's name
    args: tuple[str, ...]
    needs: tuple[str, ...]
    stdin: str | None  # what `echo ... |` feeds it
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def config(self) -> str | None:
        return ENTRY_POINTS[self.program]


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of one shell line: the comment starts at the first ``#`` outside quotes that begins a word."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index], line[index + 1 :]
    return line, ""


def markers(comment: str, where: str) -> list[str]:
    found = MARKER.findall(comment)
    if not found:
        assert not re.search(r"\bneeds?\b", comment), f"{where}: write the marker as 'needs: <what>': {comment!r}"
        return []
    needs = [item.strip() for group in found for item in group.split(",") if item.strip()]
    unknown = sorted(set(needs) - NEEDS)
    assert not unknown, f"{where}: unknown marker {unknown}; use some of {sorted(NEEDS)} (docs/developing.md)"
    return needs


def logical_lines(code: str, first_line: int):
    """(line number, the physical line before it, the joined command line) for each command of a shell block."""
    lines = code.splitlines()
    index = 0
    while index < len(lines):
        start = index
        parts = [lines[index]]
        while parts[-1].rstrip().endswith("\\") and index + 1 < len(lines):
            parts[-1] = parts[-1].rstrip()[:-1]
            index += 1
            parts.append(lines[index])
        previous = lines[start - 1] if start > 0 else ""
        yield first_line + start, previous, " ".join(part.strip() for part in parts)
        index += 1


def commands_of_line(page: str, line: int, block: int, previous: str, text: str) -> list[DocCommand]:
    where = f"{page}:{line}"
    text = text.removeprefix("$ ")
    code, comment = split_comment(text)
    if not code.strip():
        return []
    needs = markers(comment, where)
    if previous.strip().startswith("#"):
        needs += markers(previous.strip()[1:], f"{page}:{line - 1}")
    lexer = shlex.shlex(PLACEHOLDER.sub("PLACEHOLDER", code), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    tokens = list(lexer)
    segments: list[list[str]] = [[]]
    for token in tokens:
        if token in SEPARATORS:
            segments.append([token])
        else:
            segments[-1].append(token)
    found = []
    for position, segment in enumerate(segments):
        words = segment[1:] if segment and segment[0] in SEPARATORS else segment
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if not words:
            continue
        program, args = Path(words[0]).name, words[1:]
        if re.fullmatch(r"python3?", program) and args[:1] == ["-m"] and len(args) > 1 and args[1] in MODULES:
            program, args = MODULES[args[1]], args[2:]
        if program not in ENTRY_POINTS:
            continue
        stdin = None
        if segment[0] == "|" and position > 0:
            before = [word for word in segments[position - 1] if word not in SEPARATORS]
            if before[:1] == ["echo"]:
                stdin = " ".join(before[1:]) + "\n"
        args = [arg for arg in args if arg != "..."]
        found.append(DocCommand(page, line, block, program, tuple(args), tuple(sorted(set(needs))), stdin, text))
    return found


def doc_commands() -> list[DocCommand]:
    found = []
    for path in PAGES:
        page = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for match in FENCE.finditer(text):
            language, code = match.group(1), match.group(2)
            if language not in SHELL_LANGUAGES:
                continue
            block = text.count("\n", 0, match.start()) + 1
            for line, previous, command in logical_lines(code, block + 1):
                found.extend(commands_of_line(page, line, block, previous, command))
    return found


COMMANDS = doc_commands()
HYDRA_COMMANDS = [command for command in COMMANDS if command.config]


def hydra_overrides(command: DocCommand) -> tuple[list[str], bool]:
    """(the overrides, whether it is a multirun) of a Hydra command line."""
    overrides, multirun, args = [], False, list(command.args)
    while args:
        arg = args.pop(0)
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg == "--cfg":
            assert args and args.pop(0) in ("job", "hydra", "all"), command.where
        elif arg.startswith("-"):
            raise AssertionError(f"{command.where}: the test does not know the flag {arg!r}; teach it")
        else:
            overrides.append(arg)
    return overrides, multirun


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Each combination of a sweep's values, as plain overrides (Hydra's basic sweeper's expansion)."""
    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(point) for point in itertools.product(*choices)]


def targets(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        return found + [target for value in node.values() for target in targets(value)]
    if isinstance(node, list):
        return [target for value in node for target in targets(value)]
    return []


def compose_checked(tmp_path: Path, command: DocCommand, overrides: list[str]) -> DictConfig:
    """The command's config, composed as its entry point would, resolved, with every ``_target_`` imported."""
    cfg = compose_train(tmp_path, overrides, config=command.config)
    job = cfg.copy()
    with open_dict(job):
        del job["hydra"]
    resolved = OmegaConf.to_container(job, resolve=True, throw_on_missing=True)
    hydra_node = OmegaConf.to_container(cfg.hydra, resolve=False)
    for target in targets(resolved) + targets(hydra_node):
        assert get_object(target) is not None, (command.where, target)
    return cfg


def test_the_docs_show_commands_of_every_entry_point():
    programs = {command.program for command in COMMANDS}
    assert programs == set(ENTRY_POINTS), programs
    pages = {command.page for command in COMMANDS}
    assert "README.md" in pages and len(pages) >= 10, sorted(pages)
    assert any(not command.needs for command in COMMANDS if command.page == "README.md")
    quickstart = [c for c in COMMANDS if c.page == "README.md" and c.program == "lightning-gkd" and not c.args]
    assert quickstart, "README's quickstart command (`... && lightning-gkd`) is scanned"


def test_the_scanner_reads_markers_pipes_and_continuations():
    line = 'echo "1+2=" | A=1 .venv/bin/lightning-gkd-generate out/<run>/student ...   # completes (needs: earlier run)'
    (command,) = commands_of_line("x.md", 3, 1, "", line)
    assert command.program == "lightning-gkd-generate" and command.args == ("out/PLACEHOLDER/student",)
    assert command.needs == ("earlier run",) and command.stdin == "1+2=\n"
    (command,) = commands_of_line("x.md", 3, 1, "# needs: gpu", "pip install x && lightning-gkd trainer=gpu")
    assert command.args == ("trainer=gpu",) and command.needs == ("gpu",)
    lines = list(logical_lines("lightning-gkd a=1 \\\n    b=2   # two lines\nls", 10))
    assert lines[0] == (10, "", "lightning-gkd a=1 b=2   # two lines") and lines[1][0] == 12
    with pytest.raises(AssertionError, match="unknown marker"):
        commands_of_line("x.md", 1, 1, "", "lightning-gkd   # needs: a quantum computer")
    with pytest.raises(AssertionError, match="write the marker as"):
        commands_of_line("x.md", 1, 1, "", "lightning-gkd   # needs a GPU")


def test_python_blocks_only_on_executable_pages():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        page = path.relative_to(ROOT).as_posix()
        languages = {language for language, _ in FENCE.findall(path.read_text())}
        if page not in EXECUTABLE_PAGES:
            assert not languages & {"python", "py", "pycon"}, f"{page}: a python block no test runs"


@pytest.mark.parametrize("command", HYDRA_COMMANDS, ids=[command.where for command in HYDRA_COMMANDS])
def test_hydra_command_composes_and_its_targets_import(command, tmp_path):
    overrides, _ = hydra_overrides(command)
    for point in sweep_points(overrides):
        compose_checked(tmp_path, command, point)
    GlobalHydra.instance().clear()


def test_the_readme_links_resolve():
    """README.md is outside the docs site (its links are not checked by ``mkdocs build --strict``): each relative link
    names a file of the repository, and an anchor a heading of that file."""
    from markdown.extensions.toc import slugify

    for target in re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).is_file(), f"README.md links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.M)
            assert anchor in {slugify(heading, "-") for heading in headings}, f"README.md: no #{anchor} in {path}"


def test_generate_commands_parse():
    from lightning_gkd.cli.generate import parser

    generate = [command for command in COMMANDS if command.program == "lightning-gkd-generate"]
    assert generate
    for command in generate:
        try:
            parser().parse_args(list(command.args))
        except SystemExit as error:
            raise AssertionError(f"{command.where}: lightning-gkd-generate refuses {command.args}") from error


def test_sbatch_commands_run(tmp_path, monkeypatch, capsys):
    sbatch = [command for command in COMMANDS if command.program == "lightning-gkd-sbatch"]
    assert sbatch
    for index, command in enumerate(sbatch):
        folder = tmp_path / str(index)
        folder.mkdir()
        monkeypatch.chdir(folder)
        assert run_entry_point(command.program, list(command.args), None, monkeypatch) == 0, command.where


# ---- the slow tier: run the unmarked commands ---------------------------------------------------------------------

# Appended to every run (a command's own value of the same key is dropped): 2 optimizer steps, one validation batch.
SHORT = {
    "lightning-gkd": [
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "data.batch_size=4",
        "print_config=false",
    ],
    "lightning-gkd-eval": ["trainer.limit_val_batches=1", "eval.max_rows=8", "eval.batch_size=8"],
    "lightning-gkd-cache": [],
}
TOY_ROWS = {"train_data": 64, "val_data": 16, "test_data": 16}  # rows of the toy tasks' splits
QUIET_HYDRA = ["hydra/job_logging=none", "hydra/hydra_logging=none"]


def override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def short_overrides(command: DocCommand, run: int, tmp_path: Path) -> list[str]:
    """The command's overrides, shortened: fewer steps, fewer toy rows, no held-out evaluation or sample table, and a
    run folder of its own unless the command names one."""
    overrides, multirun = hydra_overrides(command)
    short = list(SHORT[command.program])
    first_point = sweep_points(overrides)[0]
    cfg = compose_train(tmp_path / "compose", first_point, config=command.config)
    GlobalHydra.instance().clear()
    for split, rows in TOY_ROWS.items():
        source = cfg.data.get(split) if "data" in cfg else None
        if isinstance(source, DictConfig) and "_target_" in source and "num_rows" not in source:
            short.append(f"+data.{split}.num_rows={rows}")
    if "callbacks" in cfg and isinstance(cfg.callbacks, DictConfig):
        short += [f"callbacks.{name}=null" for name in ("held_out_eval", "sample_table") if name in cfg.callbacks]
    keys = {override_key(override) for override in short}
    kept = [override for override in overrides if override_key(override) not in keys]
    named = {override_key(override) for override in kept}
    if multirun and "hydra.sweep.dir" not in named:
        short.append(f"hydra.sweep.dir=outputs/multirun/docs_{run}")
    if not multirun and "hydra.run.dir" not in named:
        short.append(f"hydra.run.dir=outputs/runs/docs_{run}")
    flags = [arg for arg in command.args if arg in ("-m", "--multirun")]
    if "--cfg" in command.args:
        flags += ["--cfg", command.args[command.args.index("--cfg") + 1]]
    return [*flags, *kept, *short, *QUIET_HYDRA]


def run_entry_point(program: str, args: list[str], stdin: str | None, monkeypatch) -> int:
    """Run a console script in this process as its command line would; its exit status."""
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == program]
    main = script.load()
    monkeypatch.setattr(sys, "argv", [program, *args])
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    GlobalHydra.instance().clear()
    try:
        main()
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    finally:
        GlobalHydra.instance().clear()
    return 0


# Top-level keys that are values, not config groups (a group choice's value decides what runs; a value's does not).
VALUE_KEYS = {"seed", "ckpt_path", "export", "export_merged", "print_config", "float32_matmul_precision"}


def signature(command: DocCommand) -> tuple:
    """What a run of the command exercises: the program, the config groups chosen and the keys set (not their
    values), less what the shortening sets anyway. Commands that differ only in values run once."""
    if command.config is None:
        return (command.program, command.args, command.stdin)
    overrides, multirun = hydra_overrides(command)
    shortened = {override_key(override) for override in SHORT[command.program]}
    parts = set()
    for override in overrides:
        key = override_key(override)
        if key in shortened:
            continue
        group = "." not in key and key not in VALUE_KEYS
        parts.add((override[:1] if override[:1] in "+~" else "", key, override.partition("=")[2] if group else None))
    return (command.program, multirun, "--cfg" in command.args, frozenset(parts))


def output_paths(command: DocCommand) -> set[str]:
    """The paths under outputs/ a command names (``cache.path=outputs/teacher_cache``, ``outputs/runs/x/student``)."""
    return {value for arg in command.args for value in [arg.rpartition("=")[2]] if value.startswith("outputs/")}


def runnable_blocks() -> dict[str, list[DocCommand]]:
    """page:line of a block -> the unmarked commands to run there, in order. A command that exercises nothing an
    earlier one did not (see ``signature``) is left out, unless a command kept after it in its block reads a path
    under outputs/ that it names (it writes what the later one reads)."""
    blocks: dict[str, list[DocCommand]] = {}
    for command in COMMANDS:
        if not command.needs:
            blocks.setdefault(f"{command.page}:{command.block}", []).append(command)
    seen: set[tuple] = set()
    kept = {}
    for where, commands in blocks.items():
        run = [signature(command) not in seen for command in commands]
        for index in reversed(range(len(commands))):  # a kept reader keeps the earlier writers of what it reads
            if run[index]:
                reads = output_paths(commands[index])
                for earlier in range(index):
                    writes = output_paths(commands[earlier])
                    if any(read.startswith(path) for read in reads for path in writes):
                        run[earlier] = True
        seen |= {signature(command) for command in commands}
        if any(run):
            kept[where] = [command for command, keep in zip(commands, run, strict=True) if keep]
    return kept


RUNNABLE = runnable_blocks()


@pytest.mark.slow
@pytest.mark.parametrize("where", list(RUNNABLE))
def test_unmarked_commands_run(where, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for run, command in enumerate(RUNNABLE[where]):
        args = list(command.args) if command.config is None else short_overrides(command, run, tmp_path)
        status = run_entry_point(command.program, args, command.stdin, monkeypatch)
        assert status == 0, f"{command.where}: `{command.text}` exited with {status} (ran: {command.program} {args})"


# -- the documented recipes improve the student ----------------------------------------------------------------------
#: Short documented training commands, run as written (only the held-out rows trimmed, and the run folder set): each
#: must end with the student no worse than it started (held-out "after" >= "before"). (page, the command's text, the
#: held-out metric). The longer ones (studies, hub models) are measured in docs/results.md instead.
IMPROVING = [
    ("README.md", "lightning-gkd", "accuracy"),
    ("README.md", "lightning-gkd method=sft", "accuracy"),
    ("README.md", "lightning-gkd method.seq_kd=true method.lmbda=0.0", "accuracy"),
    ("README.md", "lightning-gkd method.lmbda=1.0 method.divergence.beta=1.0", "accuracy"),
    ("README.md", "lightning-gkd model.student.lora.r=8", "accuracy"),
    (
        "docs/methods/opd.md",
        "lightning-gkd method=opd method.policy_gradient.kl_coef=1.0",
        "accuracy",
    ),
    (
        "docs/tools.md",
        "lightning-gkd experiment=toy_tools method.divergence.beta=0 optimizer.lr=1e-2 trainer.max_steps=50",
        "success",
    ),
]
HELD_OUT_ROWS = 128


def documented(page: str, text: str) -> DocCommand:
    """The command ``text`` shown on ``page`` (its comment left out); fails when the page no longer shows it."""
    found = [c for c in COMMANDS if c.page == page and " ".join([c.program, *c.args]) == text and not c.needs]
    assert found, f"{page} no longer shows `{text}`: update IMPROVING with the command it shows now"
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize(("page", "text", "metric"), IMPROVING, ids=[text for _, text, _ in IMPROVING])
def test_documented_recipes_leave_the_student_no_worse_than_it_started(page, text, metric, tmp_path, monkeypatch):
    from lightning_gkd.cli.train import run

    command = documented(page, text)
    overrides, _ = hydra_overrides(command)
    monkeypatch.chdir(tmp_path)
    cfg = compose_train(
        tmp_path, [*overrides, f"+data.test_data.num_rows={HELD_OUT_ROWS}", f"paths.cache_dir={tmp_path}"]
    )
    GlobalHydra.instance().clear()
    held_out = run(cfg)["held_out"]
    before, after = held_out["before"][metric], held_out["after"][metric]
    assert after >= before, f"{command.where}: `{text}` took held-out {metric} from {before:.3f} to {after:.3f}"
