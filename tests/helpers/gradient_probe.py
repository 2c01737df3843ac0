"""Probes for when gradients are freed (tests/methods/test_base.py and its multi-process worker)."""

import lightning as L


class GradientsAtBatchStart(L.Callback):
    """Records, as each training batch starts (before its sampling and forwards), whether the trained parameters
    hold gradients."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        trained = [p for p in pl_module.parameters() if p.requires_grad]
        self.seen.append(any(p.grad is not None for p in trained))


class StepAsLightningDoes:
    """Lightning's own ``optimizer_step`` (gradients left until the next closure zeroes them): the reference."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        L.LightningModule.optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure)
