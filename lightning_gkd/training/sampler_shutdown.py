"""SamplerShutdown: stops a method's sampling engines (``sampler.close()``) when a fit ends by an exception.

A callback the method owns (``configure_callbacks``), not one users pick, so it lives with the training plumbing.

Lightning calls no LightningModule hook when a fit is interrupted (SIGTERM's ``SIGTERMException``, an error), only
callbacks' ``on_exception``; ``OnPolicyModule.configure_callbacks`` adds this one with its sampler's ``close`` (which
stops a serving engine such as ``VLLMSampler``'s, and does nothing for an in-process sampler), so an interrupted run
in a notebook or a test does not leave an engine behind. A fit that ends normally closes them in its ``teardown``.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L


class SamplerShutdown(L.Callback):
    def __init__(self, close: Callable[[], None]) -> None:
        self.close = close

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.close()
