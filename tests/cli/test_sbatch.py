"""lightning-gkd-sbatch: the SLURM script ships inside the package (one home), printed or copied executable."""

import os
import stat
import subprocess
import sys
from importlib.metadata import entry_points
from importlib.resources import files
from pathlib import Path

import pytest
from helpers.paths import ROOT

from lightning_gkd.cli.sbatch import main


def shipped() -> str:
    return files("lightning_gkd").joinpath("assets", "slurm", "train.sbatch").read_text()


def test_the_script_has_one_home_inside_the_package():
    text = shipped()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --signal=SIGUSR1@90" in text.splitlines()
    assert 'python}" -m lightning_gkd.cli.train trainer=ddp' in text
    assert not (ROOT / "scripts" / "slurm" / "train.sbatch").exists()  # no second copy to drift


def test_printing_gives_the_shipped_file(capsys):
    main([])
    assert capsys.readouterr().out == shipped()


def test_copying_writes_it_executable_and_keeps_an_existing_file(tmp_path, capsys):
    main([str(tmp_path)])  # a folder: train.sbatch inside it
    target = tmp_path / "train.sbatch"
    assert target.read_text() == shipped()
    mode = target.stat().st_mode
    assert mode & stat.S_IXUSR and os.access(target, os.X_OK) and mode & 0o111 == (mode & 0o444) >> 2
    assert f"sbatch {target}" in capsys.readouterr().err
    target.write_text("# mine\n")
    with pytest.raises(SystemExit) as exit_:
        main([str(target)])
    assert exit_.value.code == 2 and "exists; pass --force to overwrite it" in capsys.readouterr().err
    assert target.read_text() == "# mine\n"
    main([str(target), "--force"])
    assert target.read_text() == shipped()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "no_such_folder" / "job.sbatch")])
    assert "does not exist" in capsys.readouterr().err


def test_the_console_script_prints_it():
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "lightning-gkd-sbatch"]
    assert script.value == "lightning_gkd.cli.sbatch:main"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lightning-gkd-sbatch")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == shipped()
