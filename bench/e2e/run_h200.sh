#!/usr/bin/env bash
# The end-to-end wake on the GPU machine (bench/e2e/README.md): from the wake request to the first
# pinned answer of a Dynamo worker holding GIB GiB on the GPU, suspended and woken by
# `dynsnap agent exec`, and the cold start of the same worker; bench/e2e/wake_e2e.py does the work.
#
# Usage (repository root, GPU machine, in ONE device call after the parts were carried into
# /tmp/e2e-parts by the calls bench/e2e/split_wheels.sh prints):
#   bash bench/e2e/run_h200.sh [GIB] [CYCLES] [ASLEEP_S] [AGENT]      (default 16 3 60,2,2 exec)
# ASLEEP_S: seconds asleep per cycle, one value or a comma list (the first cycle's 60 s shows the
# file-discovery lease survives a suspend). AGENT: exec (a `dynsnap agent exec` per action, its
# Python start-up in the clock) or resident (one agent process for all, as a node agent runs:
# bench/e2e/resident_agent.py).
# COLD_REPS (default 2): cold starts after the cycles, the first from a dropped page cache.
# Results in $OUT (default /tmp/dynsnap-e2e-out): wake_e2e-GIB[-resident].jsonl (a line per cycle, one
# for the cold start, a summary), wake_e2e-GIB[-resident].log (the driver's stderr), logs.txt (agent,
# frontend, workers).
set -uo pipefail
GIB=${1:-16}; CYCLES=${2:-3}; ASLEEP=${3:-60,2,2}; AGENT=${4:-exec}
case $AGENT in
  exec) MODE=(); TAG="" ;;
  resident) MODE=(--resident-agent); TAG=-resident ;;
  *) echo "AGENT: exec or resident, not $AGENT"; exit 2 ;;
esac
# 1-2. The carried parts reassembled and installed (once per machine), the GPU environment
# (NVLink multicast off, dynsnap-cuda built here, the driver's libraries): bench/e2e/e2e_env.sh.
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/e2e_env.sh"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
# The worker's imports, as it gets them: the machine's torch under the carried packages.
PYTHONPATH=/tmp/e2e-py python3 -c 'import torch, dynamo._core, dynamo.frontend, dynamo.llm; print("dynamo imports")' \
  || { echo "Dynamo (with torch) does not import from /tmp/e2e-py"; exit 1; }

# 3. The measurement: tier suspend, the real driver, the page cache dropped before the cold start.
python3 "$ROOT/bench/e2e/wake_e2e.py" --real-driver --device cuda --gib "$GIB" --cycles "$CYCLES" \
  --asleep-s "$ASLEEP" --dynamo-python python3 --dynamo-pythonpath /tmp/e2e-py --model-dir "$PARTS/model-tiny" \
  --drop-caches --cold-reps "${COLD_REPS:-2}" --work /tmp/dynsnap-e2e "${MODE[@]}" --out "$OUT/wake_e2e-$GIB$TAG.jsonl" \
  2>"$OUT/wake_e2e-$GIB$TAG.log"
rc=$?
e2e_keep_logs 200000
tail -20 "$OUT/wake_e2e-$GIB$TAG.log"
echo "rc=$rc"
exit $rc
