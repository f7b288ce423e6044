#!/bin/bash
# An attached rank's epoch on a warm node: the agent reading through the
# page cache (--read-page-cache auto, which finds the space cached) against
# O_DIRECT (--read-page-cache off), the page cache warmed before every run,
# the two agents' runs alternated, 3 rounds (or $ROUNDS); samples/s and
# the agent's CPU ticks (10 ms) per epoch.
#   scripts/bench_agent_page_cache.sh SPACE [KSPEED_BIN]
set -e
SP=${1:?usage: $0 SPACE [KSPEED_BIN]}
K=${2:-$(dirname "$0")/../target/release/kspeed}
T=$(mktemp -d)
trap 'kill $A1 $A2 2>/dev/null; rm -rf "$T"' EXIT
$K agent -v --space "$SP" --socket "$T/auto.sock" --read-page-cache auto 2> "$T/auto.log" > /dev/null &
A1=$!
$K agent -v --space "$SP" --socket "$T/off.sock" --read-page-cache off 2> "$T/off.log" > /dev/null &
A2=$!
for i in $(seq 100); do [ -S "$T/auto.sock" ] && [ -S "$T/off.sock" ] && break; sleep 0.1; done
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
for round in $(seq 1 "${ROUNDS:-3}"); do
  for mode in auto off; do
    pid=$A1; [ $mode = off ] && pid=$A2
    cat "$SP"/extents/* > /dev/null
    c0=$(cpu $pid)
    sps=$($K --progress none read --space "$SP" --agent required --agent-socket "$T/$mode.sock" \
      --epochs 1 --batch-size 64 --json 2>/dev/null | python3 -c "import json,sys; print(round(json.load(sys.stdin)['samples_per_sec']))")
    c1=$(cpu $pid)
    echo "round $round page-cache=$mode samples/s=$sps agent_cpu_ticks=$((c1 - c0))"
  done
done
grep -h "reads through the page cache\|reads with O_DIRECT" "$T"/*.log | sed 's/.*agent: //' | sort | uniq -c
