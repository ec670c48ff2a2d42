#!/usr/bin/env bash
# Entry point on the GPU machine: build dynsnap-cuda against the toolkit's
# cuda.h there, then run bench/gpu/ckpt_bench.py. Results land in $OUT
# (results.json, bench.log). Usage: bench/gpu/run_h200.sh [sections] [sizes] [reps]
set -uo pipefail
OUT="${OUT:-/tmp/dynsnap-bench}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
python3 bench/gpu/ckpt_bench.py --bin native/build/dynsnap-cuda --out "$OUT" \
  --sections "${1:-smoke,sizes,maps,overlap,pair10,busy}" --sizes "${2:-1,4,16,64}" --reps "${3:-1}"
