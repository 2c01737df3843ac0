"""The AdamW factory: fused by default where torch has the kernel, the same updates as torch's for-loop AdamW, and
the default of the methods and of conf/optimizer/adamw.yaml."""

import copy
from functools import partial

import pytest
import torch
from helpers.hydra_compose import compose_train
from hydra.utils import instantiate

from lightning_gkd import GKDModule
from lightning_gkd.training import optimizers
from lightning_gkd.training.optimizers import adamw, fused_supported


def fused_flag(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.param_groups[0]["fused"])


def test_fused_and_for_loop_adamw_take_the_same_steps():
    """Five steps of a small regression net (a bias-free key projection's ~0 gradients would make Adam's sign
    noisy, so a language model is a poor fixture here): the fused kernel and torch's for-loop agree to rounding."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    fused_net, loop_net = net, copy.deepcopy(net)
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    fused = adamw(fused_net.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95))
    loop = torch.optim.AdamW(loop_net.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), foreach=False)
    assert fused_flag(fused) and not fused_flag(loop)
    inputs, targets = torch.randn(64, 16), torch.randn(64, 4)
    for _ in range(5):
        for model, optimizer in ((fused_net, fused), (loop_net, loop)):
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), (_, b) in zip(fused_net.named_parameters(), loop_net.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        assert (a - start[name]).abs().max() > 1e-3  # the steps moved every weight


def test_fused_only_where_supported(monkeypatch):
    weights = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    assert fused_supported(weights) and fused_supported([{"params": weights, "lr": 0.1}])
    assert not fused_supported([torch.nn.Parameter(torch.ones(2, dtype=torch.float32)), torch.ones(2).long()])
    assert not fused_supported([])
    monkeypatch.setattr(optimizers, "fused_kernel_devices", lambda: ["cuda"])  # a torch without a CPU kernel
    assert not fused_supported(weights)
    assert not fused_flag(adamw(weights, lr=0.1))  # torch's own default then


def test_explicit_choices_are_kept():
    weights = [torch.nn.Parameter(torch.ones(3))]
    assert not fused_flag(adamw(weights, lr=0.1, fused=False))
    foreach = adamw(weights, lr=0.1, foreach=True)
    assert foreach.param_groups[0]["foreach"] and not fused_flag(foreach)


def test_methods_and_config_default_to_fused_adamw(student, teacher, tokenizer, tmp_path):
    module = GKDModule(student, teacher, tokenizer)
    assert fused_flag(module.configure_optimizers())
    cfg = compose_train(tmp_path, [])
    factory = instantiate(cfg.optimizer)
    assert isinstance(factory, partial) and fused_flag(factory(student.parameters()))
    assert factory(student.parameters()).param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr)
    off = instantiate(compose_train(tmp_path, ["optimizer.fused=false"]).optimizer)
    assert not fused_flag(off(student.parameters()))


def test_mixed_precision_with_clipping_falls_back_to_unfused_adamw(student, teacher, tokenizer, tmp_path):
    """Lightning refuses gradient clipping with a fused optimizer under a mixed-precision plugin, so the default
    AdamW is unfused there (and fused again under 32-true); the run trains."""
    from helpers.fitting import fit_one_step

    for precision, fused in (("bf16-mixed", False), ("32-true", True)):
        module = GKDModule(student, teacher, tokenizer, lmbda=0.0, training={"optimizer": partial(adamw, lr=1e-3)})
        trainer = fit_one_step(module, tokenizer, tmp_path, precision, gradient_clip_val=1.0)
        assert fused_flag(trainer.optimizers[0]) is fused and trainer.global_step == 1
