#!/bin/bash
# Runs inside the soft-RoCE VM (../shared/rdma-vm/run-in-vm.sh): the RDMA
# test binary, then the cluster tests over RDMA. scripts/test.sh calls it:
#   run-in-vm.sh -- scripts/vm_rdma_tests.sh RDMA_TEST_BIN CLUSTER_TEST_BIN [REBALANCE_TEST_BIN [CLUSTER_MIX_TEST_BIN [AGENT_CLUSTER_TEST_BIN [AGENT_CLUSTER_MIX_TEST_BIN]]]]
set -euo pipefail
rdma_bin=$1
cluster_bin=$2
rebalance_bin=${3:-}
cluster_mix_bin=${4:-}
agent_cluster_bin=${5:-}
agent_cluster_mix_bin=${6:-}
# Nodes 2 to 4 get their own addresses on the RDMA interface (rxe adds a
# RoCE v2 GID for each), so every node has its own GID as on a real cluster.
for ip in 10.77.0.2 10.77.0.3 10.77.0.4; do
  ip addr add "$ip/24" dev "${RDMA_VM_NETDEV:-dummy0}" 2>/dev/null || true
done
# sharded BIN FILTER_ARGS...: BIN's tests (a libtest binary; FILTER_ARGS
# are --skip and name filters) in two processes at once, each one test at a
# time, each line of their output as it comes, marked with its shard (a
# hung test shows which). Most of these tests wait out deadlines
# (failover, restarts, timeouts), which two at a time overlap; outside the
# VM nextest runs them two at a time as well. Run one at a time they took
# over 12 of CI's minutes.
sharded() {
  local bin=$1
  shift
  local names=() shard0=() shard1=() i list
  list=$(mktemp)
  # A file, not a process substitution: the VM has no /dev/fd.
  "$bin" --list --format terse "$@" | sed -n 's/: test$//p' >"$list"
  mapfile -t names <"$list"
  rm -f "$list"
  if [ "${#names[@]}" = 0 ]; then
    echo "FAILED: $bin lists no test for: $*" >&2
    return 1
  fi
  for i in "${!names[@]}"; do
    if [ $((i % 2)) = 0 ]; then shard0+=("${names[$i]}"); else shard1+=("${names[$i]}"); fi
  done
  # pipefail (set above): a shard's status is its test binary's.
  ("$bin" --exact --test-threads 1 "${shard0[@]}" 2>&1 | sed -u 's/^/[shard 0] /') &
  local pid0=$! rc0=0 rc1=0
  if [ "${#shard1[@]}" != 0 ]; then
    "$bin" --exact --test-threads 1 "${shard1[@]}" 2>&1 | sed -u 's/^/[shard 1] /' || rc1=$?
  fi
  wait "$pid0" || rc0=$?
  if [ "$rc0" != 0 ] || [ "$rc1" != 0 ]; then
    echo "FAILED: $bin (shard exits $rc0 and $rc1)" >&2
    return 1
  fi
}
echo "== verbs layer and RDMA end-to-end tests"
# One test at a time: the leak tests count the process's descriptors.
"$rdma_bin" --include-ignored --test-threads 1
echo "== the cluster tests over RDMA (KSPEED_TEST_RDMA=1)"
# Not the ones whose peer is a hand-written TCP node or consumer, nor the
# network-namespace ones (TCP plumbing; a fresh namespace has no RDMA
# netdev): tests/rdma.rs has RDMA's hostile peers. Nor the metrics port's
# own (HTTP clients against a node with no consumer: nothing of theirs
# changes with the transport; the one that counts a consumer runs).
KSPEED_TEST_RDMA=1 sharded "$cluster_bin" \
  --skip hostile_ --skip network_namespaces --skip launcher_node_lists \
  --skip dead_owner_host --skip metrics_port_threads_are_bounded \
  --skip a_full_metrics_port --skip a_metrics_flood --skip metrics_head_gets \
  --skip a_grant_id_used_again
if [ -n "$rebalance_bin" ]; then
  echo "== node services restarted mid-epoch over RDMA (KSPEED_TEST_RDMA=1)"
  KSPEED_TEST_RDMA=1 "$rebalance_bin" --test-threads 1 \
    node_killed_and_restarted a_node_that_comes_back_changed
fi
if [ -n "$cluster_mix_bin" ]; then
  echo "== a mixture of two spaces served side by side, over RDMA (KSPEED_TEST_RDMA=1)"
  KSPEED_TEST_RDMA=1 "$cluster_mix_bin" --test-threads 1 \
    two_ranks_read_a_mixture a_node_killed_mid_epoch
fi
if [ -n "$agent_cluster_bin" ]; then
  echo "== node agents in a cluster, samples pushed by RDMA WRITE into the ranks' shared rings (KSPEED_TEST_RDMA=1)"
  KSPEED_TEST_RDMA=1 sharded "$agent_cluster_bin"
fi
if [ -n "$agent_cluster_mix_bin" ]; then
  echo "== node agents serving a mixture's spaces in a cluster, over RDMA (KSPEED_TEST_RDMA=1)"
  KSPEED_TEST_RDMA=1 "$agent_cluster_mix_bin" --test-threads 1
fi
