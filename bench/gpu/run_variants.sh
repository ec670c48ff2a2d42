#!/usr/bin/env bash
# Entry point on the GPU machine for bench/gpu/ckpt_variants.py: build
# dynsnap-cuda there, then compare ways of driving the checkpoint of one
# GIB-GiB PyTorch worker. Results land in $OUT (variants.json, bench.log).
# Usage: bench/gpu/run_variants.sh [variants] [gib] [deadline_s] [ckpt_variants.py options...]
set -uo pipefail
OUT="${OUT:-/tmp/dynsnap-variants}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
python3 bench/gpu/ckpt_variants.py --bin native/build/dynsnap-cuda --out "$OUT" \
  --variants "${1:-a,b,c,d,e}" --gib "${2:-16}" --deadline-s "${3:-300}" "${@:4}"
