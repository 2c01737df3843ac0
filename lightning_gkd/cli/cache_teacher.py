"""Hydra entry point: cache the teacher's signal (top-k log-probs, or with ``cache.signal=hidden`` its final hidden
states and head) over the training split of ``data=`` (the format: ``lightning_gkd.teachers.offline.format``), so
distillation can read it instead of running the teacher.

lightning-gkd-cache cache.path=outputs/teacher_cache cache.top_k=20     # or: python -m lightning_gkd.cli.cache_teacher
lightning-gkd-cache cache.path=outputs/hidden_cache cache.signal=hidden  # exact dense teacher, 2H bytes per token
lightning-gkd-cache model=hub data=hub data.train_data=trl-lib/tldr trainer=gpu cache.path=outputs/tldr_cache

Rerunning a stopped build with the same settings writes only the missing shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import hydra
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

import lightning_gkd.conf  # noqa: F401  (registers the ${asset:...} resolver for configs composed here)
from lightning_gkd.cli import put_launch_folder_on_path, run_reporting_errors, tokenizer_source
from lightning_gkd.cli.sweep import in_multirun
from lightning_gkd.data.rows import ChainedRows, fit_rows
from lightning_gkd.data.sources import load_rows
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.models.loading import source_vocab_size
from lightning_gkd.teachers.offline.build import CacheBuildReport, build_teacher_cache
from lightning_gkd.teachers.offline.completions import build_teacher_completions
from lightning_gkd.teachers.offline.fingerprints import data_fingerprint, teacher_identity
from lightning_gkd.teachers.offline.format import check_signal, manifest_signal
from lightning_gkd.teachers.offline.reader import refuse_every_assistant_turn


def check_cache_config(cache: DictConfig) -> None:
    """The ``cache:`` block, before any data or model loads."""
    if not cache.get("path"):
        raise ValueError("cache.path is required: the folder the teacher cache goes to (or is resumed in).")
    if cache.get("completions", "dataset") not in ("dataset", "teacher"):
        raise ValueError(f"cache.completions must be dataset or teacher, got {cache.get('completions')!r}.")
    check_signal(cache.get("signal", "topk"), cache.get("hidden_dtype", "float16"))
    for key in ("top_k", "shard_size", "batch_size"):
        value = cache.get(key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"cache.{key} must be an integer >= 1, got {value!r}.")


def run(cfg: DictConfig) -> CacheBuildReport:
    """Load the tokenizer and the training rows as ``data=`` does, check the cache folder and its settings, then
    run the teacher of ``model=`` over the rows on the ``trainer=`` devices; print and return the report."""
    check_cache_config(cfg.cache)
    if cfg.model.get("build"):
        instantiate(cfg.model.build)
    datamodule = instantiate(cfg.data, tokenizer=load_tokenizer(tokenizer_source(cfg.model)), _convert_="all")
    refuse_every_assistant_turn(datamodule)
    datamodule.setup("fit")
    trainer = instantiate(
        cfg.trainer, callbacks=[], logger=False, enable_checkpointing=False, use_distributed_sampler=False
    )
    teacher: Any = OmegaConf.to_container(cfg.model.teacher, resolve=True)
    rows = fit_rows(datamodule)  # training, then validation rows: both losses read the cache
    if cfg.cache.get("completions", "dataset") == "teacher":
        rows = ChainedRows([teacher_completions(cfg, teacher, datamodule, trainer), *rows.parts[1:]])
    report = build_teacher_cache(
        teacher,
        datamodule.tokenizer,
        rows,
        cfg.cache.path,
        top_k=cfg.cache.top_k,
        signal=cfg.cache.get("signal", "topk"),
        hidden_dtype=cfg.cache.get("hidden_dtype", "float16"),
        max_length=datamodule.max_length,
        batch_size=cfg.cache.batch_size,
        shard_size=cfg.cache.shard_size,
        trainer=trainer,
        trust_remote_code=bool(teacher.get("trust_remote_code", False)),
        vocab_rows=cache_vocab_rows(cfg, teacher),
    )
    print_report(report)
    return report


def cache_vocab_rows(cfg: DictConfig, teacher: Any) -> int | None:
    """``cache.vocab_rows``, else the student's vocabulary rows when they are fewer than the teacher's (one tokenizer,
    padded differently: the cache then covers the ids the student has), else None (all the teacher's rows). Read
    from the models' configs; no weights load."""
    given = cfg.cache.get("vocab_rows")
    if given is not None:
        return int(given)
    student = cfg.model.get("student")
    spec = cast(dict[str, Any], OmegaConf.to_container(student, resolve=True)) if student else None
    student_rows = source_vocab_size(spec, role="student") if spec else None
    teacher_rows = source_vocab_size(teacher, role="teacher")
    if student_rows is None or teacher_rows is None or student_rows >= teacher_rows:
        return None
    return student_rows


def teacher_completions(cfg: DictConfig, teacher: Any, datamodule: Any, trainer: Any) -> Sequence[Mapping[str, Any]]:
    """Offline SeqKD (``cache.completions=teacher``): the training rows with the teacher's completions, written to
    ``<cache.path>/completions.jsonl`` on the ``trainer=`` devices, in parts of ``cache.shard_size`` rows dealt to
    the ranks (a rerun writes only the missing parts, or reuses the file), and read back as training will read them."""
    path = build_teacher_completions(
        teacher,
        datamodule.tokenizer,
        datamodule.train_rows,
        cfg.cache.path,
        {"teacher": teacher_identity(teacher), "data_fingerprint": data_fingerprint(datamodule.train_rows)},
        trainer=trainer,
        max_length=datamodule.max_length,
        max_new_tokens=cfg.cache.max_new_tokens,
        temperature=cfg.cache.temperature,
        seed=cfg.seed,
        batch_size=cfg.cache.batch_size,
        shard_size=cfg.cache.shard_size,
        trust_remote_code=bool(teacher.get("trust_remote_code", False)),
    )
    if trainer.is_global_zero:
        print(f"teacher completions: {path} (train with data.train_data={path})", flush=True)
    return load_rows(str(path), name="teacher completions")


@rank_zero_only
def print_report(report: CacheBuildReport) -> None:
    """Where the cache is, its rows, tokens and size, and this run's throughput."""
    manifest = report.manifest
    per_million = manifest["bytes_per_million_tokens"]
    if manifest_signal(manifest) == "hidden":
        head = manifest["head"]
        signal = f"hidden states: {manifest['hidden_dtype']} x {head['hidden_size']}  head: V={head['vocab_size']}"
    else:
        signal = f"k: {manifest['k']}"
    lines = [
        f"teacher cache: {report.path.resolve()}",
        f"rows: {manifest['num_rows']}  supervised tokens: {manifest['total_tokens']}  shards: "
        f"{manifest['num_shards']}  {signal}",
        f"size: {manifest['total_bytes'] / 1e6:.2f} MB  "
        f"({'n/a' if per_million is None else f'{per_million / 1e6:.1f}'} MB per million tokens)",
    ]
    if report.built_shards:
        lines.append(
            f"built this run: {report.built_shards} shards, {report.built_tokens} tokens in {report.seconds:.1f}s "
            f"({report.tokens_per_second:.0f} tokens/s)"
        )
    else:
        lines.append("built this run: nothing (the cache was complete)")
    print("\n".join(["== lightning_gkd teacher cache ==", *lines]), flush=True)


@hydra.main(version_base="1.3", config_path="pkg://lightning_gkd.conf", config_name="cache_teacher")
def main(cfg: DictConfig) -> None:
    put_launch_folder_on_path()  # before anything is instantiated from the config
    run_reporting_errors(lambda: run(cfg), multirun=in_multirun())


if __name__ == "__main__":
    main()
