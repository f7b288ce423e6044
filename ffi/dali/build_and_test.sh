#!/usr/bin/env bash
# Builds the kspeed DALI plugin and runs its tests, CPU only:
#   1. a virtual environment with the DALI wheel from PyPI and the small CUDA
#      header packages its headers need (no CUDA toolkit), Pillow, NumPy;
#   2. kspeed installed under a prefix (scripts/install.sh);
#   3. the plugin built with CMake against both;
#   4. ffi/dali/tests (unittest).
# Settings: KSPEED_DALI_VENV (default target/dali-venv), KSPEED_DALI_PREFIX
# (default target/dali-prefix), KSPEED_DALI_BUILD (default target/dali-build).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
venv=${KSPEED_DALI_VENV:-$root/target/dali-venv}
prefix=${KSPEED_DALI_PREFIX:-$root/target/dali-prefix}
build=${KSPEED_DALI_BUILD:-$root/target/dali-build}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check \
    nvidia-dali-cuda120 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12 nvidia-cuda-crt pillow numpy
echo "DALI $("$venv/bin/python" -c 'import nvidia.dali as d; print(d.__version__)')"
scripts/install.sh "$prefix"
cmake -S ffi/dali -B "$build" -DPython3_EXECUTABLE="$venv/bin/python" -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" >/dev/null
echo "built $build/libkspeed_dali.so"
KSPEED_BIN="$prefix/bin/kspeed" KSPEED_DALI_PLUGIN="$build/libkspeed_dali.so" \
    PYTHONWARNINGS=ignore::DeprecationWarning \
    "$venv/bin/python" -m unittest discover -s ffi/dali/tests -v
