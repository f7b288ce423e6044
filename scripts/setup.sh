#!/usr/bin/env bash
# Installs the system packages kspeed builds and tests with (Debian/Ubuntu).
# Idempotent: does nothing when everything is already there. With
# --test-tools (scripts/test.sh) also the S3 and HTTP test tools: s3s-fs,
# nginx-light and, in the Python venv, boto3 and the AWS CLI (below).
set -euo pipefail
# systemd: systemd-analyze verifies packaging/systemd (tests/packaging.rs).
pkgs=(libibverbs-dev librdmacm-dev ibverbs-providers libclang-dev pkg-config fio util-linux iproute2 procps gcc g++ cmake valgrind systemd)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust (rustup) first" >&2; exit 1; }

# --test-tools (scripts/test.sh passes it; the demo does not need them): what
# the S3 source tests need besides the system packages.
if [ "${1:-}" = --test-tools ]; then
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/kspeed
  # A real S3 server for tests/s3.rs, ffi/python/tests/test_s3.py and
  # scripts/bench_s3.py: s3s-fs, the s3s project's S3 server over a local
  # directory (SigV4 auth, ListObjectsV2 pages of 1,000, ranged GETs, real
  # S3 error codes), one small Rust binary with no daemon or Docker; on
  # crates.io, so `cargo install` is how a fresh machine gets it (no
  # prebuilt downloads here). Pinned to 0.14.1: 0.17 needs rustc 1.96 and
  # this toolchain is 1.95; --locked builds its own tested dependency set.
  s3s_version=0.14.1
  s3s=$cache/s3s/bin/s3s-fs
  if ! { [ -x "$s3s" ] && "$s3s" --version 2>/dev/null | grep -F " $s3s_version" >/dev/null; }; then
    echo "setup: cargo install s3s-fs $s3s_version into $cache/s3s (a few minutes, once)"
    cargo install s3s-fs --version "$s3s_version" --features binary --locked \
      --root "$cache/s3s" --quiet
  fi
  # A real web server for tests/http_source.rs (https:// and http://
  # sources): Debian's nginx-light, started by the test on loopback ports
  # with its own configuration (the package's service is not used).
  if ! dpkg-query -W -f='${Status}' nginx-light 2>/dev/null | grep "install ok installed" >/dev/null; then
    echo "setup: installing nginx-light"
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx-light openssl >/dev/null
  fi
  # boto3 and the AWS CLI, pinned, in the Python venv the suite uses
  # (scripts/test_python.sh; KSPEED_PY_VENV): the independent S3 client of
  # ffi/python/tests/test_s3.py and scripts/bench_s3.py.
  venv=${KSPEED_PY_VENV:-$cache/py-venv}
  mkdir -p "$(dirname "$venv")"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  aws_pins=(boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 awscli==1.46.2)
  if ! "$venv/bin/python" -c 'import sys, boto3, botocore, s3transfer, awscli
want = dict(a.split("==") for a in sys.argv[1:])
have = {"boto3": boto3.__version__, "botocore": botocore.__version__, "s3transfer": s3transfer.__version__, "awscli": awscli.__version__}
sys.exit(have != want)' "${aws_pins[@]}" 2>/dev/null; then
    echo "setup: pip install ${aws_pins[*]} into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${aws_pins[@]}"
  fi
fi
