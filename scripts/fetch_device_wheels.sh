#!/usr/bin/env bash
# Download into .whl/ the wheels the H200 device image lacks (see /work/.library/device/KINDS.md: it has torch,
# cupy-cuda13x, transformers, tokenizers, numpy, pytest(-timeout, -xdist), grpcio, protobuf, jinja2, ...), for its
# Python 3.12 on manylinux x86_64, pinned to the versions in this checkout's .venv. scripts/device_check.sh
# installs whatever is in .whl/ with --no-deps into /tmp/site. The embedded model wheels are not fetched: they
# exceed the device's 64 MiB transfer limit, and the serve smoke test falls back to a random-weight model.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY=${VENV_PY:-.venv/bin/python}
# grpcio and protobuf travel too: the generated stubs and grpcio-health-checking/-reflection require at least
# the versions they were generated with, and the image's may be older.
# nvidia-cuda-runtime-cu12 carries the CUDA 12 headers the host emulator (tests/simt) compiles against, for
# tests/kernel_tests/gpu/test_simt_probes_gpu.py.
PACKAGES=(structlog gguf grpcio grpcio-health-checking grpcio-reflection protobuf nvidia-cuda-runtime-cu12)

specs=()
for pkg in "${PACKAGES[@]}"; do
  version=$("$VENV_PY" -m pip show "$pkg" 2>/dev/null | awk '/^Version:/ {print $2}')
  specs+=("$pkg${version:+==$version}")
done
mkdir -p .whl
rm -f .whl/*.whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}"
du -ch .whl/*.whl | tail -n 1
