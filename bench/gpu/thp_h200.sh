#!/usr/bin/env bash
# Entry point on the GPU machine for bench/gpu/thp_bench.py (issue 12, huge pages per process):
# build dynsnap-cuda (gpu_env.sh) and the LD_PRELOAD shim bench/gpu/thp_advise.c there, then
# measure save/resume of 16 and 2 GiB PyTorch workers with THP as the machine has it against each
# per-process way (MADV_COLLAPSE through process_madvise, the shim) and the system-wide `always`
# as a reference. The machine's THP setting is put back whatever happens.
# Results in $OUT: thp.json, bench.log, shim-*.log, build.log.
# Usage: bench/gpu/thp_h200.sh [thp_bench.py options...]
set -uo pipefail
OUT="${OUT:-/tmp/dynsnap-thp}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
mode=$(sed 's/.*\[\(.*\)\].*/\1/' /sys/kernel/mm/transparent_hugepage/enabled)
trap 'echo "$mode" >/sys/kernel/mm/transparent_hugepage/enabled' EXIT
cc -O2 -Wall -shared -fPIC -o /tmp/thp_advise.so bench/gpu/thp_advise.c -ldl >>"$OUT/build.log" 2>&1 \
  || { cat "$OUT/build.log"; exit 1; }
python3 bench/gpu/thp_bench.py --bin native/build/dynsnap-cuda --out "$OUT" --shim /tmp/thp_advise.so "$@"
