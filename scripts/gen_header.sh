#!/usr/bin/env bash
# Regenerates include/kspeed.h from src/capi with the pinned cbindgen.
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
# cbindgen reads every module and reports two same-named Rust constants
# (loader and serve MAX_POLLERS, protocol and catalog VERSION) as
# "Conflicting name"; constants are not exported to the header
# (cbindgen.toml item_types), so those two lines are dropped. Any other
# message shows.
cbindgen --quiet --config cbindgen.toml --crate kspeed --output "$out" . \
  2> >(grep -v -E '^ERROR: Conflicting name for constant (MAX_POLLERS|VERSION)$' >&2)
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
