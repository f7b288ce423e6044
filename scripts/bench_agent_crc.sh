#!/bin/bash
# What an attached rank's verify_crc32c costs the node agent: a ring in
# shared memory (the agent computes the CRC in place) against one in 2 MiB
# hugetlb pages (the agent reads it through the kernel, process_vm_readv
# 32 KiB at a time, so a page the rank punched out cannot SIGBUS it), each
# with --verify and without, rotated, 3 rounds; the agent's CPU ticks
# (/proc/PID/stat utime+stime, 10 ms) per epoch and the rank's samples/s.
# Root (it sets vm.nr_hugepages, restored at the end).
#   scripts/bench_agent_crc.sh SPACE [KSPEED_BIN]
set -e
SP=${1:?usage: $0 SPACE [KSPEED_BIN]}
K=${2:-$(dirname "$0")/../target/release/kspeed}
cd /tmp && rm -f cb.sock
cat $SP/extents/* > /dev/null
$K agent --space $SP --socket /tmp/cb.sock > /tmp/cb.out 2> /tmp/cb.err &
AP=$!
for i in $(seq 100); do [ -S /tmp/cb.sock ] && break; sleep 0.1; done
cpu() { awk '{print $14+$15}' /proc/$AP/stat; }
H0=$(cat /proc/sys/vm/nr_hugepages)
for round in 1 2 3; do
 for mode in shm-off shm-verify huge-off huge-verify; do
  case $mode in shm-*) echo $H0 > /proc/sys/vm/nr_hugepages;; huge-*) echo $((H0+40)) > /proc/sys/vm/nr_hugepages;; esac
  v=""; case $mode in *verify) v="--verify";; esac
  c0=$(cpu)
  out=$($K --progress none -v read --space $SP --agent required --agent-socket /tmp/cb.sock --ring-bytes 64MiB --epochs 1 --batch-size 64 --json $v 2>/tmp/cb.rerr)
  c1=$(cpu)
  pages=$(grep -c '(hugetlb)' /tmp/cb.rerr)
  sps=$(echo "$out" | python3 -c "import json,sys; v=json.load(sys.stdin); print(round(v['samples_per_sec']))")
  echo "$round $mode samples/s=$sps agent_cpu_ticks=$((c1-c0)) [$pages]"
 done
done
echo $H0 > /proc/sys/vm/nr_hugepages
kill $AP
