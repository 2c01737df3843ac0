"""The divergences and the objectives built on log-probabilities: the generalized JSD from logits (``jsd``) or from
hidden states a chunk at a time (``chunked_jsd``, ``chunked_head``), against a sparse teacher (``sparse_kd``,
``topk``), OPD's policy gradient (``opd``), DPO's preference losses (``preference``), and the figures of a batch of
samples (``sample_figures``)."""
