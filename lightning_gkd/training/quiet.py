"""Silence the messages a run causes and expects, each by its exact text, and nothing else.

``quiet_run()`` wraps a CLI run; ``frozen_eval_message(module)`` is the one warning a method's own frozen models
cause (a module's ``on_fit_start`` can ignore it too, for plain-Lightning users).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

# Each warning by (message regex, category); a regex matches from the start of the message.
EXPECTED_WARNINGS = (
    # torch 2.13 deprecated a class Lightning 2.6's utilities/_pytree.py still uses: nothing a user can do.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # An epoch shorter than log_every_n_steps (a small data set): metrics are still logged every
    # log_every_n_steps optimizer steps, counted across epochs, so the advice does not apply to a step-based run.
    (r"The number of training batches \(\d+\) is smaller than the logging interval", Warning),
)
# Log records by (logger name, message start).
EXPECTED_LOG_RECORDS = (
    # Lightning's advertisements, once per fit ("💡 Tip: For seamless cloud logging ... try installing ...").
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip:"),
    ("lightning.fabric.utilities.rank_zero", "💡 Tip:"),
    # logger=mlflow: a run folder's own mlruns/ never has the experiment yet ("... not found. Creating it.").
    ("lightning.pytorch.loggers.mlflow", "Experiment with name "),
)


#: Of the above, what is noise in any process that uses the methods (a plain ``L.Trainer`` included): dropped for
#: good once ``lightning_gkd.methods`` is imported (``silence_known_noise``).
_ALWAYS_SILENCED = (EXPECTED_WARNINGS[0], EXPECTED_LOG_RECORDS[0], EXPECTED_LOG_RECORDS[1])
_silenced = False


def silence_known_noise() -> None:
    """Drop, for the rest of the process, Lightning's advertisement ("💡 Tip: ... try installing litlogger", once
    per Trainer) and torch's deprecation warning about a class Lightning's ``_pytree`` uses (once per fit): a user
    can do nothing about either. Everything else Lightning prints stays. Idempotent."""
    global _silenced
    if _silenced:
        return
    (message, category), *records = _ALWAYS_SILENCED
    warnings.filterwarnings("ignore", message=message, category=category)
    for name, start in records:
        logging.getLogger(name).addFilter(_DropStarting(start))
    _silenced = True


def frozen_eval_message(module: Any) -> str | None:
    """The regex of Lightning's "Found N module(s) in eval mode at the start of training" when N is exactly the
    number of submodules of ``module``'s frozen models (``module.frozen_models()``: a teacher, a reference),
    which are in eval mode on purpose; None when it has none."""
    frozen = getattr(module, "frozen_models", None)
    names = list(frozen()) if callable(frozen) else []
    if not names:
        return None
    count = sum(1 for name, _ in module.named_modules() if any(name == f or name.startswith(f + ".") for f in names))
    return rf"Found {count} module\(s\) in eval mode at the start of training"


class _DropStarting(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


@contextmanager
def quiet_run(module: Any = None, live_terminal: bool | None = None) -> Iterator[None]:
    """Within: the expected warnings and log records above are dropped (and ``module``'s frozen-models warning),
    datasets' progress bars ("Generating train split") are off, and, where stderr is no terminal
    (``live_terminal`` overrides the check), so are transformers' and the hub's ("Loading weights", "Writing
    model shards", downloads). A bar whose ``HF_*_DISABLE_PROGRESS_BARS`` variable is set is left as that says.
    Everything is restored on exit."""
    if live_terminal is None:
        live_terminal = sys.stderr.isatty()
    filters = [(logging.getLogger(name), _DropStarting(start)) for name, start in EXPECTED_LOG_RECORDS]
    with warnings.catch_warnings(), _bars_off(live_terminal):
        for message, category in EXPECTED_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        if module is not None:
            ignore_frozen_eval_warning(module)
        for logger, drop in filters:
            logger.addFilter(drop)
        try:
            yield
        finally:
            for logger, drop in filters:
                logger.removeFilter(drop)


def ignore_frozen_eval_warning(module: Any) -> None:
    """Ignore Lightning's eval-mode warning for exactly ``module``'s frozen models (see ``frozen_eval_message``)."""
    message = frozen_eval_message(module)
    if message is not None:
        warnings.filterwarnings("ignore", message=message, category=Warning)


@contextmanager
def _bars_off(live_terminal: bool) -> Iterator[None]:
    restore = []
    if "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ:
        import datasets

        if datasets.is_progress_bar_enabled():
            datasets.disable_progress_bars()
            restore.append(datasets.enable_progress_bars)
    if not live_terminal and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:
        from transformers.utils import logging as transformers_logging

        if transformers_logging.is_progress_bar_enabled():
            transformers_logging.disable_progress_bar()  # the hub's bars too
            restore.append(transformers_logging.enable_progress_bar)
    try:
        yield
    finally:
        for undo in restore:
            with suppress(Exception):
                undo()
