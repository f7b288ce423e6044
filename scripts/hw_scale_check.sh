#!/usr/bin/env bash
# Prepared hardware checks of the scale plan (docs/SCALE.md, issue 28), for
# a node with a real RDMA NIC: what the model derives from mlx5's sizing
# formulas and published NIC-cache figures, measured. Each step prints what
# it measured; compare with docs/SCALE.md ("Verbs memory per connection",
# "The agent as built").
#
#   scripts/hw_scale_check.sh [--device mlx5_0] [--gid-index N] [--qps 1000]
#                             [--threads 1,4,16,64] [--knee "1 16 64 256 1024 4096"]
#                             [--peer HOST | --knee-server]
#
# 1. The model's per-connection figures (examples/scale_model.rs).
# 2. Host memory of --qps RC QPs sized as kspeed sizes them, a link's
#    consumer side (QP, CQ, receive buffers, memory windows) and the node
#    side (examples/qp_scale.rs): RSS, pinned (VmPin) and MemAvailable per QP.
# 3. QP-create latency with 1 to 64 threads creating at once (no windows).
# 4. The QP-count knee: ib_write_bw (perftest) with -q Q queue pairs, 64 KiB
#    writes, for each Q of --knee: where throughput falls as the active QPs
#    outgrow the NIC's context cache. Against --peer HOST (start this script
#    with --knee-server there first), else in loopback on this device (both
#    ends on one NIC: its cache holds both ends' contexts).
#
# Not automated here: the lifetime of a GPU dma-buf registered by the agent
# after the process that exported it dies (needs a GPU and a NIC whose
# driver registers dma-bufs; docs/SCALE.md says what to check by hand).
#
# On soft-RoCE (the project's VM) every step runs, but the figures are the
# kernel's emulation, not a NIC's: that run checks the script.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV="" GID="" QPS=1000 THREADS=1,4,16,64 KNEE="1 16 64 256 1024 4096" PEER="" SERVER=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEV=$2; shift 2 ;;
    --gid-index) GID=$2; shift 2 ;;
    --qps) QPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --knee) KNEE=$2; shift 2 ;;
    --peer) PEER=$2; shift 2 ;;
    --knee-server) SERVER=1; shift ;;
    *) echo "hw_scale_check: unknown argument $1 (see the comment at the top)" >&2; exit 2 ;;
  esac
done
if ! command -v ibv_devinfo >/dev/null; then
  echo "hw_scale_check: ibv_devinfo not found (apt-get install ibverbs-utils rdma-core)" >&2
  exit 2
fi
[ -n "$DEV" ] || DEV=$(ibv_devinfo -l 2>/dev/null | sed -n '2p' | tr -d '[:space:]')
if [ -z "$DEV" ]; then
  echo "hw_scale_check: no RDMA device (ibv_devinfo -l lists none)" >&2
  exit 2
fi
gidarg=()
[ -n "$GID" ] && gidarg=(-x "$GID")
port=18515

if [ "$SERVER" = 1 ]; then
  # The far end of step 4: one server per Q, in the order the client runs.
  for q in $KNEE; do
    echo "knee server: -q $q on port $port"
    ib_write_bw -d "$DEV" "${gidarg[@]}" -q "$q" -s 65536 -D 3 -p "$port" --report_gbits >/dev/null
    port=$((port + 1))
  done
  exit 0
fi

M=target/release/examples/scale_model
Q=target/release/examples/qp_scale
if [ ! -x "$M" ] || [ ! -x "$Q" ]; then
  cargo build --release --quiet --example scale_model --example qp_scale
fi
echo "== device"
ibv_devinfo -d "$DEV" | grep -E "hca_id|fw_ver|vendor_part_id|max_qp:|max_mw|max_cqe|state|active_mtu" || true
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,pci.bus_id --format=csv,noheader || true

echo "== 1. the model's figures per connection (mlx5 formulas)"
"$M" --connections 2>/dev/null | grep -E "^Verbs memory per connection" || true

echo "== 2. host memory of $QPS QPs as kspeed sizes them"
ulimit -l unlimited 2>/dev/null || true
"$Q" --device "$DEV" --qps "$QPS" --threads 1 --side link
"$Q" --device "$DEV" --qps "$QPS" --threads 1 --side node

echo "== 3. QP-create latency, threads creating at once (no windows)"
"$Q" --device "$DEV" --qps "$QPS" --threads "$THREADS" --windows 0

echo "== 4. the QP-count knee (ib_write_bw, 64 KiB writes, 3 s each)"
if ! command -v ib_write_bw >/dev/null; then
  echo "ib_write_bw not found (apt-get install perftest): step 4 skipped" >&2
  exit 2
fi
target=${PEER:-127.0.0.1}
printf '%8s  %s\n' "QPs" "Gb/s (BW average)"
for q in $KNEE; do
  if [ -z "$PEER" ]; then
    ib_write_bw -d "$DEV" "${gidarg[@]}" -q "$q" -s 65536 -D 3 -p "$port" --report_gbits >/dev/null 2>&1 &
    srv=$!
    sleep 1
  else
    sleep 2   # the server's next run starts after its last one ended
  fi
  out=$(ib_write_bw -d "$DEV" "${gidarg[@]}" -q "$q" -s 65536 -D 3 -p "$port" --report_gbits "$target" 2>&1) || true
  [ -z "$PEER" ] && { wait "$srv" 2>/dev/null || true; }
  bw=$(printf '%s\n' "$out" | awk '$1 == 65536 { print $4 }' | tail -1)
  printf '%8s  %s\n' "$q" "${bw:-failed: $(printf '%s' "$out" | tail -1)}"
  port=$((port + 1))
done
