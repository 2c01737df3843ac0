"""The loss settings of the on-policy methods: ``DivergenceSettings`` (GKD's loss, OPD's ``kl_coef`` term and
validation loss; Hydra ``method.divergence.*``) and ``PolicyGradientSettings`` (OPD's training loss;
``method.policy_gradient.*``). Each checks its ranges when made, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from lightning_gkd.ops.divergence.opd import Baseline, check_advantage_options

#: The loss against a sparse teacher: ``topk`` the generalized JSD (``beta``) of the coarse distributions over the
#: teacher's top-k and one bucket for the rest (exact KL of those; equals the full loss at k = V), ``topk_renorm``
#: both renormalised over the top-k (no rest bucket), ``k1``/``k3`` the sampled-token reverse-KL estimators on the
#: student's own samples (``lightning_gkd.ops.divergence.sparse_kd``).
SparseLoss = Literal["topk", "topk_renorm", "k1", "k3"]
SPARSE_LOSSES: tuple[str, ...] = get_args(SparseLoss)


def check_range(name: str, value: float, low: float, high: float, why: str = "") -> None:
    """ValueError ``<name> must be in [low, high], got <value>`` (then ``why``) unless ``low <= value <= high``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}{f' ({why})' if why else ''}.")


@dataclass(frozen=True)
class DivergenceSettings:
    """The generalized JSD between the student's and the teacher's next-token distributions, and how it is
    computed. The defaults are TRL's ``GKDConfig``'s (OPD's ``beta`` is 1.0: ``OPDModule.default_divergence``)."""

    #: 0 = forward KL(T‖S), 1 = reverse KL(S‖T), in between the generalized JSD.
    beta: float = 0.5
    #: Softmax temperature of both distributions inside the loss (> 0); TRL samples at 0.9 and scores at 1.
    loss_temperature: float = 1.0
    #: The loss against a sparse (top-k) teacher: ``topk``, ``topk_renorm``, ``k1`` or ``k3`` (``SparseLoss``).
    sparse_loss: SparseLoss = "topk"
    #: Compute it from final hidden states, projecting only the supervised positions to logits (no full
    #: ``B × T × V`` logits); models whose head the lean path cannot describe fall back to full logits.
    lean_loss: bool = True
    #: Positions projected to logits at a time on the lean path (>= 1).
    loss_chunk_size: int = 64

    def __post_init__(self) -> None:
        check_range("divergence.beta", self.beta, 0.0, 1.0, "0: forward KL, 1: reverse KL, between: the JSD")
        if isinstance(self.loss_temperature, bool) or not self.loss_temperature > 0:
            raise ValueError(
                f"divergence.loss_temperature must be > 0, got {self.loss_temperature!r} (1: the models' own "
                "distributions)."
            )
        if self.sparse_loss not in SPARSE_LOSSES:
            raise ValueError(
                f"divergence.sparse_loss must be one of {', '.join(SPARSE_LOSSES)}, got {self.sparse_loss!r}."
            )
        if not isinstance(self.lean_loss, bool):
            raise ValueError(f"divergence.lean_loss must be true or false, got {self.lean_loss!r}.")
        if (
            isinstance(self.loss_chunk_size, bool)
            or not isinstance(self.loss_chunk_size, int)
            or self.loss_chunk_size < 1
        ):
            raise ValueError(
                f"divergence.loss_chunk_size must be an integer >= 1, got {self.loss_chunk_size!r} (positions "
                "projected to logits at a time: memory against speed)."
            )


@dataclass(frozen=True)
class PolicyGradientSettings:
    """OPD's policy gradient (``OPDModule``; ``ops.divergence.opd.policy_gradient_distillation_loss``): the reward of
    a sampled token is ``log p_T − log p_S``, its advantage the ``gamma``-discounted sum of the rewards after it."""

    #: Discount of later rewards in [0, 1]: 0 = per-token reward, 1 = the whole remaining return.
    gamma: float = 0.0
    #: Truncation (> 0) of the importance weights ``p_S / p_sampler``.
    max_is_weight: float = 2.0
    #: Divide each return by its discounted number of terms (MiniLLM).
    length_normalize: bool = False
    #: ``"row"``: subtract from each advantage its row's mean advantage; ``"none"``.
    baseline: Baseline = "none"
    #: PPO's ``ε`` in (0, 1) for stale samples; None: no clipping. Needs ``importance_weights``.
    clip_ratio: float | None = None
    #: Weight (>= 0) of an added full-distribution generalized JSD (``DivergenceSettings``) on the same positions.
    kl_coef: float = 0.0
    #: Weight by ``p_S / p_sampler`` from the batch's ``sampled_logprobs`` (False: weight 1).
    importance_weights: bool = True

    def __post_init__(self) -> None:
        check_range("policy_gradient.gamma (the discount of later rewards)", self.gamma, 0.0, 1.0)
        if isinstance(self.max_is_weight, bool) or not self.max_is_weight > 0:
            raise ValueError(
                "policy_gradient.max_is_weight (the importance weights' truncation) must be > 0, got "
                f"{self.max_is_weight!r}."
            )
        check_advantage_options(
            length_normalize=self.length_normalize, baseline=self.baseline, clip_ratio=self.clip_ratio
        )
        if not isinstance(self.importance_weights, bool):
            raise ValueError(
                f"policy_gradient.importance_weights must be true or false, got {self.importance_weights!r}."
            )
        if self.clip_ratio is not None and not self.importance_weights:
            raise ValueError(
                f"clip_ratio={self.clip_ratio} clips the ratio p_S / p_sampler, which importance_weights=False fixes "
                "at 1 (nothing would be clipped): set policy_gradient.importance_weights=true, or "
                "policy_gradient.clip_ratio=null."
            )
        if isinstance(self.kl_coef, bool) or not self.kl_coef >= 0:
            raise ValueError(
                f"policy_gradient.kl_coef (the full-distribution term's weight) must be >= 0, got {self.kl_coef!r}."
            )
