#!/bin/bash
# The node agent over RDMA in the soft-RoCE VM, side by side in one VM run:
#   - NODES agents x RANKS attached ranks (bench_agent.py --rdma), each
#     agent its node's node service, every rank's samples from the other
#     nodes by RDMA WRITE into its shared ring: first with each rank's own
#     links (KSPEED_AGENT_LINKS=per-rank), then over the agents' shared
#     links; RC queue pairs counted with `rdma res show qp`;
#   - ib_write_bw (perftest) between the VM's RoCE address and itself, RC,
#     the profile's mean sample size, as many messages as one epoch's.
# Soft-RoCE under TCG emulation: absolute figures are meaningless, only the
# ratios within one run are.
#
#   scripts/bench_agent_rdma.sh [NODES=4] [RANKS=4] [COUNT=2000] [RUNS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${1:-4}
RANKS=${2:-4}
COUNT=${3:-2000}
RUNS=${4:-3}
VM=${RDMA_VM:-../shared/rdma-vm/run-in-vm.sh}
WORK=${KSPEED_BENCH_WORK:-/var/tmp/kspeed-bench}/agent-rdma-$COUNT-$NODES
cargo build --release --quiet --bin kspeed
mkdir -p "$WORK"
exec "$VM" --timeout 3000 --share "$WORK" -- bash -c '
set -euo pipefail
NODES='"$NODES"'; RANKS='"$RANKS"'; COUNT='"$COUNT"'; RUNS='"$RUNS"'; W='"$WORK"'
for i in $(seq 2 "$NODES"); do
  ip addr add "10.77.0.$i/24" dev "${RDMA_VM_NETDEV:-dummy0}" 2>/dev/null || true
done
python3 scripts/bench_agent.py --rdma --hosts 10.77.0 --nodes "$NODES" --ranks "$RANKS" \
  --profile "imagenet:$COUNT" --epochs 2 --runs "$RUNS" --ring-bytes 32MiB \
  --compare-env KSPEED_AGENT_LINKS=per-rank,shared --work "$W" | grep -v "^\[{"
SRC="$W/imagenet-$COUNT"
BYTES=$(python3 -c "import os,sys; print(sum(os.path.getsize(os.path.join(d,f)) for d,_,fs in os.walk(sys.argv[1]) for f in fs))" "$SRC")
MEAN=$(( BYTES / COUNT ))
for r in $(seq "$RUNS"); do
  ib_write_bw -d rxe0 -x "$RDMA_VM_GID_INDEX" -s "$MEAN" -n "$COUNT" -F >/tmp/ibs.out 2>&1 &
  IPID=$!; sleep 1
  ib=$(ib_write_bw -d rxe0 -x "$RDMA_VM_GID_INDEX" -s "$MEAN" -n "$COUNT" -F "$RDMA_VM_IP" 2>/dev/null \
       | awk "/^ *$MEAN / {print \$4}")
  wait $IPID || true
  echo "ib_write_bw run $r: $ib MiB/s at $MEAN-byte messages ($(python3 -c "print(round($ib * 2**20 / 1e9, 3))") GB/s)"
done
'
