"""SamplerShutdown: stops a method's sampling engines (``sampler.close()``) when a fit ends by an exception.

A callback the method owns (``configure_callbacks``), not one users pick, so it lives with the training plumbing.

Lightning calls no LightningModule hook when a fit is interrupted (SIGTERM's ``SIGTERMException``, an error), only
callbacks' ``on_exception``; ``GKDModule.configure_callbacks`` adds this one when its sampler has engines to stop
(``VLLMSampler``), so an interrupted run in a notebook or a test does not leave an engine behind. A fit that ends
normally closes them in ``GKDModule.teardown``.
"""

from __future__ import annotations

import lightning as L


class SamplerShutdown(L.Callback):
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        close = getattr(getattr(pl_module, "sampler", None), "close", None)
        if callable(close):
            close()
