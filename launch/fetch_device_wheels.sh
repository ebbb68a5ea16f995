#!/usr/bin/env bash
# Downloads, here (where PyPI is reachable), the wheels the H200 image lacks into .whl/
# (git-ignored), for Python 3.12: launch/device_check.sh installs them there (carry .whl).
# jax-triton (the GPU decode kernel's launcher) and ml-collections (config schema). Pure
# Python wheels; the image's own jax 0.11, flax, optax, orbax-checkpoint, triton are used.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d .whl "jax-triton==0.4.1" "ml-collections==1.1.0"
ls -la .whl
