"""Sampling completions: the KV-cache decoder and its batch layout (``sampling``), speculative KD's block-verified
sampling (``speculative``)."""
