"""The probe scripts/bench.py adds to the ``lightning-gkd`` command (``ours_cli``) with a Hydra override: a Lightning
callback appending to a .jsonl file the peak RSS when training starts, then each optimizer step's end (wall clock)."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import lightning as L


class StepEndsFile(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.path.write_text(json.dumps({"baseline_rss_mb": peak_mb}) + "\n")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"end": time.time()}) + "\n")
