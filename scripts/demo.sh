#!/usr/bin/env bash
# The main job on the embedded default, on a fresh machine: build kspeed,
# generate a small ImageFolder dataset, preload it into a space, verify it,
# then read epochs through the loader (io_uring pollers into the landing
# ring) and report throughput. Usage: scripts/demo.sh [WORKDIR]
# (default /tmp/kspeed-demo)
# Environment: COUNT (samples, default 2000), PROFILE (default imagenet).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --quiet
K=target/release/kspeed
W=${1:-/tmp/kspeed-demo}
COUNT=${COUNT:-2000}
PROFILE=${PROFILE:-imagenet}
mkdir -p "$W"
echo "== gen: $COUNT $PROFILE samples into $W/src"
$K gen --profile "$PROFILE" --count "$COUNT" --out "$W/src" --seed 1
echo "== preload into $W/space (cold page cache where permitted)"
sync; (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null || echo "(cannot drop caches: not root)"
$K preload --source "$W/src" --space "$W/space"
echo "== preload again (idempotent)"
$K preload --source "$W/src" --space "$W/space"
echo "== verify"
$K verify --space "$W/space"
echo "== inspect"
$K inspect --space "$W/space"
echo "== read 3 epochs (cold page cache for the first where permitted)"
sync; (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null || true
$K read --space "$W/space" --epochs 3 --batch-size 64 --ring-bytes 128MiB
