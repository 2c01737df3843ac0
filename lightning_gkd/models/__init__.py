"""Loading the trained and frozen models (hub id, folder, config, spec), LoRA, FSDP2 sharding, and the tiny models
the project builds and ships."""
