#!/usr/bin/env bash
# Runs the frame-decoding fuzz target for a bounded time (default 60 s).
#   scripts/fuzz.sh [seconds]
# Needs a nightly toolchain and cargo-fuzz (installed from crates.io if
# missing). Without a nightly toolchain it says so and exits 0 only when
# KSPEED_FUZZ_OPTIONAL=1 (CI on machines without nightly); otherwise 1.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz: no nightly toolchain (rustup toolchain install nightly)" >&2
    [ "${KSPEED_FUZZ_OPTIONAL:-0}" = 1 ] && exit 0 || exit 1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked --quiet
fi
mkdir -p fuzz/corpus/frames
# Seed the corpus with valid frames so the fuzzer starts past the magic.
printf 'KS\x04\x00\x03\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x10\x00\x00\x00\x00\x00\x00abc' > fuzz/corpus/frames/data
printf 'KS\x03\x00\x18\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x0a\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00' > fuzz/corpus/frames/grant
cargo +nightly fuzz run frames fuzz/corpus/frames -- -max_total_time="$secs" -max_len=4096
