"""Calling Hugging Face causal LMs: ``forward`` (wrappers, keywords, logits, EOS/pad ids), ``heads`` (the output head
and final hidden states the lean losses read), ``embedding`` (a tied embedding's row gradient)."""
