"""Test helpers: worker scripts the multi-process tests start, the Hydra compose helper, fixture makers."""
