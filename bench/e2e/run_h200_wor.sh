#!/usr/bin/env bash
# Issue 20 on the GPU machine: wake on request. The same worker (bench/e2e/engine.py, GIB GiB of
# weights, the real driver) put to sleep by tier suspend; then one chat request pinned to it is sent
# while it sleeps, held by the worker (its CUDA calls block), seen on its in-flight gauge (read every
# 50 ms, as the agent's edge reads it) and the wake run at once by one resident agent process; the
# request's own time to its answer beside the same request answered warm and the worker's cold start
# (bench/e2e/wake_e2e.py --on-request).
#
# Usage (repository root of the carried tree, GPU machine, after the parts bench/e2e/split_wheels.sh
# makes were carried into /tmp/e2e-parts, in one call): bash bench/e2e/run_h200_wor.sh [GIB...]
# (default: 1 16). CYCLES (default 3) wakes on request per size, each after ASLEEP_S (default 5) s of
# full sleep. Results in $OUT (default /tmp/dynsnap-e2e-out): wor-<gib>.jsonl, wor.log, logs.txt.
set -uo pipefail
SIZES=${*:-"1 16"}
CYCLES=${CYCLES:-3}
ASLEEP_S=${ASLEEP_S:-5}
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/e2e_env.sh"
rc=0
for gib in $SIZES; do
  echo "== wake on request, $gib GiB" | tee -a "$OUT/wor.log"
  timeout 540 python3 "$ROOT/bench/e2e/wake_e2e.py" --real-driver --device cuda --gib "$gib" --on-request \
    --tier suspend --cycles "$CYCLES" --asleep-s "$ASLEEP_S" --cold-reps 1 --resident-agent --dynamo-python python3 \
    --dynamo-pythonpath /tmp/e2e-py --model-dir "$PARTS/model-tiny" --work /tmp/dynsnap-e2e \
    --out "$OUT/wor-$gib.jsonl" 2>>"$OUT/wor.log" | grep -E '"kind": "(wake|cold|summary|error)"' \
    | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    keep = ("kind", "gib", "cycle", "seen_s", "wake_exec_s", "wake_agent_s", "wake_steps", "first_answer_s",
            "awake_answer_s", "status", "text_same", "answered_before_wake", "wake_first_answer_s",
            "cold_first_answer_s", "error", "ok")
    print(json.dumps({k: d[k] for k in keep if k in d}))' || rc=1
done
e2e_keep_logs 100000
tail -5 "$OUT/wor.log"
echo "rc=$rc"
exit $rc
