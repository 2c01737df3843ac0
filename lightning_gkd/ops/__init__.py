"""Pure torch: divergences, preference losses, sequence log-probs, the KV-cache sampler and helpers for calling
Hugging Face models. Nothing here imports Lightning."""
