"""Distillation across tokenizers: byte-span alignment (``token_alignment``), ULD and GOLD's hybrid (``uld``,
``aligned_row_loss``), and the chunk-likelihood and projected losses (``chunk_likelihood``)."""
