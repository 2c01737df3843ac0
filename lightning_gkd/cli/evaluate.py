"""Hydra entry point: evaluate a model without training. The configured method's validation loss (on chat data also
the cross-entropy and perplexity of the dataset completions), greedy generation metrics on the validation sets and
``test_data``, and every scored completion.

lightning-gkd-eval eval.model=outputs/runs/<run>/student                 # an exported folder (or a hub id)
lightning-gkd-eval eval.model=outputs/runs/<run>/checkpoints/last.ckpt   # a checkpoint of a run with this config
lightning-gkd-eval                                                       # model.student as configured
python -m lightning_gkd.cli.evaluate ...                                 # the same

Every group and override of ``lightning-gkd`` composes here (conf/evaluate.yaml starts from conf/train.yaml).
Writes ``eval.json`` (the figures) and ``samples.jsonl`` (prompt, completion, reference, per-row scores) to its run
folder, ``outputs/eval/<time>/`` (or ``hydra.run.dir``), and prints a summary. With a training run's
``held_out.json`` beside the model (``eval.reference``), the test scores also come as the recovered fraction of
that run's teacher–student gap (``test/<metric>_gap_closed``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import hydra
import lightning as L
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

import lightning_gkd.conf  # noqa: F401  (registers the ${asset:...} resolver for configs composed here)
from lightning_gkd.cli import put_launch_folder_on_path, run_reporting_errors, tokenizer_source
from lightning_gkd.cli.eval_checkpoint import check_fits_student, load_weights, read_checkpoint
from lightning_gkd.cli.model_source import check_model_folder, has_tokenizer
from lightning_gkd.cli.sweep import in_multirun
from lightning_gkd.cli.train import print_config
from lightning_gkd.data.chat import ChatDataModule
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.metrics import GenerationMetric, evaluate_generations, gaps_closed
from lightning_gkd.methods.base import check_data_format
from lightning_gkd.methods.sft import SFTModule
from lightning_gkd.models.loading import check_tokenizer_fits, source_vocab_size
from lightning_gkd.ops.decoding.sampling import eos_ids
from lightning_gkd.ops.hf.forward import float32_matmul_precision, resolve_eos_token_id
from lightning_gkd.rollouts import MultiTurnRollout, RolloutSettings, build_rollout
from lightning_gkd.rollouts.evaluate import final_answers, rollout_rows
from lightning_gkd.training.checkpoint_io import CheckpointError
from lightning_gkd.training.quiet import quiet_run

LOSS_MODES = ("auto", "method", "cross_entropy", "none")


@dataclass(frozen=True)
class EvalTarget:
    """What ``eval.model`` names: ``config`` (model.student as configured), ``folder``, ``hub`` or
    ``checkpoint``."""

    kind: str
    source: str | None = None

    def describe(self) -> str:
        if self.kind == "config":
            return "model.student (as configured)"
        return f"{self.source} ({'exported folder' if self.kind == 'folder' else self.kind})"


# -- checks before anything loads -------------------------------------------------------------------------------------
def check_settings(cfg: DictConfig) -> None:
    """The ``eval:`` block and the settings eval cannot honour, before any data or model loads."""
    settings = cfg.get("eval")
    if settings is None:
        raise ValueError("The config has no eval: block; compose conf/evaluate.yaml (lightning-gkd-eval).")
    if settings.get("loss", "auto") not in LOSS_MODES:
        raise ValueError(f"eval.loss must be one of {', '.join(LOSS_MODES)}, got {settings.get('loss')!r}.")
    for key in ("max_new_tokens", "batch_size"):
        value = settings.get(key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"eval.{key} must be an integer >= 1, got {value!r}.")
    max_rows = settings.get("max_rows")
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"eval.max_rows must be an integer >= 1 or null (every row), got {max_rows!r}.")
    if cfg.get("ckpt_path"):
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path} resumes training; to evaluate a checkpoint pass eval.model={cfg.ckpt_path}."
        )
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    if str(devices) != "1" or str(nodes) != "1":
        raise ValueError(
            f"lightning-gkd-eval runs in one process: got trainer.devices={devices}, trainer.num_nodes={nodes}. "
            "Set trainer.devices=1 (and trainer.num_nodes=1)."
        )


def resolve_target(value: Any) -> EvalTarget:
    """``eval.model`` as an :class:`EvalTarget`; a missing folder or checkpoint raises here, before any loading."""
    if value is None or value == "":
        return EvalTarget("config")
    value = str(value)
    if value.endswith(".ckpt"):
        path = Path(value).expanduser()
        if not path.exists():
            others = sorted(p.name for p in path.parent.glob("*.ckpt")) if path.parent.is_dir() else []
            raise CheckpointError(
                f"eval.model: checkpoint {value!r} does not exist (relative to {Path.cwd()})."
                + (f" Checkpoints in its folder: {', '.join(others)}." if others else "")
            )
        if path.is_dir():
            raise CheckpointError(
                f"eval.model={value!r} is a folder (a sharded checkpoint); lightning-gkd-eval reads one-file "
                "checkpoints. Evaluate the run's exported student folder instead."
            )
        return EvalTarget("checkpoint", str(Path(value).expanduser().resolve()))
    folder = check_model_folder(value, "eval.model")
    return EvalTarget("hub", value) if folder is None else EvalTarget("folder", str(folder))


def apply_target(cfg: DictConfig, target: EvalTarget) -> str:
    """Point ``model.student`` (and the tokenizer) at an exported folder or hub id, before anything loads; return
    where the tokenizer comes from: ``eval.tokenizer``, else the folder's or hub id's own, else ``model.tokenizer``."""
    with open_dict(cfg):
        if target.kind in ("folder", "hub"):
            student = cfg.model.student
            student.name_or_path = target.source
            student.pop("config", None)
            if student.get("lora") is not None:  # the folder is the trained model (or its adapter) already
                student.lora.r = None
            if target.kind == "hub" or has_tokenizer(Path(str(target.source))):
                cfg.model.tokenizer = target.source
            elif not cfg.model.get("tokenizer") and not cfg.eval.get("tokenizer"):
                raise FileNotFoundError(
                    f"eval.model={target.source} holds no tokenizer (no tokenizer.json or tokenizer_config.json) and "
                    "model.tokenizer is null: set eval.tokenizer=<the tokenizer folder or hub id it was trained with>."
                )
        if cfg.eval.get("tokenizer"):
            cfg.model.tokenizer = cfg.eval.tokenizer
    return tokenizer_source(cfg.model)


def resolve_reference(value: Any, target: EvalTarget) -> Path | None:
    """The ``held_out.json`` whose teacher and student-before scores the gap is measured against, from
    ``eval.reference``: ``auto`` = the run folder's own when ``eval.model`` is a run's exported folder
    (``<run>/student``) or checkpoint (``<run>/checkpoints/*.ckpt``) and it has one (else None); a path (a
    missing one raises here, before any loading); null = None."""
    if value is None or value == "":
        return None
    if str(value) == "auto":
        if target.kind not in ("folder", "checkpoint"):
            return None
        source = Path(str(target.source))
        found = (source.parent if target.kind == "folder" else source.parent.parent) / "held_out.json"
        return found if found.is_file() else None
    path = Path(str(value)).expanduser()
    if path.is_dir():
        path = path / "held_out.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"eval.reference={value!r}: no such file (relative to {Path.cwd()}). Pass a training run's held_out.json "
            "(or its folder), auto (the run of eval.model), or null."
        )
    return path


def gap_against(reference: Path, after: Mapping[str, float], test_rows: int, max_new_tokens: int) -> dict[str, Any]:
    """eval.json's ``gap_closed`` block: the test scores ``after`` (``{metric: value}``, of ``test_rows`` rows)
    against ``reference``'s teacher and student-before scores: ``scores`` (``gaps_closed``; None where the teacher
    does not score above the start), with ``teacher`` and ``before``; or, where the two cannot be compared (no
    teacher in it, another number of test rows or another token budget), ``why`` not."""
    saved = json.loads(reference.read_text())
    block: dict[str, Any] = {"reference": str(reference.resolve())}
    teacher, before = saved.get("teacher"), saved.get("before")
    if not teacher or not before:
        return {
            **block,
            "why": "it has no teacher scores (the run had no in-process teacher)" if before else "it has no scores",
        }
    if test_rows != saved.get("num_rows"):
        return {**block, "why": f"it scored {saved.get('num_rows')} test rows, this evaluation {test_rows}"}
    if saved.get("max_new_tokens", max_new_tokens) != max_new_tokens:
        return {
            **block,
            "why": f"it generated up to {saved['max_new_tokens']} tokens, this evaluation {max_new_tokens} "
            "(eval.max_new_tokens)",
        }
    return {**block, "teacher": teacher, "before": before, "scores": gaps_closed(after, before, teacher)}


def resolve_loss_mode(cfg: DictConfig, chat: bool) -> tuple[str, str]:
    """``eval.loss`` with ``auto`` decided: (mode, why)."""
    mode = str(cfg.eval.get("loss", "auto"))
    if mode == "cross_entropy" and not chat:
        raise ValueError(
            f"eval.loss=cross_entropy scores chat rows (messages); data={cfg.data.get('_target_')} is not chat data. "
            "Use eval.loss=method (the method's own validation loss) or eval.loss=none."
        )
    if mode != "auto":
        return mode, f"eval.loss={mode}"
    if _teacher_missing(cfg.method):
        return "cross_entropy", "no teacher configured (method.teacher has no model)"
    return "method", f"the loss of {cfg.method.get('_target_')}"


def _teacher_missing(method: DictConfig) -> bool:
    if "teacher" not in method:
        return False
    teacher = method.teacher
    if teacher is None:
        return True
    if isinstance(teacher, DictConfig) and teacher.get("kind", "local") == "local" and "model" in teacher:
        model = teacher.model
        if model is None:
            return True
        return isinstance(model, DictConfig) and not model.get("name_or_path") and not model.get("config")
    return False


def student_spec(cfg: DictConfig) -> dict[str, Any]:
    """``model.student`` resolved to a plain dict (what ``load_causal_lm`` takes)."""
    spec = OmegaConf.to_container(cfg.model.student, resolve=True)
    if not isinstance(spec, dict):
        raise ValueError(f"model.student must be a mapping (name_or_path, init_kwargs, ...), got {spec!r}.")
    return {str(key): value for key, value in spec.items()}


# -- the evaluation ---------------------------------------------------------------------------------------------------
def build_module(cfg: DictConfig, mode: str, datamodule: Any) -> Any:
    """The configured method (``method`` mode), or an ``SFTModule`` around the configured student when only the
    cross-entropy is wanted (no teacher or reference loads)."""
    if mode == "method":
        module = instantiate(cfg.method, tokenizer=datamodule.tokenizer, _convert_="all")
        if hasattr(module, "check_datamodule"):
            module.check_datamodule(datamodule)
        return module
    spec = student_spec(cfg)
    return SFTModule(spec, datamodule.tokenizer, training={"trust_remote_code": bool(spec.get("trust_remote_code"))})


def validation_losses(trainer: L.Trainer, module: Any, datamodule: Any, mode: str, chat: bool) -> dict[str, float]:
    """The method's validation figures (``val/loss``, DPO's rewards...) and, on chat data, ``val/cross_entropy`` and
    ``val/perplexity`` (exp of it) of the dataset completions."""
    if mode == "none" or not _has_val_rows(datamodule):
        return {}
    values: dict[str, float] = {}
    if mode == "method":
        trainer.validate(module, datamodule=datamodule, verbose=False)
        values.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if chat:
        if mode == "cross_entropy":  # module is the SFTModule around the student
            trainer.validate(module, datamodule=datamodule, verbose=False)
        elif type(module) is not SFTModule:  # SFT's validation loss is the cross-entropy already
            trainer.validate(SFTModule(module.model, module.tokenizer), datamodule=datamodule, verbose=False)
        for key, value in trainer.callback_metrics.items():
            if key.endswith("/loss"):
                values[key.removesuffix("loss") + "cross_entropy"] = float(value)
                values[key.removesuffix("loss") + "perplexity"] = math.exp(min(float(value), 700.0))
    return values


def _has_val_rows(datamodule: Any) -> bool:
    return bool(getattr(datamodule, "val_rows", None))


def eval_sets(datamodule: Any, max_rows: int | None) -> list[tuple[str, Sequence[Mapping[str, Any]], int | None]]:
    """(prefix, rows, max_length) per set to generate on: each validation set at the data's max_length (as
    validation scores it), then ``test_data`` at ``evaluate_generations``' own (as ``HeldOutEvaluation`` does)."""
    datamodule.setup("test")
    named = getattr(datamodule, "val_sets", None)
    sets: list[tuple[str, Any, int | None]] = []
    if named:
        sets += [(f"val/{name}", rows, datamodule.max_length) for name, rows in named.items()]
    elif datamodule.val_rows is not None:
        sets.append(("val", datamodule.val_rows, datamodule.max_length))
    if getattr(datamodule, "test_rows", None) is not None:
        sets.append(("test", datamodule.test_rows, None))
    if max_rows is not None:
        sets = [(prefix, [rows[i] for i in range(min(max_rows, len(rows)))], length) for prefix, rows, length in sets]
    return sets


def scored_generations(
    model: nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    metrics: Mapping[str, GenerationMetric],
    **options: Any,
) -> tuple[dict[str, float], list[str], list[str]]:
    """``evaluate_generations`` (the numbers ``HeldOutEvaluation`` reports), keeping the completions and references
    it scored: (scores, predictions, references)."""
    seen: dict[str, list[str]] = {}

    def keep(metric: GenerationMetric) -> GenerationMetric:
        def scored(predictions: Sequence[str], references: Sequence[str]) -> float:
            seen["predictions"], seen["references"] = list(predictions), list(references)
            return metric(predictions, references)

        return scored

    scores = evaluate_generations(
        model, tokenizer, rows, metrics={name: keep(m) for name, m in metrics.items()}, **options
    )
    return scores, seen.get("predictions", []), seen.get("references", [])


def method_rollout(cfg: DictConfig, module: Any, tokenizer: Any) -> MultiTurnRollout | None:
    """The configured method's multi-turn rollout (``method.rollout.tools`` or ``method.rollout.environment``): the
    module's own, or built from the settings when only the student loaded (``eval.loss=cross_entropy``); None
    without tools."""
    if getattr(module, "rollout", None) is not None:
        return cast(MultiTurnRollout, module.rollout)
    method = cast(dict[str, Any], OmegaConf.to_container(cfg.method, resolve=True))
    settings = RolloutSettings(**(method.get("rollout") or {}))
    if not settings.enabled:
        return None
    return build_rollout(tokenizer, settings, eos_token_ids=eos_ids(resolve_eos_token_id(module.model, tokenizer)))


def generation_results(
    model: nn.Module,
    tokenizer: Any,
    sets: Sequence[tuple[str, Sequence[Mapping[str, Any]], int | None]],
    metrics: Mapping[str, GenerationMetric],
    *,
    max_new_tokens: int,
    batch_size: int,
    rollout: MultiTurnRollout | None = None,
) -> tuple[dict[str, float], dict[str, int], list[dict[str, Any]]]:
    """Greedy completions of every set, scored: (``<prefix>/<metric>`` values, rows per set, samples). With a
    ``rollout`` (tools), each prompt is a greedy multi-turn rollout, scored on its final answer; its sample keeps the
    transcript."""
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    samples: list[dict[str, Any]] = []
    for prefix, rows, max_length in sets:
        if not len(rows):
            continue
        options: dict[str, Any] = {"batch_size": batch_size, "max_new_tokens": max_new_tokens}
        transcripts: list[Any] = []
        if rollout is not None:
            transcripts, _ = rollout_rows(model, tokenizer, rows, rollout, **options)
            predictions = final_answers(transcripts)
            references = [str(row["messages"][-1]["content"]) for row in rows]
            scores = {name: float(metric(predictions, references)) for name, metric in metrics.items()}
        else:
            if max_length is not None:
                options["max_length"] = max_length
            scores, predictions, references = scored_generations(model, tokenizer, rows, metrics, **options)
        values.update({f"{prefix}/{name}": value for name, value in scores.items()})
        counts[prefix] = len(rows)
        for index, (prediction, reference) in enumerate(zip(predictions, references, strict=True)):
            messages = [dict(m) for m in rows[index]["messages"]]
            prompt = messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages
            if transcripts:  # what the agent was given: the conversation before its first turn
                first = next((k for k, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
                prompt = messages[:first]
            samples.append(
                {
                    "split": prefix,
                    "index": index,
                    "prompt": prompt,
                    "completion": prediction,
                    "reference": reference,
                    "scores": {name: float(m([prediction], [reference])) for name, m in metrics.items()},
                    **({"transcript": transcripts[index]} if transcripts else {}),
                }
            )
    return values, counts, samples


def run(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate ``eval.model`` as ``cfg`` says; write ``eval.json`` and ``samples.jsonl`` to ``paths.output_dir``,
    print the summary and return what ``eval.json`` holds."""
    check_settings(cfg)
    target = resolve_target(cfg.eval.get("model"))
    checkpoint = read_checkpoint(str(target.source)) if target.kind == "checkpoint" else None
    reference = resolve_reference(cfg.eval.get("reference", "auto"), target)
    tokenizer = apply_target(cfg, target)
    if cfg.get("print_config"):
        print_config(cfg)
    L.seed_everything(cfg.seed, workers=True)
    with float32_matmul_precision(cfg.get("float32_matmul_precision")), quiet_run():
        if cfg.model.get("build"):
            instantiate(cfg.model.build)
        if checkpoint is not None:  # before the student loads: its config.json tells the shapes
            check_fits_student(checkpoint, student_spec(cfg), str(target.source))
        datamodule = instantiate(cfg.data, tokenizer=load_tokenizer(tokenizer), _convert_="all")
        datamodule.setup("validate")
        check_tokenizer_fits(datamodule.tokenizer, source_vocab_size(student_spec(cfg), role="student"))
        chat = isinstance(datamodule, ChatDataModule)
        mode, why = resolve_loss_mode(cfg, chat)
        if mode == "method":
            check_data_format(get_object(cfg.method._target_), datamodule)
        module = build_module(cfg, mode if mode != "none" else "cross_entropy", datamodule)
        if checkpoint is not None:
            load_weights(module, checkpoint, str(target.source))
        metrics: dict[str, GenerationMetric] = dict(module.validation.metrics)
        if mode == "cross_entropy" or (mode == "none" and chat):
            configured = (cfg.method.get("validation") or {}).get("metrics")
            metrics = dict(instantiate(configured, _convert_="all") or {})
        if chat:  # generation runs once below, over every set, keeping the texts
            module.validation = replace(module.validation, metrics={})
        trainer: L.Trainer = instantiate(cfg.trainer, callbacks=[], logger=False)
        values = validation_losses(trainer, module, datamodule, mode, chat)
        counts: dict[str, int] = {}
        samples: list[dict[str, Any]] = []
        if chat and metrics:
            model = module.model.to(trainer.strategy.root_device)
            generated, counts, samples = generation_results(
                model,
                datamodule.tokenizer,
                eval_sets(datamodule, cfg.eval.get("max_rows")),
                metrics,
                max_new_tokens=cfg.eval.max_new_tokens,
                batch_size=cfg.eval.batch_size,
                rollout=method_rollout(cfg, module, datamodule.tokenizer),
            )
            values.update(generated)
    held_out = {key.removeprefix("test/"): value for key, value in values.items() if key.startswith("test/")}
    gap: dict[str, Any] | None = None
    if reference is not None and counts.get("test"):
        gap = gap_against(reference, held_out, counts["test"], cfg.eval.max_new_tokens)
        for name, value in (gap.get("scores") or {}).items():
            if value is not None:  # None: the teacher does not score above the start
                values[f"test/{name}_gap_closed"] = value
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "model": target.source or student_spec(cfg).get("name_or_path"),
        "kind": target.kind,
        "tokenizer": tokenizer,
        "method": type(module).__name__,
        "loss": mode,
        "loss_reason": why,
        "metrics": values,
        "num_rows": counts,
        "generation_metrics": sorted(metrics) if counts else [],
        # test_data's scores as lightning-gkd's result names them (a multirun's summary shows them as columns)
        "held_out": {
            "eval": held_out,
            **({"gap_closed": gap["scores"]} if gap and "scores" in gap else {}),
        },
        # the reference run's held_out.json, its teacher's and student-before scores and this model's gap closed
        "gap_closed": gap,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "samples": len(samples),
        "output_dir": str(output_dir.resolve()),
    }
    (output_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(output_dir / "samples.jsonl", "w") as handle:
        for sample in samples:
            handle.write(json.dumps(sample) + "\n")
    print_summary(result, target)
    return result


def print_summary(result: Mapping[str, Any], target: EvalTarget) -> None:
    """The figures, one per line, and where they were written."""
    metrics: dict[str, float] = result["metrics"]
    lines = [f"model: {target.describe()}", f"loss: {result['loss']} ({result['loss_reason']})"]
    for key in sorted(metrics, key=lambda k: (k.split("/")[0] != "val", not k.endswith("/loss"), k)):
        prefix, name = key.rsplit("/", 1)
        generated = prefix in result["num_rows"] and name in result["generation_metrics"]
        rows = f"  ({result['num_rows'][prefix]} rows, greedy)" if generated else ""
        lines.append(f"{key}: {metrics[key]:.4f}{rows}")
    if not metrics:
        lines.append("nothing to report: no validation rows and no generation metrics (method.validation.metrics)")
    gap = result.get("gap_closed")
    if gap is not None:
        undefined = [name for name, value in (gap.get("scores") or {}).items() if value is None]
        lines += [
            f"test/{name}_gap_closed: n/a (the reference's teacher does not score above its start)"
            for name in undefined
        ]
        lines.append(
            f"gap closed against: {gap['reference']}" + (f" - not computed: {gap['why']}" if "why" in gap else "")
        )
    lines.append(f"written: {Path(result['output_dir']) / 'eval.json'}, samples.jsonl ({result['samples']} rows)")
    print("\n".join(["== lightning_gkd evaluation ==", *lines]), flush=True)


@hydra.main(version_base="1.3", config_path="pkg://lightning_gkd.conf", config_name="evaluate")
def main(cfg: DictConfig) -> dict[str, Any]:
    put_launch_folder_on_path()  # before anything is instantiated from the config
    return run_reporting_errors(lambda: run(cfg), multirun=in_multirun())  # a sweep summary reads its "metrics"


if __name__ == "__main__":
    main()
