"""The per-step metrics OPDModule logs (README "On-policy distillation (OPD)"), for the tests that check them."""

OPD_METRICS = [
    "train/opd/reward",
    "train/opd/kl",
    "train/opd/is_weight_mean",
    "train/opd/is_weight_max",
    "train/opd/is_truncated_fraction",
    "train/opd/advantage_mean",
    "train/opd/advantage_abs_mean",
    "train/opd/eos_rate",
]
