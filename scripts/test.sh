#!/usr/bin/env bash
# The whole test suite, on a fresh machine: system packages, formatting,
# lints (with and without the rdma feature), rustdoc, the import-cycle
# check, the header and public API listing drift checks, every test (the
# cluster tests start `kspeed serve` processes on 127.0.0.x and, as root, in
# network namespaces), those over TCP links again without the rdma feature,
# the simulations with more seeds, the frame-decoding fuzz
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
# --test-tools: s3s-fs (a real S3 server for tests/s3.rs) and boto3/awscli in
# the Python venv (ffi/python/tests/test_s3.py).
bash scripts/setup.sh --test-tools
export CARGO_TERM_COLOR=never
# CI builds once from a clean clone, so incremental caches (about as large as
# the rest of target/debug) and pip's download cache (torch's CUDA wheels,
# gigabytes) only cost disk; a CI run out of disk failed before.
if [ -n "${CI:-}" ]; then
  export CARGO_INCREMENTAL=0 PIP_NO_CACHE_DIR=1
fi
tmp_dir=${TMPDIR:-/tmp}
free_mib() { df -Pm "$1" | awk 'NR == 2 { print $4 }'; }
# Each step says how much disk is left, so a run that fills the disk shows
# which step did it, and how long the one before it took, so a run that
# grows slower shows which step grew (.ci/run is kept under 45 minutes).
step_started_s=$SECONDS
step() {
  echo
  echo "   (that step took $((SECONDS - step_started_s)) s; $((SECONDS / 60)) min since the start)"
  step_started_s=$SECONDS
  echo "== $*"
  echo "   (free: $(free_mib .) MiB here, $(free_mib "$tmp_dir") MiB in $tmp_dir)"
}
# quiet LOG CMD...: CMD's output goes to LOG; its tail is shown, a longer
# one when it fails (a failing pytest's report is longer than 15 lines).
quiet() {
  local log=$1
  shift
  mkdir -p "$(dirname "$log")"
  if "$@" >"$log" 2>&1; then
    tail -n 15 "$log"
  else
    local rc=$?
    tail -n 300 "$log"
    echo "FAILED (exit $rc): $*; the whole output is in $log" >&2
    return "$rc"
  fi
}
# need_disk MIB DIR WHAT: fail with a named reason, not a failure deep inside
# the step, when DIR has less than MIB MiB free.
need_disk() {
  local have
  have=$(free_mib "$2")
  if [ "$have" -lt "$1" ]; then
    echo "FAILED: $3 needs about $1 MiB free in $2; $have MiB are left (df -h $2)" >&2
    exit 1
  fi
}
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
step "no import cycles between source files (scripts/import_cycles.py)"
python3 scripts/import_cycles.py
step "every source file over 800 lines says why at its top"
long_unexplained=0
while IFS= read -r f; do
    # grep -n over the whole file, not `head | grep -q`: under pipefail,
    # grep -q leaving early can kill head with SIGPIPE and fail the check.
    why_line=$(grep -n -m1 "Why this file is over ~800 lines" "$f" | cut -d: -f1 || true)
    if [ "$(wc -l < "$f")" -gt 800 ] && ! { [ -n "$why_line" ] && [ "$why_line" -le 80 ]; }; then
        echo "FAILED: $f has $(wc -l < "$f") lines and no 'Why this file is over ~800 lines' in its first 80" >&2
        long_unexplained=1
    fi
done < <(git ls-files '*.rs')
[ "$long_unexplained" = 0 ]
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
# Without the rdma feature only the links differ (the node service's
# acceptor and pollers, the consumer's network thread and the agent's
# cluster links: TCP alone, not an enum over TCP and RDMA; src/transport,
# src/agent/cluster.rs), so this step runs the library's tests and the test
# binaries that put those links between real processes; the others run the
# same code either way and run in the next step. Every target of every
# feature set is compiled by the clippy step above. Running them all here
# as well took 328 of CI's seconds, 260 of them the same tests again.
step "tests without the rdma feature: the library, and the tests over TCP links between processes"
"${runner[@]}" -p kspeed --no-default-features --features cli,test-panic --lib \
  --test cluster --test cluster_mix --test agent_cluster --test agent_links \
  --test consumer_links --test rebalance --test independent_owner --test serve_foreign
# The library's sim:: tests are the next step's, with more seeds, on this
# same build: not run twice.
step "tests (default features; the simulations in the next step)"
if [ "${runner[0]}" = cargo ] && [ "${runner[1]}" = nextest ]; then
  "${runner[@]}" --workspace --features test-panic -E 'not (binary(kspeed) & test(sim::))'
else
  "${runner[@]}" --workspace --features test-panic -- --skip sim::
fi

step "simulator: the transport, the node service's pollers, the consumer's network thread, the cluster (real nodes and ranks together), the RDMA link, and the RDMA link into the consumer's RdmaRx (memory windows) over the in-memory backends, up to ${KSPEED_SIM_SEEDS:-2000} seeds each, each stopping at ${KSPEED_SIM_BUDGET_S:-75} s (KSPEED_SIM_SEED=n replays a failing seed)"
# The unit tests above ran their defaults (200 to 2,000 seeds; sim::serve's
# many-slots test 3); this runs more, on the same build: sim::tests (TcpLink against
# FrameRx), sim::serve (the real serve pollers and scripted consumers, and
# a poller with thousands of staging slots against its completion queue),
# sim::net (the real network thread against scripted nodes), sim::cluster
# (2-3 real node services and 1-3 real rank network threads together),
# transport::rdma::sim (RdmaLink over MemNic and FaultyQueue; the filter
# matches it too), sim::rdma (RdmaLink writing into the real RdmaRx, its
# memory windows bound and invalidated through WorkQueue on MemNic).
KSPEED_SIM_SEEDS="${KSPEED_SIM_SEEDS:-2000}" KSPEED_SIM_BUDGET_S="${KSPEED_SIM_BUDGET_S:-75}" \
  "${runner[@]}" --features test-panic --lib sim::

step "C++ example against an installed package (CMake, pkg-config, static)"
scripts/test_cpp.sh

step "DALI plugin (fn.kspeed.reader) against the DALI wheel, CPU only"
if [ "${KSPEED_SKIP_DALI:-0}" = 1 ]; then
  skipped "KSPEED_SKIP_DALI=1"
else
  quiet target/ci-logs/dali.log ffi/dali/build_and_test.sh
  if [ -n "${CI:-}" ]; then rm -rf target/dali-venv target/dali-build target/dali-prefix; fi
fi

step "Python package (ffi/python): pip install, pytest (torch in a cached venv, ~/.cache/kspeed/py-venv)"
# The release CLI the C++ step's install built (default features): no
# second, debug build of the crate for the Python tests. CARGO_TARGET_DIR:
# the extension and the command the wheel carries (and clippy of the
# extension crate) build in this checkout's target/, reusing the
# dependencies the steps above built with the same versions and features
# (ffi/python/Cargo.lock pins the root's), where ffi/python/target built
# them all again: the step took 408 s, about 200 s of it that second build.
# The wheel's CLI is built with the default features (cli, s3, rdma), as
# target/release/kspeed was, so cargo finds it fresh and the tests'
# KSPEED_BIN is that same binary.
KSPEED_BIN="$PWD/target/release/kspeed" CARGO_TARGET_DIR="$PWD/target" \
  quiet target/ci-logs/python.log scripts/test_python.sh
if [ -n "${CI:-}" ]; then rm -rf ffi/python/target; fi

step "fuzz the frame decoder (${KSPEED_FUZZ_SECS:-45} s)"
if require_all; then
  scripts/fuzz.sh "${KSPEED_FUZZ_SECS:-45}" 2>&1 | tail -n 3
  test "${PIPESTATUS[0]}" = 0
else
  KSPEED_FUZZ_OPTIONAL=1 scripts/fuzz.sh "${KSPEED_FUZZ_SECS:-45}" 2>&1 | tail -n 3
fi

step "Miri: the sampler, envelope, frames, schedule, hashes, aligned buffer, fault-injecting ring, MemNet, and 3 seeds of the transport, RDMA link and RDMA link-into-RdmaRx simulations (scripts/miri.sh)"
set +e
scripts/miri.sh 2>&1 | tail -n 25
miri_rc=${PIPESTATUS[0]}
set -e
# CI: what later steps do not use goes, to leave disk for the VM's scratch
# disk (a local run keeps them for the next, faster run).
if [ -n "${CI:-}" ]; then rm -rf target/miri fuzz/target; fi
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
  # The VM's /tmp is a sparse disk file in the host's $TMPDIR; the tests
  # write their datasets there.
  need_disk 2048 "$tmp_dir" "the RDMA VM"
  # One VM start for all of them (about 4 s of boot).
  # The VM allows 30 min by default; the two sets take 13-18 min on 2 busy
  # cores (soft-RoCE is emulated), so leave room. 4G: the cluster tests run
  # two at a time in there (scripts/vm_rdma_tests.sh), each with its nodes'
  # registered rings.
  "$VM" --timeout 3000 --mem 4G -- scripts/vm_rdma_tests.sh "$(exe rdma)" "$(exe cluster)" "$(exe rebalance)" "$(exe cluster_mix)" "$(exe agent_cluster)" "$(exe agent_cluster_mix)"
else
  skipped "$VM not found (it lives in the shared folder beside the checkout)"
fi
echo "   (that step took $((SECONDS - step_started_s)) s; the whole suite took $((SECONDS / 60)) min $((SECONDS % 60)) s)"
