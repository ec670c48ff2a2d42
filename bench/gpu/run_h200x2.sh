#!/usr/bin/env bash
# Entry point on the two-GPU machine (issue 11): build dynsnap-cuda and dynsnap-entrypoint there,
# install the carried wheels the agent needs, then run bench/gpu/two_gpu.py. Results land in $OUT
# (results.json, bench.log, nccl-debug.log, pytest-gpu.log, criu.log, ranks.log, build.log).
# Usage: bench/gpu/run_h200x2.sh [phases] [budget seconds]
# Expects .device (criu bundle with plugins/, wheels/) carried.
set -uo pipefail
OUT="${OUT:-/tmp/dynsnap-two-gpu-out}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --target /tmp/dynsnap-pydeps .device/wheels/*.whl >/dev/null 2>&1 \
  || echo "cannot install the carried wheels: the pytest phase will fail"
export PYTHONPATH="/tmp/dynsnap-pydeps:$ROOT"
nvidia-smi --query-gpu=index,uuid,memory.used,persistence_mode --format=csv
python3 bench/gpu/two_gpu.py --bin native/build/dynsnap-cuda --out "$OUT" \
  --phases "${1:-bisect,loop,swap,busy,pytest,criu,defaults}" --budget "${2:-480}"
