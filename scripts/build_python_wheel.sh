#!/usr/bin/env bash
# Builds the kspeed Python wheel (one abi3 wheel for CPython >= 3.9) into
# DIR (default target/wheels): `pip wheel ./ffi/python`, through the
# package's build backend, which turns the rdma feature on where libibverbs'
# development files are installed (KSPEED_RDMA=0 or 1 to choose), and which
# carries the `kspeed` command (the root crate's CLI, built in release into
# ffi/python/target/cli and run by the `kspeed` console script; KSPEED_CLI=0
# leaves it out). Needs a Rust toolchain and Python 3.9+ with pip; maturin
# comes from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/wheels}
mkdir -p "$out"
python3 -m pip wheel --disable-pip-version-check --no-deps -w "$out" ./ffi/python
ls -1 "$out"/kspeed-*.whl
