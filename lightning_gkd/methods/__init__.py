"""LightningModules: one per training method."""
