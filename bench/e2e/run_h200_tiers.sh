#!/usr/bin/env bash
# Issue 21 on the GPU machine: the same worker (bench/e2e/engine.py, GIB GiB of weights) put to sleep
# and woken by tier suspend (the driver's checkpoint: every allocation, written or not, copied to host
# memory) and by tier engine (the engine's own routes: the weights to pinned host memory, the KV pool
# freed), with no pool and with never-written KV pools, one run per (tier, pool), each a capture, a
# sleep of 2 s, a wake and the first pinned answer (bench/e2e/wake_e2e.py --resident-agent: one agent
# process for every action, as a node agent).
#
# Usage (repository root of the carried tree, GPU machine, after the parts bench/e2e/split_wheels.sh
# makes were carried into /tmp/e2e-parts, in one call): bash bench/e2e/run_h200_tiers.sh [GIB]
# RUNS (default "suspend:0 engine:0 suspend:48 engine:48 engine:96"): tier:pool-GiB pairs. Tier suspend
# with a 96 GiB pool is not in the default: its host copy (112 GiB) does not fit the 128 GiB of the
# one-GPU machine lent (the two-GPU one, 256 GiB, is withheld).
# Results in $OUT (default /tmp/dynsnap-e2e-out): tiers-<tier>-<pool>.jsonl, tiers.log, logs.txt.
set -uo pipefail
GIB=${1:-16}
RUNS=${RUNS:-"suspend:0 engine:0 suspend:48 engine:48 engine:96"}
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/e2e_env.sh"
free -g | head -2
rc=0
for run in $RUNS; do
  tier=${run%%:*}; pool=${run##*:}
  echo "== tier $tier, pool $pool GiB" | tee -a "$OUT/tiers.log"
  timeout 420 python3 "$ROOT/bench/e2e/wake_e2e.py" --real-driver --device cuda --gib "$GIB" --kv-gib "$pool" \
    --tier "$tier" --cycles 1 --asleep-s 2 --cold-reps 0 --resident-agent --dynamo-python python3 \
    --dynamo-pythonpath /tmp/e2e-py --model-dir "$PARTS/model-tiny" --work /tmp/dynsnap-e2e \
    --out "$OUT/tiers-$tier-$pool.jsonl" 2>>"$OUT/tiers.log" | grep -E '"kind": "(wake|summary|error)"' \
    | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    keep = ("kind", "tier", "kv_gib", "capture_s", "wake_agent_s", "first_answer_s", "text_same", "gpu_awake",
            "gpu_asleep", "host_memory_asleep", "wake_steps", "error", "ok")
    print(json.dumps({k: d[k] for k in keep if k in d}))' || rc=1
done
e2e_keep_logs 100000
tail -5 "$OUT/tiers.log"
echo "rc=$rc"
exit $rc
