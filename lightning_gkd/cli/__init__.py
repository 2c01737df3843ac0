"""Command-line entry points: ``lightning-gkd`` (Hydra: build -> fit -> finish) and the hub push."""
