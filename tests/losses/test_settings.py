"""DivergenceSettings and PolicyGradientSettings (lightning_gkd/losses/settings.py): the defaults (TRL's GKD, OPD's
own), and each range checked when made (before any model loads), naming the option, its value and what to set."""

import pytest

from lightning_gkd.losses.settings import SPARSE_LOSSES, DivergenceSettings, PolicyGradientSettings


def test_the_defaults():
    assert DivergenceSettings() == DivergenceSettings(
        beta=0.5, loss_temperature=1.0, sparse_loss="topk", lean_loss=True, loss_chunk_size=64
    )
    assert PolicyGradientSettings() == PolicyGradientSettings(
        gamma=0.0,
        max_is_weight=2.0,
        length_normalize=False,
        baseline="none",
        clip_ratio=None,
        kl_coef=0.0,
        importance_weights=True,
    )
    assert SPARSE_LOSSES == ("topk", "topk_renorm", "k1", "k3")


@pytest.mark.parametrize(
    "options, match",
    [
        ({"beta": -0.1}, r"divergence\.beta must be in \[0, 1\], got -0\.1 \(0: forward KL, 1: reverse KL"),
        ({"beta": 1.5}, r"divergence\.beta must be in \[0, 1\], got 1\.5"),
        ({"beta": "0.5"}, r"divergence\.beta must be in \[0, 1\], got '0\.5'"),
        ({"loss_temperature": 0.0}, r"divergence\.loss_temperature must be > 0, got 0\.0"),
        ({"sparse_loss": "k2"}, r"divergence\.sparse_loss must be one of topk, topk_renorm, k1, k3, got 'k2'"),
        ({"lean_loss": "yes"}, r"divergence\.lean_loss must be true or false, got 'yes'"),
        ({"loss_chunk_size": 0}, r"divergence\.loss_chunk_size must be an integer >= 1, got 0 \(positions"),
        ({"loss_chunk_size": 8.5}, r"divergence\.loss_chunk_size must be an integer >= 1, got 8\.5"),
    ],
)
def test_each_divergence_setting_is_checked(options, match):
    with pytest.raises(ValueError, match=match):
        DivergenceSettings(**options)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"gamma": 1.5}, r"policy_gradient\.gamma \(the discount of later rewards\) must be in \[0, 1\], got 1\.5"),
        ({"gamma": -0.1}, r"policy_gradient\.gamma .* must be in \[0, 1\], got -0\.1"),
        ({"max_is_weight": 0}, r"policy_gradient\.max_is_weight \(the importance weights' truncation\) must be > 0"),
        ({"length_normalize": "true"}, r"length_normalize must be true or false, got 'true'"),
        ({"baseline": "mean"}, r"baseline must be 'none' .* or 'row' .*got 'mean'"),
        ({"clip_ratio": 1.0}, r"clip_ratio .* must be in \(0, 1\)"),
        ({"clip_ratio": 0.2, "importance_weights": False}, r"clip_ratio=0\.2 clips the ratio .* policy_gradient\."),
        ({"kl_coef": -1.0}, r"policy_gradient\.kl_coef \(the full-distribution term's weight\) must be >= 0, got -1"),
        ({"importance_weights": 1}, r"policy_gradient\.importance_weights must be true or false, got 1"),
    ],
)
def test_each_policy_gradient_setting_is_checked(options, match):
    with pytest.raises(ValueError, match=match):
        PolicyGradientSettings(**options)


def test_settings_are_frozen_values():
    settings = DivergenceSettings(beta=1.0)
    with pytest.raises(AttributeError):
        settings.beta = 0.0  # type: ignore[misc]
    assert settings == DivergenceSettings(beta=1.0) and settings != DivergenceSettings()
