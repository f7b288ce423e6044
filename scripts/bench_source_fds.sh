#!/bin/bash
# Source mode, old vs new binary (BENCHMARKS.md, "Source mode: a source file
# or tar shard opened once"): run as root in a directory holding `dir` (an
# ImageFolder tree) with dir.ksc and `tar` (WebDataset shards) with tar.ksc,
# with the binaries at /tmp/kspeed-old and /tmp/kspeed-new.
#   scripts/bench_source_fds.sh RUNS
# One line per run: binary, set, wall seconds, CPU seconds, loop stalls
# ('-' for a binary without the counter), samples. Cold page cache each run.
set -euo pipefail
for _ in $(seq 1 "${1:-5}"); do
  for b in old new; do
    for d in dir tar; do
      if [ "$d" = dir ]; then src=dir; ep=5; else src=tar:tar; ep=1; fi
      sync; echo 3 > /proc/sys/vm/drop_caches
      s=$(/tmp/kspeed-$b read --progress none --json --source "$src" --catalog "$d.ksc" --epochs "$ep" 2>/dev/null |
        python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["seconds"], j["cpu_seconds"], j.get("loop_stalls","-"), j["samples"])')
      echo "$b $d $s"
    done
  done
done
