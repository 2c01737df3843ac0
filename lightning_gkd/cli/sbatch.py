"""lightning-gkd-sbatch: the SLURM batch script for ``lightning-gkd`` (one task per GPU, requeue on SIGUSR1, resume
in outputs/slurm/<job id>), shipped inside the package.

lightning-gkd-sbatch                      # print it
lightning-gkd-sbatch train.sbatch         # copy it (executable); --force overwrites an existing file
sbatch train.sbatch trainer.max_steps=20000 trainer.precision=bf16-mixed
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

SCRIPT_NAME = "train.sbatch"


def script_text() -> str:
    """The shipped script (``lightning_gkd/assets/slurm/train.sbatch`` of the installed package)."""
    return files("lightning_gkd").joinpath("assets").joinpath("slurm").joinpath(SCRIPT_NAME).read_text()


def copy_script(dest: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the script to ``dest`` (a file, or a folder to put ``train.sbatch`` in), executable; an existing file
    is kept unless ``force``. Returns the file written."""
    target = Path(dest).expanduser()
    if target.is_dir():
        target = target / SCRIPT_NAME
    if not target.parent.is_dir():
        raise FileNotFoundError(f"{str(dest)!r}: the folder {str(target.parent)!r} does not exist.")
    if target.exists() and not force:
        raise FileExistsError(f"{str(target)!r} exists; pass --force to overwrite it.")
    target.write_text(script_text())  # created with the umask's permissions
    mode = target.stat().st_mode
    target.chmod(mode | (mode & 0o444) >> 2)  # executable by whoever may read it, as `chmod +x` does
    return target


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-gkd-sbatch",
        description="Print the SLURM batch script for lightning-gkd, or copy it to DEST (then: sbatch DEST ...).",
    )
    parser.add_argument("dest", nargs="?", help="file or folder to copy the script to (default: print it)")
    parser.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    args = parser.parse_args(argv)
    if args.dest is None:
        sys.stdout.write(script_text())
        return
    try:
        target = copy_script(args.dest, force=args.force)
    except (FileExistsError, FileNotFoundError) as error:
        parser.error(str(error))
    print(f"wrote {target}; submit it with: sbatch {target} [overrides...]", file=sys.stderr)


if __name__ == "__main__":
    main()
