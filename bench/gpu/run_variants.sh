#!/usr/bin/env bash
# Entry point on the GPU machine for bench/gpu/ckpt_variants.py: build
# dynsnap-cuda there, then compare ways of driving the checkpoint of one
# GIB-GiB PyTorch worker. Results land in $OUT (variants.json, bench.log).
# Usage: bench/gpu/run_variants.sh [variants] [gib] [deadline_s] [ckpt_variants.py options...]
set -uo pipefail
OUT="${OUT:-/tmp/dynsnap-variants}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if [[ ! -f /usr/local/cuda/include/cuda.h && -z "${DYNSNAP_CUDA_INCLUDE:-}" ]]; then
  h=$(find / -xdev -path '*include/cuda.h' 2>/dev/null | head -1)
  export DYNSNAP_CUDA_INCLUDE="${h%/cuda.h}"
fi
make -C native >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
if ! ldconfig -p | grep -q 'libcuda.so.1 '; then
  DYNSNAP_LIBCUDA=$(find / -xdev -name libcuda.so.1 2>/dev/null | head -1); export DYNSNAP_LIBCUDA
fi
if ! ldconfig -p | grep -q 'libnvidia-ml.so.1 '; then
  DYNSNAP_LIBNVML=$(find / -xdev -name libnvidia-ml.so.1 2>/dev/null | head -1); export DYNSNAP_LIBNVML
fi
echo "libcuda: ${DYNSNAP_LIBCUDA:-libcuda.so.1 (ldconfig)}; NVML: ${DYNSNAP_LIBNVML:-libnvidia-ml.so.1 (ldconfig)}"
export DYNSNAP_CUDA_STATE_DIR=/tmp/dynsnap-cuda-records
nvidia-smi -L; uname -r
python3 bench/gpu/ckpt_variants.py --bin native/build/dynsnap-cuda --out "$OUT" \
  --variants "${1:-a,b,c,d,e}" --gib "${2:-16}" --deadline-s "${3:-300}" "${@:4}"
