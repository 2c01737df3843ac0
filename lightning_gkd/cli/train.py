"""Hydra entry point: compose -> build (checks, instantiate) -> fit -> finish (export, push, summary).

lightning-gkd [overrides...]      # or: python -m lightning_gkd.cli.train [overrides...]
"""

from __future__ import annotations

import difflib
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import hydra
import lightning as L
from hydra.utils import get_object, instantiate
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

import lightning_gkd.conf  # noqa: E402,F401  (registers the ${asset:...} resolver for configs composed here)
from lightning_gkd.callbacks.signal_checkpoint import SIGINT_EXIT_STATUS
from lightning_gkd.cli import put_launch_folder_on_path, run_reporting_errors, tokenizer_source
from lightning_gkd.cli.hub import check_push_settings, push_folder
from lightning_gkd.cli.sweep import in_multirun, record_job
from lightning_gkd.cli.toy_defaults import warn_toy_defaults
from lightning_gkd.cli.trainer_setup import check_logger_packages, close_loggers, logger_entries, prepare_trainer
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.data.vision_chat import load_processor
from lightning_gkd.evaluation.model_card import describe_data
from lightning_gkd.losses.cross_tokenizer_plan import check_cross_tokenizer_config
from lightning_gkd.methods.base import check_data_format
from lightning_gkd.models.loading import check_tokenizer_fits, source_config, source_vocab_size
from lightning_gkd.models.vision import check_processor_fits, is_vision_language_config
from lightning_gkd.ops.hf.forward import float32_matmul_precision, is_peft_model
from lightning_gkd.teachers.base import TeacherUnavailable
from lightning_gkd.training.checkpoint_io import use_safe_checkpoint_io
from lightning_gkd.training.nonfinite import NonFiniteLoss
from lightning_gkd.training.quiet import quiet_run
from lightning_gkd.training.resume import checkpoint_step, continue_csv_logs, fold_launch_folder, plan_resume
from lightning_gkd.training.run_record import (
    RunRecord,
    continue_tracking_runs,
    is_rank_zero,
    read_record,
    tracking_ids,
)


@rank_zero_only
def print_config(cfg: DictConfig) -> None:
    """Print the composed config as a rich tree, one branch per top-level group."""
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("config", guide_style="dim")
    for key, value in cfg.items():
        if key == "hydra":  # Hydra's own node (a config composed with return_hydra_config; @hydra.main drops it)
            continue
        if isinstance(value, DictConfig):
            tree.add(str(key)).add(rich.syntax.Syntax(OmegaConf.to_yaml(value, resolve=True), "yaml"))
        else:
            tree.add(f"{key!s}: {value}")
    rich.print(tree)


@rank_zero_only
def print_config_line(cfg: DictConfig) -> None:
    """One line instead of the tree: the command line's overrides, and where Hydra saved the whole config."""
    from hydra.core.hydra_config import HydraConfig

    overrides, saved = "", ""
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        overrides = " ".join(hydra_cfg.overrides.task)
        folder = OmegaConf.select(
            cast(DictConfig, hydra_cfg), "runtime.output_dir", default=None, throw_on_missing=False
        )
        if folder and hydra_cfg.output_subdir:  # a command's run (a config composed in process saves none)
            saved = f"; the full config: {Path(folder) / hydra_cfg.output_subdir / 'config.yaml'}"
    print(f"config: {overrides or 'the defaults'}{saved} (print_config=true prints it)", flush=True)


def instantiate_callbacks(cfg: DictConfig | None) -> list[L.Callback]:
    if not cfg:
        return []
    return [instantiate(entry) for entry in cfg.values() if entry is not None and "_target_" in entry]


@dataclass
class Run:
    """What ``build`` makes from a config: the pieces ``fit`` trains and ``finish`` reports on."""

    datamodule: L.LightningDataModule
    module: Any  # a CausalLMModule (GKDModule, DPOModule, SFTModule or a user's subclass)
    trainer: L.Trainer
    ckpt_path: str | None
    record: RunRecord | None = None  # <run>/run.json: written when the fit starts and ends (training/run_record.py)


def build_data(cfg: DictConfig) -> Any:
    """The tokenizer (``model.tokenizer``, else the student's own) and the datamodule, loaded and checked before any
    model loads, and before the loggers set up their folders (the CSV logger deletes an old metrics.csv there): the
    rows against the method's kind (chat or preference), the tokenizer against the student's vocabulary (its
    config.json only), and a vision-language student's processor (``data.processor``, null: the student's own)
    against its config. Warns first about toy-tuned values meeting a real student."""
    if cfg.model.get("build"):
        instantiate(cfg.model.build)
    trained = cfg.method.get("student") or cfg.method.get("model")
    if isinstance(trained, DictConfig):
        trained = OmegaConf.to_container(trained, resolve=True)
    # First: a mistyped student path fails here naming the missing folder (the tokenizer may come from it too).
    vocab = source_vocab_size(trained, role="student") if isinstance(trained, (str, dict)) else None
    config = source_config(trained, role="student") if isinstance(trained, (str, dict)) else None
    warn_toy_defaults(cfg)
    options: dict[str, Any] = {}
    if "processor" in cfg.data and cfg.data.processor is None and is_vision_language_config(config):
        options["processor"] = load_processor(tokenizer_source(cfg.model))  # the student's own
    datamodule = instantiate(
        cfg.data, tokenizer=load_tokenizer(tokenizer_source(cfg.model)), _convert_="all", **options
    )
    check_data_format(get_object(cfg.method._target_), datamodule)
    check_processor_fits(getattr(datamodule, "processor", None), config)
    datamodule.setup("fit")
    check_tokenizer_fits(datamodule.tokenizer, vocab)
    return datamodule


def check_method_keys(method: DictConfig) -> None:
    """ValueError, before anything loads, for a ``method.<key>`` the method's class does not take (a typo such as
    ``+method.lmbd=0.5``), naming the closest option and all of them."""
    target = get_object(str(method._target_))
    parameters = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    options = [name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = [str(key) for key in method if not str(key).startswith("_") and key not in parameters]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, options, n=1)
        hint = f" (did you mean method.{close[0]}?)" if close else ""
        raise ValueError(
            f"method.{key} is not an option of {target.__name__}{hint}. Its options: "
            f"{', '.join(f'method.{name}' for name in options if name not in ('student', 'teacher', 'tokenizer'))}."
        )


def build(cfg: DictConfig) -> Run:
    """Check what can be checked before any model loads, then instantiate data, method, trainer and callbacks."""
    # ckpt_path=last (checked against the run's record), and a resume continues in the checkpoint's run folder
    ckpt_path, record = plan_resume(cfg)
    if cfg.get("print_config"):  # after plan_resume: a resume prints the run folder it continues in
        print_config(cfg)
    else:
        print_config_line(cfg)
    if cfg.get("push_to_hub"):
        if not cfg.get("export"):
            raise ValueError("push_to_hub=true uploads the exported student: set export=true.")
        check_push_settings(cfg.get("hub_model_id"))  # before training, not after
    check_method_keys(cfg.method)
    datamodule = build_data(cfg)
    check_cross_tokenizer_config(cfg, datamodule)  # a teacher with another tokenizer: what it cannot train on
    # the optimizer and scheduler groups reach the method through method.training (${optimizer}, ${scheduler})
    module = instantiate(cfg.method, tokenizer=datamodule.tokenizer, _convert_="all")
    if hasattr(module, "check_datamodule"):
        module.check_datamodule(datamodule)
    if ckpt_path and record is not None and cfg.get("logger"):  # a resume continues its MLflow / W&B runs
        for continued in continue_tracking_runs(logger_entries(cfg.logger), read_record(record.run_dir)):
            if is_rank_zero():
                print(f"continuing the {continued} (from {record.path})", flush=True)
    logger = prepare_trainer(cfg)  # val_check_interval/log_every_n_steps clamped to max_steps; the loggers
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=instantiate_callbacks(cfg.get("callbacks")), logger=logger)
    use_safe_checkpoint_io(trainer)  # weights-only loading, atomic checkpoint writes, clear errors
    return Run(datamodule, module, trainer, ckpt_path, record)


def fit(run: Run) -> dict[str, Any]:
    """``trainer.fit``; a SIGTERM/SIGUSR1/Ctrl-C stop (the step finished and SignalCheckpoint saved it) is an
    outcome, not an error. Records the fit in the run's ``run.json``. Returns the run's figures and what its
    callbacks report (``run_summary()``)."""
    started = time.perf_counter()
    if run.record is not None:
        run.record.started()
        run.record.tracking_runs(tracking_ids(run.trainer.loggers))  # a resume continues these runs
    if run.ckpt_path:  # resuming into a run folder: its metrics.csv continues
        continue_csv_logs(run.trainer.loggers, checkpoint_step(run.ckpt_path))
    status = "interrupted"  # a second Ctrl-C (Lightning exits) unless one of the outcomes below
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path, weights_only=True)
        stopped_by_signal, teacher_unavailable, status = False, None, "finished"
        if any(getattr(callback, "stop_reason", None) for callback in run.trainer.callbacks):  # type: ignore[attr-defined]
            status = "stopped"  # a LengthGuard with stop=true: resumable
    except SIGTERMException:
        stopped_by_signal, teacher_unavailable, status = True, None, "stopped"
    except TeacherUnavailable as error:  # TeacherOutage saved checkpoints/last.ckpt at the last finished step
        stopped_by_signal, teacher_unavailable, status = False, str(error), "stopped"
    except NonFiniteLoss:  # NonFiniteStop saved checkpoints/last.ckpt before the bad step: resumable, and an error
        status = "stopped"
        raise
    except Exception:
        status = "failed"
        raise
    finally:
        if run.record is not None:
            run.record.ended(status, run.trainer.global_step)
    result: dict[str, Any] = {
        "metrics": {key: float(value) for key, value in run.trainer.callback_metrics.items()},
        "global_step": run.trainer.global_step,
        "fit_seconds": time.perf_counter() - started,
        "tokens_per_sec": run.module.tokens_per_second(),
        "trained_tokens": run.module.trained_tokens,
        "student_dir": None,
        "merged_dir": None,
        "hub_url": None,
        "stopped_by_signal": stopped_by_signal,
        "teacher_unavailable": teacher_unavailable,
        "resumed_from": run.ckpt_path,
        "resume_from": None,
        "stop_signal": None,
        "length_guard_stop": None,
        "run_dir": str(run.record.run_dir) if run.record is not None else None,
        "held_out": {},
    }
    for callback in run.trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        summary = getattr(callback, "run_summary", None)
        if callable(summary):  # a value one callback has is not unset by another's None
            result.update({key: value for key, value in summary().items() if value is not None or key not in result})
    return result


def finish(cfg: DictConfig, run: Run, result: dict[str, Any]) -> dict[str, Any]:
    """Export (and push) the trained model unless the run was stopped early, then print the summary."""
    stopped = result["stopped_by_signal"] or result.get("teacher_unavailable") or result.get("length_guard_stop")
    if cfg.get("export") and run.trainer.is_global_zero and not stopped:
        # A LoRA student exports its adapter to student/ and, with export_merged, the merged model to
        # student_merged/; any other model exports itself to student/.
        output_dir = Path(cfg.paths.output_dir)
        merged = output_dir / "student_merged" if cfg.get("export_merged", True) else None
        result["student_dir"] = str(
            run.module.export(output_dir / "student", card_info=card_info(cfg, result), merged_path=merged)
        )
        if merged is not None and is_peft_model(run.module.model):
            result["merged_dir"] = str(merged.resolve())
        if cfg.get("push_to_hub"):
            result["hub_url"] = push_folder(
                result["student_dir"], cfg.hub_model_id, private=bool(cfg.get("hub_private_repo"))
            )
    print_summary(result)
    return result


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says (build -> fit -> finish); return the final metrics and where the student went."""
    check_logger_packages(cfg.get("logger"))  # logger=wandb|mlflow without its package: before any model loads
    L.seed_everything(cfg.seed, workers=True)
    # Both restored after the run (tests, notebooks); quiet_run drops the warnings and bars a run expects.
    with float32_matmul_precision(cfg.get("float32_matmul_precision")), quiet_run():
        built = build(cfg)
        failed = True
        try:
            result = finish(cfg, built, fit(built))
            failed = False
            return result
        finally:
            close_loggers(built.trainer.loggers, failed=failed)  # a W&B run ends with its job


def card_info(cfg: DictConfig, result: dict[str, Any]) -> dict[str, Any]:
    """What the model card records beyond the module's own view: the run's knobs and results."""
    info: dict[str, Any] = {
        "seed": cfg.seed,
        "fit time (s)": round(result["fit_seconds"], 1),
        "throughput (completion tokens/s)": round(result["tokens_per_sec"]),
    }
    data = cfg.get("data")
    if data is not None:
        info["data"] = {
            split: describe_data(data.get(key))
            for split, key in (("train", "train_data"), ("val", "val_data"), ("test", "test_data"))
            if data.get(key) is not None
        }
    if result.get("resumed_from"):
        info["resumed from"] = result["resumed_from"]
    for who, scores in result["held_out"].items():
        for name, value in scores.items():
            label = "gap closed" if who == "gap_closed" else who
            info[f"held-out {name} ({label})"] = "n/a" if value is None else round(float(value), 4)
    return info


# Not in the summary: the throughput line has it; a schedule's last value; GKD's last-batch coin (the fraction is
# shown).
SUMMARY_HIDDEN = {"train/tokens_per_sec", "train/lr", "train/on_policy"}
#: The summary's names of the held-out results (``HeldOutEvaluation.results``' keys).
HELD_OUT_LABELS = {
    "teacher": "teacher",
    "before": "student before",
    "after": "student after",
    "gap_closed": "gap closed",
}


@rank_zero_only
def print_summary(result: dict[str, Any]) -> None:
    """Steps, time, throughput, final losses and metrics, held-out scores, and where the student went."""
    lines = [
        f"steps: {result['global_step']}  fit time: {result['fit_seconds']:.1f}s  "
        f"throughput: {result['tokens_per_sec']:.0f} tokens/s ({result['trained_tokens']} completion tokens "
        "trained)"
    ]
    metrics = {
        name: value
        for name, value in result["metrics"].items()
        if not name.startswith("test/") and name not in SUMMARY_HIDDEN
    }
    losses = sorted(name for name in metrics if name.endswith("/loss"))
    lines += [f"{name}: {metrics[name]:.4f}" for name in losses + sorted(set(metrics) - set(losses))]
    for who, scores in result["held_out"].items():
        label = HELD_OUT_LABELS.get(who, who)
        lines += [
            f"held-out {name} ({label}): " + (f"{value:.4f}" if value is not None else "n/a (teacher not above start)")
            for name, value in scores.items()
        ]
    best = result.get("best_model")
    if best:
        loaded = f", loaded at the end from {best['loaded']}" if best.get("loaded") else ""
        start = f" (start {best['start']:.4f})" if best.get("start") is not None else ""
        lines.append(f"best validation: {best['value']:.4f} at step {best['step']}{start}{loaded}")
    if result.get("below_start"):
        lines.append(f"warning: {result['below_start']}")
    if result.get("teacher_unavailable"):
        lines.append(f"stopped: the teacher server stayed unavailable ({result['teacher_unavailable']}); not exported")
    if result["stopped_by_signal"]:
        signal_name = result.get("stop_signal") or "a signal"
        how = "Ctrl-C (SIGINT)" if signal_name == "SIGINT" else signal_name
        lines.append(f"stopped by {how} after step {result['global_step']}, before the end: not exported")
    if result.get("length_guard_stop"):
        lines.append(
            f"stopped by the length guard after step {result['global_step']} ({result['length_guard_stop']}); "
            "not exported"
        )
    if result["stopped_by_signal"] or result.get("teacher_unavailable") or result.get("length_guard_stop"):
        if result["resume_from"]:
            lines.append(f"resume with: ckpt_path={result['resume_from']}  (or ckpt_path=last)")
    if result.get("resumed_from"):
        lines.append(f"resumed from: {result['resumed_from']} (run folder: {result.get('run_dir')})")
    if result["student_dir"]:
        lines.append(f"trained model exported to: {result['student_dir']}")
    if result.get("merged_dir"):
        lines.append(f"merged model (adapters folded in) exported to: {result['merged_dir']}")
    if result.get("hub_url"):
        lines.append(f"pushed to the hub: {result['hub_url']}")
    print("\n".join(["== lightning_gkd summary =="] + lines), flush=True)


@hydra.main(version_base="1.3", config_path="pkg://lightning_gkd.conf", config_name="train")
def main(cfg: DictConfig) -> dict[str, Any]:
    """The ``lightning-gkd`` command. Exit status: 0 when trained (or stopped by SIGTERM/SIGUSR1 with a checkpoint
    saved), 130 after a Ctrl-C (a checkpoint saved on the first one), 1 when the teacher server stayed down, the
    length guard stopped the run (``callbacks.length_guard.stop=true``) or the run failed. Returns ``run``'s result
    (a multirun's SweepSummary reads it)."""
    put_launch_folder_on_path()  # before anything is instantiated from the config
    launched_in = Path(cfg.paths.output_dir)  # the folder Hydra made; a resume moves the run to its own folder
    try:
        result = run_reporting_errors(lambda: run(cfg), multirun=in_multirun())
    except KeyboardInterrupt:  # Ctrl-C before training started (inside fit, Lightning and SignalCheckpoint see it)
        print("\nCtrl-C before training started: stopped; nothing to save.", file=sys.stderr, flush=True)
        record_job(error=KeyboardInterrupt("Ctrl-C before training started"))
        raise SystemExit(SIGINT_EXIT_STATUS) from None
    if not in_multirun():
        fold_launch_folder(launched_in, Path(cfg.paths.output_dir))  # Hydra's files of a resume join the run
    if result.get("stop_signal") == "SIGINT" or result.get("teacher_unavailable") or result.get("length_guard_stop"):
        record_job(result)  # a multirun job: Hydra does not see this end as a job's end
        # Ctrl-C: 130, as shells report it, so `lightning-gkd ... && next-step` stops; a teacher outage or a
        # collapse the length guard stopped is a failed run for schedulers and shells. The summary says how to
        # resume.
        raise SystemExit(SIGINT_EXIT_STATUS if result.get("stop_signal") == "SIGINT" else 1)
    return result


if __name__ == "__main__":
    main()
