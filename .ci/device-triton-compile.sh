#!/usr/bin/env bash
# Compile every pagedlab Triton kernel for sm_90 on the CPU with the Triton of the GPU image
# (DESIGN.md: triton 3.6; CI's own is newer), in a venv of its own under .cache: a kernel that
# only the newer Triton compiles fails here, not on the device machine, which installs nothing.
# A skip (this Triton unable to compile for CUDA at all) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
device_triton="${PAGEDLAB_DEVICE_TRITON:-3.6.0}"
venv=.cache/device-triton
[ -x "$venv/bin/python" ] || python -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0 "triton==$device_triton" numpy pytest
report=$(env -u TRITON_INTERPRET PYTHONPATH=src "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
             tests/test_kernels_hopper_compile.py 2>&1) || { echo "$report"; exit 1; }
echo "$report" | tail -n 3
if echo "$report" | grep -q "skipped"; then
    echo "device-triton-compile: tests were skipped under triton $device_triton" >&2
    exit 1
fi
