#!/usr/bin/env bash
# Runs the unit tests that can run under Miri (no io_uring, sockets or
# verbs): the sampler, the file envelope, the protocol frames, the ring
# schedule, the aligned buffer, and the fault-injecting ring over an
# in-memory backend (reads land through raw pointers as the kernel's would),
# and 3 seeds of three simulations whose backends are all in memory: the
# transport's send and receive sides over MemNet (sim::tests), the RDMA
# link over MemNic, and the RDMA link into RdmaRx with memory windows
# (sim::rdma) (the sims that preload a space need a file system).
# Property tests run 4 cases each (interpreted code is ~1000x slower).
#   scripts/miri.sh
# Needs the nightly toolchain with the miri and rust-src components (it
# tries to add them); without them it says so and exits 2.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  echo "miri: adding the miri and rust-src components to the nightly toolchain" >&2
  timeout 300 rustup +nightly component add miri rust-src >&2 || true
fi
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  echo "miri: not available (rustup +nightly component add miri rust-src)" >&2
  exit 2
fi
export PROPTEST_CASES="${PROPTEST_CASES:-4}"
export KSPEED_SIM_SEEDS="${KSPEED_SIM_SEEDS:-3}"
# Isolation off: the tests read the clock (proptest) and the page size.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
cargo +nightly miri test -p kspeed --lib -- \
  format:: \
  transport::proto:: \
  loader::schedule:: \
  ring::faulty::tests::faulty_backend_over_memory \
  ring::memnet:: \
  sim::tests::sim_transport \
  transport::rdma::sim::sim_rdma_link_over \
  sim::rdma::sim_rdma_rx_over \
  sys::tests::aligned_buf \
  hash:: \
  sampler::tests::frozen_sequence \
  sampler::tests::bad_configs \
  sampler::tests::pytorch_semantics_without_shuffle \
  sampler::tests::positions_round_trip_and_resume
