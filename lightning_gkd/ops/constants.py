"""Constants every room shares (data, rollouts, evaluation, training and the losses read them from here)."""

#: Label value marking positions that do not contribute to the loss (PyTorch's cross-entropy default).
IGNORE_INDEX: int = -100
