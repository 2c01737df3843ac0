"""WarmupSchedule: transformers' schedules with a warmup in steps or as a ratio of the run (TRL's warmup_ratio)."""

import pytest
import torch
from helpers.hydra_compose import compose_train
from hydra.utils import instantiate
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from lightning_gkd.training.schedulers import WarmupSchedule


def _lrs(scheduler, optimizer, steps):
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


@pytest.mark.parametrize(
    ("name", "reference"), [("cosine", get_cosine_schedule_with_warmup), ("linear", get_linear_schedule_with_warmup)]
)
def test_a_warmup_ratio_gives_transformers_schedule_with_ceil_of_the_ratio_in_steps(name, reference):
    schedule = WarmupSchedule(90, name=name, warmup_ratio=0.05)
    assert schedule.warmup_steps == 5  # ceil(4.5)
    ours, theirs = _optimizer(), _optimizer()
    expected = _lrs(reference(theirs, num_warmup_steps=5, num_training_steps=90), theirs, 90)
    assert _lrs(schedule(ours), ours, 90) == pytest.approx(expected, abs=0)
    assert WarmupSchedule(90, name=name, num_warmup_steps=7).warmup_steps == 7


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_warmup_steps": 5, "warmup_ratio": 0.1}, r"not both \(got num_warmup_steps=5, warmup_ratio=0.1\)"),
        ({}, r"not neither"),
        ({"warmup_ratio": 1.0}, r"warmup_ratio must be in \[0, 1\), got 1.0"),
        ({"num_warmup_steps": -1}, r"num_warmup_steps must be >= 0, got -1"),
        ({"num_warmup_steps": 1, "name": "step"}, r"scheduler name must be one of"),
    ],
)
def test_bad_settings_are_refused_when_the_factory_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupSchedule(100, **kwargs)
    with pytest.raises(ValueError, match=r"num_training_steps=-1 .*set trainer.max_steps"):
        WarmupSchedule(-1, warmup_ratio=0.05)


def test_the_scheduler_configs_take_a_ratio_of_trainer_max_steps(tmp_path):
    cfg = compose_train(
        tmp_path, ["trainer.max_steps=50", "scheduler.num_warmup_steps=null", "scheduler.warmup_ratio=0.1"]
    )
    assert instantiate(cfg.scheduler).warmup_steps == 5
    cfg = compose_train(tmp_path, ["scheduler=linear", "trainer.max_steps=40"])
    schedule = instantiate(cfg.scheduler)
    assert (schedule.name, schedule.warmup_steps, schedule.num_training_steps) == ("linear", 20, 40)
