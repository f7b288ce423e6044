#!/usr/bin/env bash
# Regenerates include/kspeed.h from the kspeed-capi crate (capi/) with the
# pinned cbindgen.
#   scripts/gen_header.sh          write it
#   scripts/gen_header.sh --check  fail if the checked-in header differs
set -euo pipefail
cd "$(dirname "$0")/.."
want=0.29.2
if [ "$(cbindgen --version 2>/dev/null | awk '{print $2}')" != "$want" ]; then
  echo "gen_header: installing cbindgen $want" >&2
  cargo install cbindgen --version "$want" --locked --quiet
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# cbindgen reads the kspeed-capi crate only (not its dependencies, kspeed
# included); any message it gives shows.
cbindgen --quiet --config capi/cbindgen.toml --crate kspeed-capi --output "$out" capi
if [ "${1:-}" = "--check" ]; then
  if ! diff -u include/kspeed.h "$out"; then
    echo "include/kspeed.h is out of date: run scripts/gen_header.sh" >&2
    exit 1
  fi
  echo "include/kspeed.h is up to date"
else
  mkdir -p include
  cp "$out" include/kspeed.h
  echo "wrote include/kspeed.h"
fi
