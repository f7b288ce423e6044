#!/bin/bash
# A mixture of two spaces read by the node's ranks through one agent that
# serves both (`kspeed agent --space A --space B`) against the same ranks
# embedded (each its own pollers), cold page cache before every run
# (storage is measured), the two modes alternated and their order swapped
# each round, 3 rounds (or $ROUNDS); per run the node's samples/s (every
# rank's samples over the wall time from the first start to the last end)
# and the CPU seconds of the ranks and the agent.
#   scripts/bench_agent_mix.sh SPACE_A SPACE_B [MIX] [RANKS] [KSPEED_BIN]
# MIX is kspeed read's --mix weights in the order A,B (default
# repeat=1,choose=N_A: as many samples of B as A has); RANKS default 2;
# $AGENT_ARGS are added to the agent's arguments (e.g. --node-pollers 2).
set -e
A=${1:?usage: $0 SPACE_A SPACE_B [MIX] [RANKS] [KSPEED_BIN]}
B=${2:?usage: $0 SPACE_A SPACE_B [MIX] [RANKS] [KSPEED_BIN]}
K=${5:-$(dirname "$0")/../target/release/kspeed}
RANKS=${4:-2}
NA=$($K inspect --space "$A" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["catalog"]["samples"])')
W=${3:-repeat=1,choose=$NA}
WA=${W%%,*}
WB=${W#*,}
MIX="$A:$WA,$B:$WB"
T=$(mktemp -d)
trap 'kill $AG 2>/dev/null; rm -rf "$T"' EXIT
# shellcheck disable=SC2086 # AGENT_ARGS are words
$K agent -v --space "$A" --space "$B" --socket "$T/agent.sock" ${AGENT_ARGS:-} 2> "$T/agent.log" > /dev/null &
AG=$!
for i in $(seq 100); do [ -S "$T/agent.sock" ] && break; sleep 0.1; done
[ -S "$T/agent.sock" ] || { cat "$T/agent.log"; exit 1; }
ticks() { awk '{print $14+$15}' /proc/$1/stat; }
run() { # mode: attached | embedded
  local mode=$1 agent=off pids=() t0 t1 a0 a1
  [ "$mode" = attached ] && agent=required
  sync; echo 3 > /proc/sys/vm/drop_caches
  a0=$(ticks $AG)
  t0=$(date +%s.%N)
  for r in $(seq 0 $((RANKS - 1))); do
    /usr/bin/time -f "%U %S" -o "$T/cpu.$r" $K --progress none read --mix "$MIX" \
      --rank $r --world $RANKS --seed 7 --epochs 1 --batch-size 64 --json \
      --agent $agent --agent-socket "$T/agent.sock" > "$T/out.$r" 2> "$T/err.$r" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p || { cat "$T"/err.*; exit 1; }; done
  t1=$(date +%s.%N)
  a1=$(ticks $AG)
  python3 - "$T" "$RANKS" "$t0" "$t1" "$((a1 - a0))" "$mode" <<'EOF'
import json, sys
t, ranks, t0, t1, agent_ticks, mode = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
n = sum(json.load(open(f"{t}/out.{r}"))["samples"] for r in range(ranks))
cpu = sum(sum(map(float, open(f"{t}/cpu.{r}").read().split()[:2])) for r in range(ranks))
agent = agent_ticks / 100 if mode == "attached" else 0.0
print(f"{mode} samples={n} wall_s={t1 - t0:.2f} samples/s={n / (t1 - t0):.0f} rank_cpu_s={cpu:.2f} agent_cpu_s={agent:.2f}")
EOF
}
echo "mixture $MIX, $RANKS ranks"
for round in $(seq 1 "${ROUNDS:-3}"); do
  if [ $((round % 2)) = 1 ]; then order="attached embedded"; else order="embedded attached"; fi
  for mode in $order; do
    line=$(run "$mode") || { echo "$line"; exit 1; }
    echo "round $round $line"
  done
done
