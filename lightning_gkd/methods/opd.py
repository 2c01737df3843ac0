"""OPDModule: on-policy distillation as a policy gradient (the teacher's log-prob of each sampled token is the
reward); the loss is ``lightning_gkd.losses.opd`` on top of ``lightning_gkd.ops.divergence.opd``."""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from lightning_gkd.asynchronous import AsyncSettings
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.settings import ValidationSettings
from lightning_gkd.losses.base import DistillationLoss, LossOutput
from lightning_gkd.losses.cross_tokenizer_plan import CrossTokenizerSettings, plan_cross_tokenizer
from lightning_gkd.losses.plan import check_teacher_settings, policy_gradient_loss, refuse_unread_settings
from lightning_gkd.losses.settings import DivergenceSettings, PolicyGradientSettings
from lightning_gkd.methods.base import Group, settings_group
from lightning_gkd.methods.on_policy import ENGINE_ARGUMENTS, OnPolicyModule
from lightning_gkd.models.loading import ModelSource
from lightning_gkd.ops.hf.forward import resolve_eos_token_id
from lightning_gkd.rollouts import RolloutSettings, RolloutStats
from lightning_gkd.samplers import SamplingSettings
from lightning_gkd.teachers import CacheTeacher
from lightning_gkd.teachers.spec import TeacherSource, teacher_plan
from lightning_gkd.training.settings import TrainingSettings


class OPDModule(OnPolicyModule):
    r"""On-policy distillation as a policy gradient (OPD): on the student's own samples ``x_t`` the reward of each
    token is ``r_t = log p_T(x_t) − log p_S(x_t)``, its advantage the ``gamma``-discounted sum of the rewards from
    ``t`` to the row's end, and the loss the surrogate ``−mean_t(w_t · A_t · log p_S(x_t))`` with truncated
    importance weights ``w_t = min(p_S(x_t) / p_sampler(x_t), max_is_weight)`` (``losses.opd``, ``ops.opd``). With
    ``gamma = 0`` and fresh samples its gradient is the sampled reverse-KL (k1) gradient, in expectation exactly
    ``∇ KL(S‖T)``. The rewards are mostly negative, so with ``gamma > 0`` the raw return favours short samples;
    ``length_normalize`` and ``baseline="row"`` counter that, ``clip_ratio`` the drift of stale samples (all off by
    default; ``ops.opd.token_advantages``, ``policy_gradient_distillation_loss``). ``kl_coef > 0`` adds ``kl_coef``
    times the full-distribution generalized JSD (``beta``; default 1 = reverse KL) on the same positions: the
    teacher's whole distribution for an in-process teacher, its top-k with a tail bucket (``sparse_loss``: ``topk``
    or ``topk_renorm``) for a served one.

    A sibling of ``GKDModule`` on the same on-policy base (``OnPolicyModule``: samplers ``hf``/``vllm``, teachers
    ``local``/``server``/``multi``, grouped generation with ``steps_per_generation``, checkpointed groups, DDP),
    with its own training loss and knobs. Every training batch is the student's samples, drawn at ``temperature``
    (default 1: then ``w_t = p_S / p_sampler`` compares the same distribution, and is 1 on samples from the current
    weights). The sampler log-prob of each token is the batch's ``sampled_logprobs`` (every shipped sampler writes
    them); ``importance_weights=False``, or a batch without them, uses ``w = 1``. Samples become stale under grouped
    generation (``ChatDataModule(steps_per_generation=k)``: the later micro-batches of a group were sampled before
    the group's earlier optimizer steps) and with ``sampler=vllm`` synced every few steps; the weights correct that.

    The teacher's log-prob of each sampled token comes from an in-process teacher's final hidden states and head
    (no full logits), or from a sparse teacher's ``TopKSignal.next_logprobs`` (``teacher=server``). A top-k cache
    (``teacher=cache``) holds log-probs of the dataset completions only and cannot score new samples: refused, as is
    a teacher with another tokenizer (the reward needs ``log p_T`` of the student's own tokens). Under
    ``teacher=multi`` each teacher scores its own rows and the loss is the token mean over all of them. The OPD loss
    needs the student's final hidden states and a head the lean path describes; another model raises naming it.

    Two loss objects, both built once: ``self.loss`` (the surrogate, ``training_loss``) and ``self.validation_loss``
    (``completion_loss``): validation batches are the dataset completions, not samples, so they are scored with
    GKD's loss there, the generalized JSD (``beta``, ``loss_temperature``; ``sparse_loss`` for a sparse teacher), and
    ``val/loss`` stays comparable with GKD runs. Logged per training step: ``train/opd/reward`` (mean ``r``),
    ``train/opd/kl`` (``−reward``, the sampled estimate of KL(S‖T)), ``train/opd/is_weight_mean``,
    ``train/opd/is_weight_max``, ``train/opd/is_truncated_fraction``, ``train/opd/advantage_mean`` and
    ``train/opd/advantage_abs_mean`` (the advantage ``A`` the gradient uses, after ``length_normalize`` and
    ``baseline``), ``train/opd/eos_rate`` (rows whose sample ended with an EOS within ``max_new_tokens``),
    ``train/opd/divergence`` (the full-distribution term, with ``kl_coef > 0``), ``train/opd/clipped_fraction``
    (tokens whose gradient ``clip_ratio`` removed, when set), and ``train/loss``, ``train/completion_length``.

    Args (the groups ``sampling``, ``divergence``, ``rollout``, ``training`` and ``validation`` are ``GKDModule``'s;
    each takes the settings, a mapping of overrides applied onto OPD's defaults, or None for those):
        policy_gradient: ``PolicyGradientSettings``: ``gamma`` (discount of later rewards in [0, 1]: 0 = per-token
            reward, 1 = the whole remaining return), ``max_is_weight`` (truncation, > 0, of the importance weights),
            ``length_normalize`` (divide each return by its discounted number of terms, MiniLLM: with ``gamma = 1``
            the mean of the remaining rewards, so a long sample is not penalised for its length), ``baseline``
            (``"row"``: subtract from each advantage its row's mean advantage, a variance reducer from the row's own
            tokens, slightly biased; ``"none"``), ``clip_ratio`` (PPO's ``ε`` in (0, 1) for stale samples: no
            gradient for a token whose ratio ``p_S / p_sampler`` is already past ``1 ± ε`` in its advantage's
            direction; None: no clipping; needs ``importance_weights``), ``kl_coef`` (weight, >= 0, of the added
            full-distribution term), ``importance_weights`` (weight by ``p_S / p_sampler`` from the batch's
            ``sampled_logprobs``).
        divergence: the generalized JSD of the ``kl_coef`` term and of the validation loss (OPD's default ``beta`` is
            1 = reverse KL; ``loss_temperature``: their softmax temperature, the reward uses 1).
        sampling: OPD's default ``temperature`` is 1.0.
    """

    cross_tokenizer_supported = False  # the reward needs log p_T of the student's own tokens
    default_sampling: ClassVar[SamplingSettings] = SamplingSettings(temperature=1.0)
    default_divergence: ClassVar[DivergenceSettings] = DivergenceSettings(beta=1.0)
    default_policy_gradient: ClassVar[PolicyGradientSettings] = PolicyGradientSettings()

    def __init__(
        self,
        student: ModelSource,
        teacher: TeacherSource,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        policy_gradient: Group[PolicyGradientSettings] = None,
        sampling: Group[SamplingSettings] = None,
        divergence: Group[DivergenceSettings] = None,
        rollout: Group[RolloutSettings] = None,
        asynchronous: Group[AsyncSettings] = None,
        training: Group[TrainingSettings] = None,
        validation: Group[ValidationSettings] = None,
    ) -> None:
        policy_gradient = settings_group(policy_gradient, self.default_policy_gradient, "policy_gradient")
        rollout = settings_group(rollout, self.default_rollout, "rollout")
        if rollout.split_turns and (problem := _whole_transcript_settings(policy_gradient)):
            raise ValueError(
                f"OPD with {problem} sums or averages over each row's tokens, and rollout.split_turns makes every "
                "turn its own row: the returns would stop at each turn. Set rollout.split_turns=false, or use "
                "policy_gradient.gamma=0 with baseline=none and length_normalize=false (per-token rewards)."
            )
        divergence = settings_group(divergence, self.default_divergence, "divergence")
        if divergence.sparse_loss in ("k1", "k3"):
            raise ValueError(
                f"divergence.sparse_loss={divergence.sparse_loss}: OPD's loss already is a sampled-token estimator; "
                "sparse_loss picks the full-distribution term (kl_coef) and the validation loss: set "
                "divergence.sparse_loss=topk or topk_renorm."
            )
        plan = teacher_plan(teacher)
        if any(entry.kind == "cache" or isinstance(entry.built, CacheTeacher) for entry in plan.entries.values()):
            raise ValueError(
                "teacher.kind=cache holds the teacher's signal for the dataset completions only, and OPD scores "
                "the student's new samples: use teacher=local (in process) or teacher=server (a vLLM server)."
            )
        check_teacher_settings(plan, divergence, lmbda=1.0, seq_kd=False)
        refuse_unread_settings(plan, divergence, owner=type(self).__name__)
        tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        # a teacher with another tokenizer is refused (OPD has no cross-tokenizer path)
        plan_cross_tokenizer(
            plan,
            tokenizer,
            None,
            CrossTokenizerSettings(),
            owner=type(self),
            seq_kd=False,
            sparse_loss=divergence.sparse_loss,
        )
        super().__init__(
            student,
            plan,
            tokenizer,
            lmbda=1.0,
            seq_kd=False,
            sampling=sampling,
            divergence=divergence,
            rollout=rollout,
            asynchronous=asynchronous,
            training=training,
            validation=validation,
        )
        #: The policy gradient's settings (``PolicyGradientSettings``).
        self.policy_gradient = policy_gradient
        #: The policy-gradient loss a training step takes (``lightning_gkd.losses.opd``).
        self.loss: DistillationLoss = policy_gradient_loss(
            self.teacher_sources,
            self.teacher_column,
            policy_gradient,
            self.divergence,
            eos_token_id=resolve_eos_token_id(self.student, self.tokenizer),
        )
        #: Validation's loss on the dataset completions: GKD's generalized JSD against the same teachers.
        self.validation_loss = self.divergence_loss()
        self.save_settings("student", "teacher", "tokenizer", *ENGINE_ARGUMENTS)

    def settings_groups(self) -> dict[str, Any]:
        return {**super().settings_groups(), "policy_gradient": self.policy_gradient}

    def loss_objects(self) -> list[DistillationLoss]:
        return [self.loss, self.validation_loss]

    def on_fit_start(self) -> None:
        super().on_fit_start()
        sampling_engine = self.rollout_engine or self.sampler  # the student's samples come from the producer's engine
        if self.policy_gradient.importance_weights and (problem := sampling_engine.sampled_logprobs_problem()):
            raise ValueError(
                f"OPD's importance weights p_S / p_sampler need each sampled token's log-prob under the distribution "
                f"it was sampled from, but {problem}. Restart the server with --logprobs-mode processed_logprobs, "
                "or sample at temperature 1 without top_k / top_p, or train without the weights: "
                "policy_gradient.importance_weights=False (Hydra: method.policy_gradient.importance_weights=false)."
            )

    def check_rollout_rows(self, stats: RolloutStats) -> None:
        """ValueError when the chat template split transcripts into several rows (``stats.segments``) and the
        policy gradient reads whole rows (``gamma > 0``, ``baseline="row"``, ``length_normalize``)."""
        split = sum(segments > 1 for segments in stats.segments)
        if split and (problem := _whole_transcript_settings(self.policy_gradient)):
            raise ValueError(
                f"The chat template rewrites earlier turns, so the rollout split {split} transcripts into several rows "
                f"(each turn in the context it was written in), and OPD with {problem} sums or averages over each "
                "row's tokens: the returns would stop where the template rewrote. Use policy_gradient.gamma=0 with "
                "baseline=none and length_normalize=false (per-token rewards, exact over any split), or a template "
                "that keeps earlier turns as they were."
            )

    def training_loss(self, batch: dict[str, Any]) -> LossOutput:
        """The OPD loss on a batch of the student's samples (the class docstring), with ``opd/*`` logs."""
        return self.loss(self.student, batch)

    def completion_loss(self, batch: dict[str, Any]) -> LossOutput:
        """Validation's loss on the dataset completions: GKD's generalized JSD (``beta``) against the teacher."""
        return self.validation_loss(self.student, batch)


def _whole_transcript_settings(settings: PolicyGradientSettings) -> str | None:
    """The policy-gradient settings that read a row's tokens together (named for an error), or None."""
    named = [
        f"policy_gradient.gamma={settings.gamma}" if settings.gamma > 0 else "",
        "policy_gradient.baseline=row" if settings.baseline == "row" else "",
        "policy_gradient.length_normalize=true" if settings.length_normalize else "",
    ]
    return ", ".join(name for name in named if name) or None
