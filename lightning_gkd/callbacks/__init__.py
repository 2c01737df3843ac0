"""Lightning callbacks, one file each; add them from Hydra with ``callbacks=[default,<name>]``.

- ``StepProgressBar`` (in ``default``): a bar in optimizer steps on a terminal, ``PrintMetricsCallback``'s lines
  elsewhere (``print_metrics``: on a terminal too).
- ``PrintMetricsCallback``: progress and the logged metrics as plain lines.
- ``LearningRateLogger`` (in ``default``): ``train/lr``, at the logged steps.
- ``SignalCheckpoint`` (in ``default``): on SIGTERM/SIGUSR1 or a first Ctrl-C, finish the step, save, stop cleanly
  (a second Ctrl-C aborts at once).
- ``BestModel`` (in ``default``): the best checkpoint by a validation metric, loaded at the end when asked; a
  warning (or a stop) when the metric stays below the student's start.
- ``HeldOutEvaluation`` (in ``default``): greedy held-out scores of the teacher and the student before/after.
- ``SampleTable`` (in ``default``): greedy samples and teacher agreement every few steps.
- ``LengthGuard`` (in ``default``): the student's greedy completion lengths and EOS rate against the teacher's at
  each validation (on-policy methods); warns, or stops, when they collapse.
- ``LastStepValidation`` (in ``default``): validate at ``max_steps`` too, when the interval does not fall on it.
- ``HFExportCallback`` (hf_export): a Hugging Face export beside each checkpoint.
- ``StudyRecord`` (conf/experiment/study_*.yaml): a study run's curve, compute and completions, for its tables.
"""

from lightning_gkd.callbacks.best_model import BestModel
from lightning_gkd.callbacks.held_out_eval import HeldOutEvaluation
from lightning_gkd.callbacks.hf_export import HFExportCallback
from lightning_gkd.callbacks.last_step_validation import LastStepValidation
from lightning_gkd.callbacks.learning_rate import LearningRateLogger
from lightning_gkd.callbacks.length_guard import LengthGuard
from lightning_gkd.callbacks.print_metrics import PrintMetricsCallback
from lightning_gkd.callbacks.sample_table import SampleTable
from lightning_gkd.callbacks.signal_checkpoint import SignalCheckpoint
from lightning_gkd.callbacks.step_progress import StepProgressBar
from lightning_gkd.callbacks.study_record import StudyRecord

__all__ = [
    "BestModel",
    "HFExportCallback",
    "HeldOutEvaluation",
    "LastStepValidation",
    "LearningRateLogger",
    "LengthGuard",
    "PrintMetricsCallback",
    "SampleTable",
    "SignalCheckpoint",
    "StepProgressBar",
    "StudyRecord",
]
