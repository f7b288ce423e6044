#!/bin/bash
# A mixture that upsamples a small dataset, read with and without a memory
# tier the size of that dataset (issue 28/31: a memory tier over a
# mixture, its members chosen by the mixture's known draws). One rank,
# embedded, cold page cache before every run (storage is measured), the two
# modes alternated and their order swapped each round, 3 rounds (or
# $ROUNDS); per run the samples/s of epoch 0 and of epochs 1 to E-1
# together, the tier hits and disk reads, and the process's CPU seconds.
#   scripts/bench_mix_tier.sh SPACE_A SPACE_B [MIX] [EPOCHS] [KSPEED_BIN]
# MIX is kspeed read's --mix weights in the order A,B (default
# choose=N_A/2,repeat=4: half of A an epoch, B four times); EPOCHS
# default 3. The tier is B's bytes plus 1 MiB (every sample's slot is its
# length rounded up to 64 bytes).
set -e
A=${1:?usage: $0 SPACE_A SPACE_B [MIX] [EPOCHS] [KSPEED_BIN]}
B=${2:?usage: $0 SPACE_A SPACE_B [MIX] [EPOCHS] [KSPEED_BIN]}
K=${5:-$(dirname "$0")/../target/release/kspeed}
EPOCHS=${4:-3}
count() { $K inspect --space "$1" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["catalog"]["samples"])'; }
NA=$(count "$A")
W=${3:-choose=$((NA / 2)),repeat=4}
MIX="$A:${W%%,*},$B:${W#*,}"
TIER=$($K inspect --space "$B" --json | python3 -c '
import json, sys
c = json.load(sys.stdin)["catalog"]
print(c["total_bytes"] + 64 * c["samples"] + (1 << 20))')
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
run() { # mode: none | tier
  local mode=$1 extra=()
  [ "$mode" = tier ] && extra=(--tier-bytes "$TIER")
  sync; echo 3 > /proc/sys/vm/drop_caches
  /usr/bin/time -f "%U %S" -o "$T/cpu" $K --progress none read --mix "$MIX" \
    --seed 7 --epochs "$EPOCHS" --batch-size 64 --json "${extra[@]}" > "$T/out" 2> "$T/err" \
    || { cat "$T/err"; exit 1; }
  python3 - "$T" "$mode" <<'EOF'
import json, sys
t, mode = sys.argv[1], sys.argv[2]
r = json.load(open(f"{t}/out"))
ep = r["per_epoch"]
later = ep[1:]
n1 = sum(e["samples"] for e in later)
s1 = sum(e["seconds"] for e in later)
cpu = sum(map(float, open(f"{t}/cpu").read().split()[:2]))
hits = sum(e["tier_hits"] for e in ep)
disk = sum(e["disk_reads"] for e in ep)
print(f"{mode} epoch0_samples/s={ep[0]['samples'] / ep[0]['seconds']:.0f} "
      f"later_samples/s={n1 / s1:.0f} tier_hits={hits} disk_reads={disk} cpu_s={cpu:.2f}")
EOF
}
echo "mixture $MIX, $EPOCHS epochs, tier $TIER bytes"
for round in $(seq 1 "${ROUNDS:-3}"); do
  if [ $((round % 2)) = 1 ]; then order="none tier"; else order="tier none"; fi
  for mode in $order; do
    line=$(run "$mode") || { echo "$line"; exit 1; }
    echo "round $round $line"
  done
done
