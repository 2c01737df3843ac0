"""``python -m lightning_gkd.train``: the same entry point as ``lightning-gkd`` (now ``lightning_gkd.cli.train``),
kept so commands and scripts written for the old path, and Lightning's DDP launcher re-running them, still work."""

from lightning_gkd.cli.train import (
    build,
    card_info,
    finish,
    fit,
    instantiate_callbacks,
    main,
    print_config,
    print_summary,
    run,
)

__all__ = [
    "build",
    "card_info",
    "finish",
    "fit",
    "instantiate_callbacks",
    "main",
    "print_config",
    "print_summary",
    "run",
]

if __name__ == "__main__":
    main()
