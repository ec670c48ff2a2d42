# shellcheck shell=bash
# Sourced by the bench/gpu/run_*.sh entry points on the GPU machine: the environment
# every GPU run needs (NVLink multicast off, unbuffered Python), dynsnap-cuda built there
# against the toolkit's cuda.h, and the driver's libcuda/NVML located when ldconfig does
# not list them. Expects OUT (results folder); leaves the build log in $OUT/build.log.
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
