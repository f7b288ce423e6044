#!/usr/bin/env bash
# The public Rust API of the kspeed crate (default features), one item per
# line, checked in as api/kspeed.txt so every change to it shows in review.
#   scripts/api_listing.sh          rewrite api/kspeed.txt
#   scripts/api_listing.sh --check  fail if api/kspeed.txt differs (CI)
# Built from nightly rustdoc's JSON output (rustup toolchain nightly, which
# scripts/miri.sh uses too) and rendered by scripts/api_listing.py; its own
# target directory (target/api) keeps it apart from the stable builds.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "api_listing: needs the nightly toolchain (rustup toolchain install nightly)" >&2
  exit 2
fi
export CARGO_TARGET_DIR=${KSPEED_API_TARGET_DIR:-$PWD/target/api}
RUSTDOCFLAGS="-Z unstable-options --output-format json" \
  cargo +nightly doc -p kspeed --lib --no-deps --quiet
out=$(mktemp)
trap 'rm -f "$out"' EXIT
python3 scripts/api_listing.py "$CARGO_TARGET_DIR/doc/kspeed.json" > "$out"
if [ "${1:-}" = "--check" ]; then
  if ! diff -u api/kspeed.txt "$out"; then
    cat >&2 <<MSG
api/kspeed.txt is out of date: the public Rust API changed (diff above:
- lines left the API, + lines joined it). If the change is intended, run
scripts/api_listing.sh and commit api/kspeed.txt with it; if not, make the
new items pub(crate) or private.
MSG
    exit 1
  fi
  echo "api/kspeed.txt is up to date ($(wc -l < "$out") items)"
else
  mkdir -p api
  cp "$out" api/kspeed.txt
  echo "wrote api/kspeed.txt ($(wc -l < "$out") items)"
fi
