#!/bin/bash
# RDMA push throughput inside the soft-RoCE VM, side by side in one VM run:
#   - kspeed over RDMA: one `kspeed serve --rdma` (1 poller) pushing a
#     preloaded space to one `kspeed read --rdma` (nothing local), with
#     per-grant memory windows (the default where the device has them);
#   - the same with the whole ring under one key (KSPEED_RDMA_WINDOWS=0):
#     the windows' cost;
#   - ib_write_bw (perftest) between the same endpoints (the VM's RoCE
#     address), RC, the same message size (the profile's mean sample size);
#   - kspeed over TCP, same node, same consumer, same address.
# Soft-RoCE under TCG emulation: absolute figures are meaningless, only the
# ratios within one run are. Medians of RUNS runs.
#
#   scripts/bench_rdma.sh [RUNS=3] [COUNT=1000] [PROFILE=imagenet]
#   SPACE=/dev/shm/space scripts/bench_rdma.sh ...   # space in memory (tmpfs)
#   SERVE_FLAGS=--page-cache SPACE=/dev/shm/space ... # node sends from the mapped extents
#
# On the host: generates and catalogs the dataset (release build), then boots
# the VM once; inside, the space is preloaded onto the VM's /tmp (an ext4
# disk, so O_DIRECT works and the page cache is dropped before each kspeed
# run) or onto $SPACE, and everything runs there.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
COUNT=${2:-1000}
PROFILE=${3:-imagenet}
VM=${RDMA_VM:-../shared/rdma-vm/run-in-vm.sh}
WORK=${KSPEED_BENCH_WORK:-/var/tmp/kspeed-bench}/rdma-$PROFILE-$COUNT
cargo build --release --quiet --bin kspeed
K=$PWD/target/release/kspeed
mkdir -p "$WORK"
if [ ! -f "$WORK/cat.ksc" ]; then
  "$K" gen --progress=none --profile "$PROFILE" --count "$COUNT" --out "$WORK/src" >/dev/null
  "$K" catalog --progress=none --source "$WORK/src" --out "$WORK/cat.ksc" >/dev/null
fi
echo "bench-token" > "$WORK/token"
exec "$VM" --share "$WORK" -- bash -c '
set -euo pipefail
K='"$K"'; W='"$WORK"'; RUNS='"$RUNS"'; SP='"${SPACE:-/tmp/space}"'; SF="'"${SERVE_FLAGS:-}"'"
IP=$RDMA_VM_IP; GIDX=$RDMA_VM_GID_INDEX
"$K" preload --progress=none --source "$W/src" --catalog "$W/cat.ksc" --space "$SP" >/dev/null
echo "space: $SP ($(stat -f -c %T "$SP"))"
BYTES=$(python3 -c "import os,sys; print(sum(os.path.getsize(os.path.join(d,f)) for d,_,fs in os.walk(sys.argv[1]) for f in fs))" "$W/src")
MEAN=$(( BYTES / '"$COUNT"' ))
ITERS=$(( 2 * BYTES / MEAN ))   # two epochs worth of messages
echo "dataset: '"$COUNT"' samples, $BYTES bytes, mean $MEAN bytes; each run moves 2 epochs"
serve() {  # $1: extra flags; prints the address
  "$K" serve --space "$SP" --listen "$IP:0" --token-file "$W/token" --pollers 1 $SF $1 > /tmp/serve.out 2>/tmp/serve.err &
  SPID=$!
  for _ in $(seq 100); do grep -q serving /tmp/serve.out 2>/dev/null && break; sleep 0.1; done
  echo "0 $(awk "/serving/ {print \$NF}" /tmp/serve.out)" > /tmp/cluster
}
kread() {  # $1: extra flags; prints MB/s (10^6), from "read N samples, X MiB in S s"
  "$K" read --progress=none --source "$W/src" --catalog "$W/cat.ksc" --cluster /tmp/cluster \
    --token-file "$W/token" --epochs 2 --pollers 1 $1 2>/dev/null | python3 -c "
import re, sys
m = re.search(r\"^read \\d+ samples, ([\\d.]+) (KiB|MiB|GiB) in ([\\d.]+) s\", sys.stdin.read(), re.M)
unit = {\"KiB\": 2**10, \"MiB\": 2**20, \"GiB\": 2**30}[m.group(2)]
print(round(float(m.group(1)) * unit / float(m.group(3)) / 1e6, 2))"
}
for r in $(seq "$RUNS"); do
  sync; echo 3 > /proc/sys/vm/drop_caches
  serve --rdma; k=$(kread --rdma); kill $SPID; wait $SPID 2>/dev/null || true
  sync; echo 3 > /proc/sys/vm/drop_caches
  serve --rdma; k0=$(KSPEED_RDMA_WINDOWS=0 kread --rdma); kill $SPID; wait $SPID 2>/dev/null || true
  ib_write_bw -d rxe0 -x "$GIDX" -s "$MEAN" -n "$ITERS" -F >/tmp/ibs.out 2>&1 &
  IPID=$!; sleep 1
  ib=$(ib_write_bw -d rxe0 -x "$GIDX" -s "$MEAN" -n "$ITERS" -F "$IP" 2>/dev/null \
       | awk "/^ *$MEAN / {print \$4}")
  wait $IPID || true
  sync; echo 3 > /proc/sys/vm/drop_caches
  serve ""; t=$(kread ""); kill $SPID; wait $SPID 2>/dev/null || true
  echo "run $r: kspeed-rdma ${k} MB/s  whole-ring key ${k0} MB/s  ib_write_bw ${ib} MiB/s  kspeed-tcp ${t} MB/s"
  echo "$k $ib $t $k0" >> /tmp/runs
done
grep -h "page-cache mode" /tmp/serve.err || true
python3 - <<PY
import statistics as st
rows = [list(map(float, l.split())) for l in open("/tmp/runs")]
# perftest reports MB/sec in 2^20 bytes.
k = [r[0] for r in rows]; ib = [r[1] * 1.048576 for r in rows]; t = [r[2] for r in rows]; k0 = [r[3] for r in rows]
print("| | median MB/s (10^6) | per run |")
print("|---|---|---|")
print(f"| kspeed over RDMA | {st.median(k):.1f} | {[round(x,1) for x in k]} |")
print(f"| ib_write_bw, same message size | {st.median(ib):.1f} | {[round(x,1) for x in ib]} |")
print(f"| kspeed over RDMA, whole-ring key (no windows) | {st.median(k0):.1f} | {[round(x,1) for x in k0]} |")
print(f"| kspeed over TCP | {st.median(t):.1f} | {[round(x,1) for x in t]} |")
print(f"ratio kspeed-rdma / ib_write_bw: {st.median([a/b for a,b in zip(k,ib)]):.2f}x (median of per-run ratios)")
print(f"ratio kspeed-rdma / kspeed-tcp: {st.median([a/b for a,b in zip(k,t)]):.2f}x")
print(f"ratio windows / whole-ring key: {st.median([a/b for a,b in zip(k,k0)]):.2f}x (the cost of the windows)")
PY
'
