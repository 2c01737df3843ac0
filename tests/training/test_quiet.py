"""quiet_run: the messages a run causes and expects are dropped by their exact text, other messages are not, and
everything is restored afterwards."""

from __future__ import annotations

import logging
import re
import warnings

import datasets
import pytest
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from transformers.utils import logging as transformers_logging

from lightning_gkd import GKDModule
from lightning_gkd.training.quiet import frozen_eval_message, quiet_run

PYTREE = (
    "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()` "
    "instead."
)
SMALL_EPOCH = (
    "The number of training batches (5) is smaller than the logging interval Trainer(log_every_n_steps=10). Set a "
    "lower value for log_every_n_steps if you want to see logs for the training epoch."
)


def lightning_eval_warning(count: int) -> str:  # fit_loop._warn_if_modules_in_eval_mode's text
    return (
        f"Found {count} module(s) in eval mode at the start of training. This may lead to unexpected behavior "
        "during training. If this is intentional, you can ignore this warning."
    )


def emitted(module=None) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_run(module, live_terminal=False):
            warnings.warn(PYTREE, FutureWarning, stacklevel=1)
            warnings.warn(SMALL_EPOCH, PossibleUserWarning, stacklevel=1)
            for count in (59, 60):
                warnings.warn(lightning_eval_warning(count), PossibleUserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
        warnings.warn(PYTREE, FutureWarning, stacklevel=1)  # after: shown again
    return [str(w.message) for w in caught]


def test_the_expected_warnings_go_and_the_others_stay(student, teacher, tokenizer):
    module = GKDModule(student, teacher, tokenizer)
    module.train()  # the teacher stays in eval mode
    in_eval = len([name for name, m in module.named_modules() if not m.training])  # what Lightning counts
    assert re.match(frozen_eval_message(module), lightning_eval_warning(in_eval))
    assert not re.match(frozen_eval_message(module), lightning_eval_warning(in_eval + 1))

    shown = emitted(module)
    assert PYTREE not in shown[:-1] and SMALL_EPOCH not in shown and shown[-1] == PYTREE
    assert "something else" in shown
    eval_warnings = [m for m in shown if "eval mode" in m]
    assert eval_warnings == [lightning_eval_warning(c) for c in (59, 60) if c != in_eval]
    assert lightning_eval_warning(59) in emitted()  # without a module nothing is expected in eval mode


def test_lightnings_tips_are_not_logged_and_other_info_is(monkeypatch):
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    mlflow_logger = logging.getLogger("lightning.pytorch.loggers.mlflow")
    for each in (logger, mlflow_logger):
        each.addHandler(handler)
        monkeypatch.setattr(each, "level", logging.INFO)
    try:
        with quiet_run(live_terminal=True):
            rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
            rank_zero_info("GPU available: False, used: False")
            mlflow_logger.warning("Experiment with name lightning-gkd not found. Creating it.")
            mlflow_logger.warning("something else")
        rank_zero_info("💡 Tip: after the run")  # dropped for good once the methods are imported
        mlflow_logger.warning("Experiment with name x not found. Creating it.")  # restored after the run
    finally:
        for each in (logger, mlflow_logger):
            each.removeHandler(handler)
    assert records == [
        "GPU available: False, used: False",
        "something else",
        "Experiment with name x not found. Creating it.",
    ]


@pytest.mark.parametrize("live_terminal", [False, True])
def test_progress_bars_off_within_and_back_after(live_terminal, monkeypatch):
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    datasets.enable_progress_bars()
    transformers_logging.enable_progress_bar()
    with quiet_run(live_terminal=live_terminal):
        assert not datasets.is_progress_bar_enabled()  # "Generating train split" is noise on a terminal too
        # "Loading weights" and downloads: kept on a terminal (a big model takes minutes), off in a log file
        assert transformers_logging.is_progress_bar_enabled() is live_terminal
    assert datasets.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()


PLAIN_TRAINER_SCRIPT = """
import lightning as L
from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

tokenizer = build_chatml_tokenizer()
for _ in range(2):  # two fits, two Trainers: the noise came once per Trainer and once per fit
    module = GKDModule(
        tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0), tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1), tokenizer,
        lmbda=0.0,
    )
    trainer = L.Trainer(max_steps=1, accelerator="cpu", enable_checkpointing=False, logger=False)
    trainer.fit(module, datamodule=ChatDataModule(tokenizer, addition_rows("train", 8), batch_size=4))
print("fitted")
"""


def test_the_python_api_with_a_plain_trainer_prints_no_known_noise(tmp_path):
    """The methods drop Lightning's litlogger tip and torch's _pytree deprecation for the whole process (a user's own
    Trainer included); Lightning's other messages stay."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", PLAIN_TRAINER_SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    printed = result.stdout + result.stderr
    assert result.returncode == 0 and "fitted" in result.stdout, printed[-3000:]
    assert "💡 Tip" not in printed and "LeafSpec" not in printed
    assert "GPU available: False" in printed
