#!/usr/bin/env bash
# The GPU check of the local data path, for a machine with an NVIDIA GPU
# (the device tool's machine, or any other): generates a small ImageNet-like
# dataset, preloads it, then runs examples/gpu_copy.rs, which copies every
# batch from the CUDA-registered landing ring to GPU memory and the same
# bytes from pageable memory, and prints GB/s for both. Prints what it
# measured (then the GPU-ring memory: allocation, round trip, dma-buf
# export) and exits 0 (the example says "skipped" where CUDA or a device is
# missing); a CUDA error exits non-zero.
#
#   scripts/gpu_check.sh [COUNT=5000] [WORKDIR=/tmp/kspeed-gpu]
#
# Uses target/release/kspeed and target/release/examples/gpu_copy when they
# exist (built elsewhere and carried along; no toolchain needed), else
# builds them.
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${1:-5000}
W=${2:-/tmp/kspeed-gpu}
K=target/release/kspeed
G=target/release/examples/gpu_copy
if [ ! -x "$K" ] || [ ! -x "$G" ]; then
  cargo build --release --quiet --bin kspeed --example gpu_copy
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,pci.bus_id,memory.total --format=csv,noheader || echo "nvidia-smi: not found"
rm -rf "$W"; mkdir -p "$W"
"$K" gen --progress=none --profile imagenet --count "$COUNT" --out "$W/src" --seed 1
"$K" preload --progress=none --source "$W/src" --space "$W/space"
# memlock: the ring is mlocked; lift the limit where we may.
ulimit -l unlimited 2>/dev/null || true
"$G" "$W/space" 3 256
