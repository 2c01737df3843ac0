"""LengthGuard: compare the student's greedy completion lengths and EOS rate with its teacher's at each validation,
and warn (or stop) when the student's answers collapse.

On-policy distillation with reverse KL (GKD with β = 1) or OPD with γ > 0 can teach the student to answer in one or
two tokens, or never to stop: the per-token rewards are mostly negative, so short samples score best. The loss may
look fine while accuracy falls below where the student started. The lengths show it first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_gkd.evaluation.metrics import CompletionLengths, greedy_completions
from lightning_gkd.methods.on_policy import OnPolicyModule
from lightning_gkd.ops.hf.forward import resolve_eos_token_id
from lightning_gkd.training.checkpoint_io import inside_accumulation_window, resume_checkpoint_path

#: Where the option of each threshold lives in ``lightning-gkd``'s config.
_OPTION = "callbacks.length_guard"


class LengthGuard(L.Callback):
    """At each validation of a fit (not the sanity check), measure the greedy completions of the validation prompts
    (all validation sets together) at the method's ``validation.max_new_tokens``: the student's, and the teacher's on
    the same prompts once per fit (the teacher is frozen: measured at the first validation, reused after). Logged:

    - ``val/length/student``, ``val/length/teacher``: mean completion tokens per prompt, EOS included;
    - ``val/eos_rate/student``, ``val/eos_rate/teacher``: the share of prompts whose completion emitted an EOS
      within the budget;
    - ``val/length_ratio``: student / teacher mean length.

    Under DDP the token, row and EOS counts are summed over the ranks before dividing. The student's completions are
    the ones validation's generation metrics already score (``CausalLMModule.collect_generations``; made for the
    guard when no metric is configured), so the guard costs one teacher decode per fit on top.

    When ``val/length_ratio < min_length_ratio`` (the student's answers got short) or the teacher's EOS rate minus
    the student's exceeds ``max_eos_drop`` (the student stops answering), it warns once per validation with the
    figures. With ``stop=True`` it then saves ``last.ckpt`` in the checkpoint folder (``ckpt_path=last`` resumes
    there; nothing is saved inside a gradient-accumulation window) and stops the fit (``trainer.should_stop``).
    ``min_length_ratio=0`` turns the length check off, ``max_eos_drop=1`` the EOS check.

    For on-policy modules (``GKDModule``, ``OPDModule``) without multi-turn rollouts; it does nothing for others
    (``SFTModule``, ``DPOModule``). A teacher that cannot complete prompts in process (a server, a cache, a ``multi``
    routing, a teacher with another tokenizer) is skipped, once said in the log: then only the student's figures are
    logged and nothing is checked.
    """

    def __init__(self, min_length_ratio: float = 0.5, max_eos_drop: float = 0.25, stop: bool = False) -> None:
        if not min_length_ratio >= 0:
            raise ValueError(
                f"LengthGuard min_length_ratio must be >= 0 (the lowest student/teacher mean completion length "
                f"allowed; 0 turns the check off), got {min_length_ratio} ({_OPTION}.min_length_ratio)."
            )
        if not 0 <= max_eos_drop <= 1:
            raise ValueError(
                f"LengthGuard max_eos_drop must be in [0, 1] (the largest teacher-minus-student EOS rate allowed; 1 "
                f"turns the check off), got {max_eos_drop} ({_OPTION}.max_eos_drop)."
            )
        self.min_length_ratio, self.max_eos_drop, self.stop = min_length_ratio, max_eos_drop, stop
        #: The latest validation's figures (the logged values, by name).
        self.figures: dict[str, float] = {}
        #: The warnings given so far in this fit, each ``{"step", "message"}``.
        self.alerts: list[dict[str, Any]] = []
        #: Why the guard stopped the fit (None: it did not), and the checkpoint it saved then.
        self.stop_reason: str | None = None
        self.saved_path: Path | None = None
        self._active = False
        self._teacher: torch.nn.Module | None = None
        self._teacher_lengths: CompletionLengths | None = None  # over every rank, once measured
        self._measuring_teacher: CompletionLengths | None = None  # during the first validation
        self._stop_pending = False

    # -- which runs it measures -------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.figures, self.alerts, self.stop_reason, self.saved_path = {}, [], None, None
        self._teacher_lengths = self._measuring_teacher = None
        self._stop_pending = False
        self._active = isinstance(pl_module, OnPolicyModule)
        if not isinstance(pl_module, OnPolicyModule):
            return  # no teacher to compare with (SFT, DPO)
        if pl_module.rollout is not None:
            self._active = False
            rank_zero_info(
                "LengthGuard: multi-turn rollouts (tools or an environment) are not measured; the length guard is "
                "off for this run."
            )
            return
        self._teacher = pl_module.completing_teacher()
        if self._teacher is None:
            rank_zero_info(
                "LengthGuard: the teacher cannot complete prompts in this process (a server, a cache, teacher=multi "
                "or a teacher with another tokenizer): only the student's val/length/student and "
                "val/eos_rate/student are logged, and the length guard checks nothing."
            )

    def _measuring(self, trainer: L.Trainer) -> bool:
        return self._active and not trainer.sanity_checking and trainer.state.fn == "fit"

    # -- measuring --------------------------------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._measuring(trainer):
            return
        cast(OnPolicyModule, pl_module).completion_lengths = CompletionLengths()
        if self._teacher is not None and self._teacher_lengths is None:
            self._measuring_teacher = CompletionLengths()

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._measuring_teacher is None or self._teacher is None:
            return
        module: Any = pl_module
        eos = resolve_eos_token_id(self._teacher, module.tokenizer)
        completions = greedy_completions(
            self._teacher, module.tokenizer, batch, max_new_tokens=module.validation.max_new_tokens, eos_token_id=eos
        )
        self._measuring_teacher.add(completions, eos)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        module: Any = pl_module
        student = getattr(module, "completion_lengths", None)
        if not self._measuring(trainer) or student is None:
            return
        module.completion_lengths = None

        def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            return trainer.strategy.reduce(tensor, reduce_op="sum")

        student = student.reduced(reduce_sum, pl_module.device)
        if self._measuring_teacher is not None:
            self._teacher_lengths = self._measuring_teacher.reduced(reduce_sum, pl_module.device)
            self._measuring_teacher = None
        if not student.rows:
            return
        self.figures = {"val/length/student": student.mean_length, "val/eos_rate/student": student.eos_rate}
        teacher = self._teacher_lengths
        if teacher is not None and teacher.rows:
            self.figures.update(
                {
                    "val/length/teacher": teacher.mean_length,
                    "val/eos_rate/teacher": teacher.eos_rate,
                    "val/length_ratio": student.mean_length / teacher.mean_length,
                }
            )
        for name, value in self.figures.items():  # the same value on every rank: their mean is that value
            pl_module.log(name, value, add_dataloader_idx=False, sync_dist=True)
        if "val/length_ratio" in self.figures:
            self._check(trainer.global_step, module.validation.max_new_tokens)

    # -- checking ---------------------------------------------------------------------------------------------------
    def _check(self, step: int, budget: int) -> None:
        figures = self.figures
        ratio = figures["val/length_ratio"]
        drop = figures["val/eos_rate/teacher"] - figures["val/eos_rate/student"]
        breaches = []
        if ratio < self.min_length_ratio:
            breaches.append(
                f"length ratio {ratio:.2f} < min_length_ratio={self.min_length_ratio:g} (the student's answers got "
                "short)"
            )
        if drop > self.max_eos_drop:
            breaches.append(
                f"EOS rate drop {drop:.2f} > max_eos_drop={self.max_eos_drop:g} (the student stops answering less "
                "often than its teacher)"
            )
        if not breaches:
            return
        message = (
            f"LengthGuard at step {step}: the student's greedy completions of the validation prompts average "
            f"{figures['val/length/student']:.2f} tokens with EOS rate {figures['val/eos_rate/student']:.2f}, the "
            f"teacher's {figures['val/length/teacher']:.2f} tokens with EOS rate "
            f"{figures['val/eos_rate/teacher']:.2f} (validation.max_new_tokens={budget}): {'; '.join(breaches)}. The "
            "student's completions are collapsing: lower optimizer.lr, or the divergence's pull toward short "
            "answers (GKD: method.divergence.beta below 1; OPD: method.policy_gradient.gamma=0 and "
            "method.policy_gradient.kl_coef=1.0). Thresholds: "
            f"{_OPTION}.min_length_ratio, {_OPTION}.max_eos_drop; "
            + ("stopping the run (stop=true)." if self.stop else f"{_OPTION}.stop=true stops the run here.")
        )
        self.alerts.append({"step": step, "message": message})
        rank_zero_warn(message)
        if self.stop:
            self._stop_pending = True
            self.stop_reason = "; ".join(breaches)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # saved here, as ModelCheckpoint saves after a validation: a resume does not repeat this validation
        if not self._stop_pending:
            return
        self._stop_pending = False
        trainer.should_stop = True
        path = resume_checkpoint_path(trainer)
        if inside_accumulation_window(trainer):
            rank_zero_warn(
                f"LengthGuard stopped the run after step {trainer.global_step}, inside a gradient-accumulation "
                f"window (accumulate_grad_batches={trainer.accumulate_grad_batches}): no checkpoint saved now; the "
                f"last regular one is in {path.parent}."
            )
            return
        trainer.save_checkpoint(path, weights_only=False)  # the full state: resumable
        self.saved_path = path
        rank_zero_warn(
            f"LengthGuard stopped the run after step {trainer.global_step} and saved {path}. Change the options "
            f"named above, then resume with ckpt_path={path}, or start again."
        )

    def run_summary(self) -> dict[str, Any]:
        """What ``lightning-gkd``'s summary reports when the guard stopped the run: why, and where to resume."""
        if self.stop_reason is None:
            return {}
        return {"length_guard_stop": self.stop_reason, "resume_from": str(self.saved_path) if self.saved_path else None}
