#!/usr/bin/env bash
# Wheels for scripts/device_check.py on a GPU machine without network access (docs/developing.md, "A prepared GPU
# check"). Run here, where pip can reach an index; the folder travels with the working tree (git-ignored) and
# `python scripts/device_check.py --setup` installs every wheel in it with `pip install --no-index --no-deps`.
#
#   bash scripts/device_wheels.sh                    # CPython 3.12 (the H200 image's), what that image lacks: ~2.5 MiB
#   FULL=1 bash scripts/device_wheels.sh             # also the data stack, for a bare image with torch alone: ~63 MiB
#   PYTHON_VERSION=3.11 bash scripts/device_wheels.sh
#
# The default assumes an image like the lent H200's (/work/.library/device/KINDS.md): torch, lightning, transformers
# (>= pyproject's lower bound, 5.17), pyarrow, pandas, xxhash, rich, huggingface-hub, fsspec and setuptools already
# there. It brings hydra-core, omegaconf, antlr4 (built here: it is an sdist), datasets with dill and multiprocess,
# and trl (the `bench_trl` part's oracle). A device run carries at most 64 MiB with the working tree (~24 MiB), so
# pyarrow (49 MiB) only comes with FULL=1. Installed without dependency resolution (--no-deps), the image's own
# versions stay: datasets 5.2 declares pyarrow >= 24 and imports with older ones.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=device_wheels
PY=${PYTHON_VERSION:-3.12}
rm -rf "$OUT" && mkdir -p "$OUT"
PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
WANTED=("hydra-core>=1.3.8" "omegaconf>=2.3.1,<2.4" "datasets>=5.2.0" "dill>=0.3,<0.4.2" "multiprocess<0.70.20"
    "trl==1.16.*")
if [[ "${FULL:-0}" == 1 ]]; then
    WANTED+=("pyarrow==24.0.0" "pandas>=2.2" "python-dateutil<3" six xxhash "huggingface-hub>=1.31,<2"
        "fsspec>=2023.1.0,<=2026.9.0" "rich>=15.0.0" markdown-it-py mdurl pygments "setuptools>=68")
fi
pip download -q --no-deps --only-binary=:all: --python-version "$PY" "${PLATFORM[@]}" -d "$OUT" "${WANTED[@]}"
# antlr4-python3-runtime 4.9.3 (hydra's pin) is only an sdist: build its (pure Python) wheel here.
pip wheel -q --no-deps "antlr4-python3-runtime==4.9.3" -w "$OUT"
ls -s --block-size=K "$OUT"
echo "total: $(du -sk "$OUT" | awk '{printf "%.1f", $1 / 1024}') MiB (a device run carries at most 64 MiB)"
