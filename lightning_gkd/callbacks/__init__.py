"""Lightning callbacks, one file each; add them from Hydra with ``callbacks=[default,<name>]``.

- ``PrintMetricsCallback`` (print_metrics): the logged metrics on the console.
- ``SignalCheckpoint`` (in ``default``): on SIGTERM/SIGUSR1, finish the step, save, stop cleanly.
- ``HeldOutEvaluation`` (in ``default``): greedy held-out scores of the teacher and the student before/after.
- ``SampleTable`` (in ``default``): greedy samples and teacher agreement every few steps.
- ``HFExportCallback`` (hf_export): a Hugging Face export beside each checkpoint.
"""

from lightning_gkd.callbacks.held_out_eval import HeldOutEvaluation
from lightning_gkd.callbacks.hf_export import HFExportCallback
from lightning_gkd.callbacks.print_metrics import PrintMetricsCallback
from lightning_gkd.callbacks.sample_table import SampleTable
from lightning_gkd.callbacks.signal_checkpoint import SignalCheckpoint

__all__ = [
    "HFExportCallback",
    "HeldOutEvaluation",
    "PrintMetricsCallback",
    "SampleTable",
    "SamplerShutdown",
    "SignalCheckpoint",
]
