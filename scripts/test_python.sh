#!/usr/bin/env bash
# Builds the kspeed Python package (ffi/python) and runs its tests
# (ffi/python/tests, pytest) in a cached virtual environment:
#   1. the venv (KSPEED_PY_VENV, default ~/.cache/kspeed/py-venv, outside
#      the checkout so a fresh clone on the same machine reuses it) with maturin, numpy,
#      pytest, pytest-timeout, Pillow, simplejpeg, and torch + torchvision + torchdata from PyPI (large: the venv is
#      kept between runs; KSPEED_PY_NO_TORCH=1 leaves them out, and their
#      tests then skip, except under CI where a skip is a failure);
#   2. fmt and clippy of the extension crate;
#   3. `pip install ./ffi/python` into the venv (the README's command; the
#      build's target directory ffi/python/target is kept, so a rebuild is
#      incremental); it builds the `kspeed` command the wheel carries too;
#   4. the installed extension module exports no ksp_* symbol (the C ABI
#      lives in the kspeed-capi crate, which the extension does not link;
#      when it was part of the kspeed crate every cdylib built on kspeed
#      exported all of it);
#   5. pytest, with the repository's `kspeed` CLI ($KSPEED_BIN, else a debug
#      build) for making spaces and
#      running `kspeed serve`, and a limit per test (pytest-timeout,
#      KSPEED_PY_TEST_TIMEOUT_S, default 600 s): a test that hangs fails
#      with its stack instead of holding the run until CI's limit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${KSPEED_PY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kspeed/py-venv}
mkdir -p "$(dirname "$venv")"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"$venv/bin/python" -c 'import maturin, numpy, pytest, pytest_timeout, PIL, simplejpeg' 2>/dev/null || "${pip[@]}" maturin numpy pytest pytest-timeout pillow simplejpeg
if [ "${KSPEED_PY_NO_TORCH:-0}" != 1 ]; then
    "$venv/bin/python" -c 'import torch, torchvision, torchdata' 2>/dev/null || "${pip[@]}" torch torchvision torchdata
fi
(cd ffi/python && cargo fmt --check && cargo clippy --quiet --all-targets -- -D warnings)
# --no-build-isolation: the venv has maturin; the backend is in the tree.
PATH="$venv/bin:$PATH" "${pip[@]}" --no-build-isolation --force-reinstall --no-deps ./ffi/python
ext=$("$venv/bin/python" -c 'import kspeed._kspeed as m; print(m.__file__)')
exported=$(nm -D --defined-only "$ext" | awk '$3 ~ /^ksp_/ {print $3}')
if [ -n "$exported" ]; then
    echo "FAILED: the Python extension $ext exports C ABI symbols:" $exported >&2
    exit 1
fi
echo "the Python extension ($(basename "$ext")) exports no ksp_* symbol"
# The CLI the tests run: $KSPEED_BIN when given (scripts/test.sh passes
# the release build its test steps made, so CI does not build the whole
# crate again in debug), else this checkout's debug build.
if [ -z "${KSPEED_BIN:-}" ]; then
    cargo build --quiet --bin kspeed
    export KSPEED_BIN="$root/target/debug/kspeed"
elif [ ! -x "$KSPEED_BIN" ]; then
    echo "KSPEED_BIN=$KSPEED_BIN is not an executable" >&2
    exit 1
fi
if [ -n "${CI:-}" ]; then
    export KSPEED_PY_REQUIRE_ALL=1
fi
cd ffi/python
"$venv/bin/python" -c 'import kspeed; print("kspeed", kspeed.__version__, "for Python, RDMA:", kspeed.HAS_RDMA)'
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    --timeout="${KSPEED_PY_TEST_TIMEOUT_S:-600}" tests "$@"
