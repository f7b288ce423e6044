#!/usr/bin/env bash
# Installs the system packages kspeed builds and tests with (Debian/Ubuntu).
# Idempotent: does nothing when everything is already there.
set -euo pipefail
# systemd: systemd-analyze verifies packaging/systemd (tests/packaging.rs).
pkgs=(libibverbs-dev librdmacm-dev ibverbs-providers libclang-dev pkg-config fio util-linux iproute2 procps gcc g++ cmake valgrind systemd)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust (rustup) first" >&2; exit 1; }
