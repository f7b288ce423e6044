#!/usr/bin/env bash
# The whole test suite, on a fresh machine: system packages, formatting,
# lints (with and without the rdma feature), rustdoc, the header and public
# API listing drift checks, every test with and
# without the rdma feature (the cluster tests start `kspeed serve` processes
# on 127.0.0.x and, as root, in network namespaces), the frame-decoding fuzz
# target for a bounded time, Miri on the modules that can run under it
# (scripts/miri.sh), the C ABI from C (plain, ASan, valgrind), the
# C++ example against an installed package, the DALI plugin's tests (downloads
# the DALI wheel once into target/dali-venv), the Python package's tests
# (pip install ./ffi/python and pytest, torch cached in ~/.cache/kspeed/py-venv), and
# the RDMA tests inside the soft-RoCE VM.
#
# KSPEED_REQUIRE=all (.ci/run sets it): nothing may be skipped. A test that
# finds its tool, privilege or device missing fails instead of passing
# (tests/common skip()), and so do the DALI, Python, fuzzing and VM steps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CARGO_TERM_COLOR=never
step() { echo; echo "== $*"; }
require_all() { [ "${KSPEED_REQUIRE:-}" = all ]; }
# A step that cannot run: a failure under KSPEED_REQUIRE=all, else a note.
skipped() {
  if require_all; then
    echo "FAILED: KSPEED_REQUIRE=all and $*" >&2
    exit 1
  fi
  echo "skipped: $*"
}

step "cargo fmt --check"
cargo fmt --all -- --check
# --workspace: the kspeed crate and the C ABI crate kspeed-capi (capi/).
step "cargo clippy (default features, without rdma, the library alone)"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --workspace --all-targets --no-default-features --features cli -- -D warnings
cargo clippy --workspace --all-targets --no-default-features -- -D warnings
cargo clippy --workspace --all-targets --no-default-features --features rdma -- -D warnings
step "rustdoc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
step "include/kspeed.h matches capi/src (pinned cbindgen)"
scripts/gen_header.sh --check
step "api/kspeed.txt matches the public Rust API (nightly rustdoc JSON)"
set +e
scripts/api_listing.sh --check
api_rc=$?
set -e
if [ "$api_rc" = 2 ]; then
  skipped "the public API listing needs the nightly toolchain (rustup toolchain install nightly)"
elif [ "$api_rc" != 0 ]; then
  exit 1
fi

runner=(cargo test)
if cargo nextest --version >/dev/null 2>&1; then runner=(cargo nextest run --no-fail-fast); fi
# test-panic: the C library (kspeed-capi) exports ksp_test_panic, so
# tests/capi.rs checks the C ABI's panic boundary (without it that check is
# a skip). --workspace: the tests of both crates (kspeed-capi's C library
# is tested from C by kspeed's tests/capi.rs and tests/capi_classes.rs).
step "the library alone (default-features = false, features = [\"rdma\"]): build, lib tests"
cargo build -p kspeed --lib --no-default-features --features rdma
cargo test -p kspeed --lib --no-default-features --features rdma
step "tests without the rdma feature"
"${runner[@]}" --workspace --no-default-features --features cli,test-panic
step "tests (default features)"
"${runner[@]}" --workspace --features test-panic

step "C++ example against an installed package (CMake, pkg-config, static)"
scripts/test_cpp.sh

step "DALI plugin (fn.kspeed.reader) against the DALI wheel, CPU only"
if [ "${KSPEED_SKIP_DALI:-0}" = 1 ]; then
  skipped "KSPEED_SKIP_DALI=1"
else
  ffi/dali/build_and_test.sh 2>&1 | tail -n 15
  test "${PIPESTATUS[0]}" = 0
fi

step "Python package (ffi/python): pip install, pytest (torch in a cached venv, ~/.cache/kspeed/py-venv)"
scripts/test_python.sh 2>&1 | tail -n 15
test "${PIPESTATUS[0]}" = 0

step "fuzz the frame decoder (${KSPEED_FUZZ_SECS:-45} s)"
if require_all; then
  scripts/fuzz.sh "${KSPEED_FUZZ_SECS:-45}" 2>&1 | tail -n 3
  test "${PIPESTATUS[0]}" = 0
else
  KSPEED_FUZZ_OPTIONAL=1 scripts/fuzz.sh "${KSPEED_FUZZ_SECS:-45}" 2>&1 | tail -n 3
fi

step "Miri: the sampler, envelope, frames, schedule, aligned buffer and fault-injecting ring (scripts/miri.sh)"
set +e
scripts/miri.sh 2>&1 | tail -n 25
miri_rc=${PIPESTATUS[0]}
set -e
if [ "$miri_rc" = 2 ]; then
  skipped "Miri is not installed and could not be added (rustup +nightly component add miri rust-src)"
elif [ "$miri_rc" != 0 ]; then
  echo "FAILED: Miri" >&2
  exit 1
fi

VM=${RDMA_VM:-../shared/rdma-vm/run-in-vm.sh}
step "RDMA tests in the soft-RoCE VM ($VM)"
if [ -x "$VM" ]; then
  exe() {  # the test binary of target $1 (built with the default features)
    cargo test --test "$1" --no-run --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$1"
  }
  cargo build --quiet --bin kspeed
  # One VM start for all of them (about 4 s of boot).
  # The VM allows 30 min by default; the two sets take 13-18 min on 2 busy
  # cores (soft-RoCE is emulated), so leave room.
  "$VM" --timeout 3000 -- scripts/vm_rdma_tests.sh "$(exe rdma)" "$(exe cluster)"
else
  skipped "$VM not found (it lives in the shared folder beside the checkout)"
fi
