"""``dataset_loss``, the loss hook's name before it was ``completion_loss`` (GKD: ``distillation_loss``): kept
working for one release, in both directions."""

from __future__ import annotations

import warnings
from typing import Any

import torch


class LegacyLossHook:
    """Mixed into ``CausalLMModule``. Calling ``module.dataset_loss(batch)`` warns and runs the loss hook; a subclass
    that still *overrides* ``dataset_loss`` has that override installed as its loss hook (with a warning), and its
    ``super().dataset_loss(batch)`` reaches the parent's hook."""

    loss_hook: str
    _legacy_dataset_loss = False  # set on a subclass whose dataset_loss override became its loss hook

    def dataset_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Deprecated alias of the loss hook (``loss_hook``): the first one up the class chain that is not itself a
        legacy override, so a legacy override's ``super().dataset_loss(batch)`` does not call itself."""
        warnings.warn(
            f"{type(self).__name__}.dataset_loss is deprecated: call {self.loss_hook}.",
            DeprecationWarning,
            stacklevel=2,
        )
        for klass in type(self).__mro__:
            if not vars(klass).get("_legacy_dataset_loss") and self.loss_hook in vars(klass):
                return vars(klass)[self.loss_hook](self, batch)
        raise NotImplementedError(f"{type(self).__name__} defines no {self.loss_hook}.")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        legacy = vars(cls).get("dataset_loss")
        if legacy is not None:
            warnings.warn(
                f"{cls.__qualname__} overrides dataset_loss, which is now named {cls.loss_hook}: rename the method "
                "(the old name stops working in a later release).",
                DeprecationWarning,
                stacklevel=2,
            )
            setattr(cls, cls.loss_hook, legacy)
            cls._legacy_dataset_loss = True
