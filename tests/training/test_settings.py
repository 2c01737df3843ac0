"""TrainingSettings (lightning_gkd/training/settings.py): the defaults and each option checked when made."""

from functools import partial

import pytest
import torch

from lightning_gkd.training.settings import TrainingSettings


def test_the_defaults():
    settings = TrainingSettings()
    assert settings.optimizer is None and settings.scheduler is None  # None: fused AdamW at 5e-5, no schedule
    assert (settings.seed, settings.nonfinite, settings.loss_normalization, settings.frozen_dtype) == (
        0,
        "raise",
        "step",
        "auto",
    )
    assert settings.disable_dropout and not settings.gradient_checkpointing and not settings.trust_remote_code


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"optimizer": "adamw"}, TypeError, r"training\.optimizer must be a factory .*got 'adamw'"),
        ({"scheduler": 3}, TypeError, r"training\.scheduler must be a factory"),
        ({"seed": "1"}, ValueError, r"training\.seed must be an integer, got '1'"),
        ({"nonfinite": "ignore"}, ValueError, r"training\.nonfinite must be 'raise' or 'skip', got 'ignore' \(raise:"),
        ({"loss_normalization": "token"}, ValueError, r"training\.loss_normalization must be 'step' or 'micro_batch'"),
        ({"frozen_dtype": "int8"}, ValueError, r"training\.frozen_dtype must be 'auto', 'float32'.*got 'int8'"),
        ({"disable_dropout": "no"}, ValueError, r"training\.disable_dropout must be true or false, got 'no'"),
        ({"gradient_checkpointing": 1}, ValueError, r"training\.gradient_checkpointing must be true or false"),
        ({"trust_remote_code": None}, ValueError, r"training\.trust_remote_code must be true or false, got None"),
    ],
)
def test_each_option_is_checked(options, error, match):
    with pytest.raises(error, match=match):
        TrainingSettings(**options)


def test_factories_are_kept_as_given():
    optimizer = partial(torch.optim.SGD, lr=0.1)
    assert TrainingSettings(optimizer=optimizer, frozen_dtype="bfloat16").optimizer is optimizer
