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
OUT="${OUT:-/tmp/dynsnap-e2e-out}"
ROOT=$(pwd)
PARTS=/tmp/e2e-parts
mkdir -p "$OUT"

# 1. Reassemble and install what the parts carried (once per machine: a second run skips it).
if [[ ! -f /tmp/e2e-py/.complete ]]; then
  cat "$PARTS"/e2e-py.tar.xz.* >/tmp/e2e-py.tar.xz
  (cd /tmp && sha256sum -c "$PARTS/SHA256SUMS") || { echo "the parts do not add up: carry them all again"; exit 1; }
  rm -rf /tmp/e2e-py && mkdir -p /tmp/e2e-py && tar -C /tmp/e2e-py -xJf /tmp/e2e-py.tar.xz || exit 1
  touch /tmp/e2e-py/.complete
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/dynsnap-pydeps "$PARTS"/agent-wheels/*.whl \
  >/dev/null 2>&1 || { echo "cannot install the agent's wheels"; exit 1; }

# 2. The GPU environment (NVLink multicast off, dynsnap-cuda built here, the driver's libraries).
# shellcheck disable=SC1091
source "$ROOT/bench/gpu/gpu_env.sh"
export PYTHONPATH="/tmp/dynsnap-pydeps:$ROOT"
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
for f in /tmp/dynsnap-e2e/*.log; do
  [[ -f $f ]] && { echo "== $f"; tail -c 200000 "$f"; }
done >"$OUT/logs.txt" 2>&1
tail -20 "$OUT/wake_e2e-$GIB$TAG.log"
echo "rc=$rc"
exit $rc
