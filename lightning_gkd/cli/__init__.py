"""Command-line entry points: ``lightning-gkd`` (Hydra: build -> fit -> finish) and the hub push."""


def put_launch_folder_on_path() -> None:
    """Make modules in the folder a command was started from importable, as ``python -m`` does: a console script
    (``lightning-gkd``) puts only its own bin folder on ``sys.path``, so a user's ``formatting_func``, ``_target_`` or
    callback module next to their data would not import without ``PYTHONPATH=.``."""
    import os
    import sys

    folder = os.getcwd()
    if folder not in sys.path and "" not in sys.path:
        sys.path.insert(0, folder)
