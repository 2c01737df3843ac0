"""lightning_gkd.losses.plan: which loss object a teacher plan gets (one per teacher signal, routed under multi),
and the settings the chosen losses would not read, refused by name before any model loads."""

import pytest
import torch

from lightning_gkd import GKDModule, OPDModule
from lightning_gkd.losses import LeanPath
from lightning_gkd.losses.dense import DenseDistillation
from lightning_gkd.losses.opd import DensePolicyGradient, TopKPolicyGradient
from lightning_gkd.losses.plan import divergence_loss, policy_gradient_loss
from lightning_gkd.losses.routed import RoutedDistillation
from lightning_gkd.losses.settings import DivergenceSettings, PolicyGradientSettings
from lightning_gkd.losses.sparse import SampledDistillation, TopKDistillation
from lightning_gkd.teachers import LocalTeacher

SERVER = {"kind": "server", "url": "http://127.0.0.1:9"}


def test_one_loss_class_per_teacher_signal_and_a_router_over_several(teacher):
    sources = {"dense": LocalTeacher(teacher), "sparse": LocalTeacher(teacher, top_k=4)}
    lean = LeanPath()

    def divergence(sparse_loss: str) -> DivergenceSettings:
        return DivergenceSettings(beta=1.0 if sparse_loss == "k3" else 0.5, sparse_loss=sparse_loss, loss_chunk_size=8)

    for sparse_loss, expected in (
        ("topk", TopKDistillation),
        ("topk_renorm", TopKDistillation),
        ("k3", SampledDistillation),
    ):
        routed = divergence_loss(sources, "teacher", divergence(sparse_loss), lean=lean)
        assert isinstance(routed, RoutedDistillation) and routed.column == "teacher"
        assert isinstance(routed.losses["dense"], DenseDistillation) and isinstance(routed.losses["sparse"], expected)
        assert routed.losses["dense"].lean is lean  # the run's one fallback policy
    assert routed.losses["sparse"].estimator == "k3"
    assert divergence_loss(sources, "t", divergence("topk_renorm"), lean=lean).losses["sparse"].tail is False
    single = divergence_loss({"": LocalTeacher(teacher)}, None, divergence("topk"), lean=lean)
    assert isinstance(single, DenseDistillation)
    opd = policy_gradient_loss(
        sources, "teacher", PolicyGradientSettings(kl_coef=0.1), divergence("topk_renorm"), eos_token_id=None
    )
    assert isinstance(opd.losses["dense"], DensePolicyGradient) and isinstance(opd.losses["sparse"], TopKPolicyGradient)
    sparse = opd.losses["sparse"]
    assert sparse.divergence.sparse_loss == "topk_renorm" and sparse.policy_gradient.kl_coef == 0.1  # no tail bucket


@pytest.mark.parametrize(
    "teacher, kwargs, match",
    [
        (
            "x",
            {"cross_tokenizer": {"crossentropy_weight": 0.5}},
            r"cross_tokenizer\.crossentropy_weight=0\.5: read only by the cross-tokenizer loss",
        ),
        (
            "x",
            {"cross_tokenizer": {"distillation_weight": 2.0}},
            r"cross_tokenizer\.distillation_weight=2\.0: read only by the cross-tokenizer loss",
        ),
        (
            "x",
            {"cross_tokenizer": {"enabled": "auto", "loss": "hybrid", "beta": None}},
            r"cross_tokenizer\.loss='hybrid': read only by the cross-tokenizer loss.* cross_tokenizer\.enabled=always",
        ),
        (
            "x",
            {"cross_tokenizer": {"enabled": "never", "skip_student_eos": True, "crossentropy_weight": 0.1}},
            r"cross_tokenizer\.skip_student_eos=True, cross_tokenizer\.crossentropy_weight=0\.1: read only .* "
            r"Drop them",
        ),
        (
            "x",
            {"divergence": {"sparse_loss": "topk_renorm"}},
            r"GKDModule\(divergence\.sparse_loss='topk_renorm'\): sparse_loss is read only",
        ),
        (
            SERVER,
            {"divergence": {"lean_loss": False}, "lmbda": 0.0},
            r"GKDModule\(divergence\.lean_loss=False\): .* only sparse teachers",
        ),
    ],
)
def test_gkd_refuses_a_setting_its_loss_would_not_read_before_models_load(tokenizer, teacher, kwargs, match):
    # "x" is no model: an error about it would mean loading was attempted first
    with pytest.raises(ValueError, match=match):
        GKDModule("x", teacher, tokenizer, **kwargs)


@pytest.mark.parametrize(
    "teacher, kwargs, match",
    [
        (
            "x",
            {"divergence": {"sparse_loss": "topk_renorm"}},
            r"OPDModule\(divergence\.sparse_loss='topk_renorm'\): sparse_loss is read only",
        ),
        (SERVER, {"divergence": {"lean_loss": False}}, r"OPDModule\(divergence\.lean_loss=False\)"),
        (
            SERVER,
            {"divergence": {"loss_temperature": 2.0}},
            r"loss_temperature=2\.0: a top-k teacher signal carries log-probs at",
        ),
    ],
)
def test_opd_refuses_a_setting_its_losses_would_not_read_before_models_load(tokenizer, teacher, kwargs, match):
    with pytest.raises(ValueError, match=match):
        OPDModule("x", teacher, tokenizer, **kwargs)


def test_the_defaults_and_the_settings_a_path_reads_are_accepted(student, teacher, tokenizer):
    module = GKDModule(student, teacher, tokenizer, cross_tokenizer={"enabled": "auto", "loss": "projected"})
    assert isinstance(module.loss, DenseDistillation) and module.loss.lean is module.lean_path
    sparse = GKDModule(
        student, {"kind": "local", "model": teacher, "top_k": 3}, tokenizer, divergence={"sparse_loss": "topk_renorm"}
    )
    assert isinstance(sparse.loss, TopKDistillation) and sparse.loss.tail is False
    full = GKDModule(student, teacher, tokenizer, divergence={"lean_loss": False})  # dense: lean_loss is read
    assert full.lean_path.enabled is False
    assert torch.equal(full.loss.teacher.model.lm_head.weight, teacher.lm_head.weight)
