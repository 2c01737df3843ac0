#!/usr/bin/env bash
# Wheels for scripts/device_check.py on a GPU machine without network access (docs/developing.md, "A prepared GPU
# check"). Run here, where pip can reach an index; the folder travels with the working tree (git-ignored) and
# `python scripts/device_check.py --setup` installs from it with `pip install --no-index`.
#
#   bash scripts/device_wheels.sh              # wheels for CPython 3.11 on manylinux x86_64
#   PYTHON_VERSION=3.12 bash scripts/device_wheels.sh
#
# What the GPU image is assumed to have already: torch, lightning, transformers (>= pyproject's lower bound, 5.17) and
# their dependencies (numpy, tokenizers, safetensors, filelock, pyyaml, tqdm, packaging). What this folder brings:
# hydra-core, omegaconf (< 2.4, hydra's bound), antlr4 (built here: it is an sdist), datasets and what it needs beyond
# those: pyarrow (24.0, the oldest datasets accepts and the smallest: 47 of the ~63 MiB), pandas, python-dateutil,
# dill, multiprocess, xxhash, and huggingface-hub / fsspec within datasets' bounds (pip takes them only where the
# image's own are outside); rich and its dependencies; setuptools (the build backend of `pip install -e .`).
# Wheels are downloaded without their dependencies (listed explicitly), so the folder stays under the 64 MiB a device
# run carries.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=device_wheels
PY=${PYTHON_VERSION:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
rm -rf "$OUT" && mkdir -p "$OUT"
PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Binary packages: wheels for the GPU machine's Python and platform, without their dependencies (listed explicitly).
pip download -q --no-deps --only-binary=:all: --python-version "$PY" "${PLATFORM[@]}" -d "$OUT" \
    "hydra-core>=1.3.8" "omegaconf>=2.3.1,<2.4" "datasets>=5.2.0" "pyarrow==24.0.0" "pandas>=2.2" "python-dateutil<3" \
    six "dill>=0.3,<0.4.2" "multiprocess<0.70.20" xxhash "huggingface-hub>=1.31,<2" "fsspec>=2023.1.0,<=2026.9.0" \
    "rich>=15.0.0" markdown-it-py mdurl pygments "setuptools>=68"
# antlr4-python3-runtime 4.9.3 (hydra's pin) is only an sdist: build its (pure Python) wheel here.
pip wheel -q --no-deps "antlr4-python3-runtime==4.9.3" -w "$OUT"
ls -s --block-size=K "$OUT"
echo "total: $(du -sk "$OUT" | awk '{printf "%.1f", $1 / 1024}') MiB (a device run carries at most 64 MiB)"
