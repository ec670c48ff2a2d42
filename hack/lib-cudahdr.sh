# shellcheck shell=bash
# CUDA headers for building native/ where no CUDA toolkit is installed.
# dynsnap-cuda needs only cuda.h, and of CUDA 13 or later: 12.x declares
# CUcheckpointRestoreArgs as opaque reserved bytes, without the gpuPairs the
# GPU map is passed in. PyPI's nvidia-cuda-runtime wheel ships that header
# (nvidia/cu13/include/cuda.h); it is unpacked once per pinned version.
# Needs $CACHE and $CUDA_HEADERS_VERSION (hack/versions.env) and log/die
# (hack/setup.sh).

setup_cuda_headers() {
  local dir="$CACHE/cuda-headers-$CUDA_HEADERS_VERSION"
  if [[ ! -f "$dir/.complete" ]]; then
    local py="${DYNSNAP_VENV:+$DYNSNAP_VENV/bin/python}"
    py="${py:-python3}"
    local tmp; tmp=$(mktemp -d)
    log "cuda headers: nvidia-cuda-runtime==$CUDA_HEADERS_VERSION"
    "$py" -m pip download -q --no-deps --only-binary=:all: \
      --platform manylinux_2_17_x86_64 --python-version 3.11 \
      -d "$tmp" "nvidia-cuda-runtime==$CUDA_HEADERS_VERSION" \
      || { rm -rf "$tmp"; die "pip download of nvidia-cuda-runtime==$CUDA_HEADERS_VERSION failed"; }
    "$py" - "$tmp" "$dir" <<'PY' || { rm -rf "$tmp"; die "unpacking cuda headers failed"; }
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
stage = dest + ".tmp"
shutil.rmtree(stage, ignore_errors=True)
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        parts = name.split("/")
        if "include" in parts[:-1] and not name.endswith("/"):
            rel = "/".join(parts[parts.index("include"):])
            os.makedirs(os.path.dirname(os.path.join(stage, rel)), exist_ok=True)
            with z.open(name) as src, open(os.path.join(stage, rel), "wb") as out:
                shutil.copyfileobj(src, out)
shutil.rmtree(dest, ignore_errors=True)
os.rename(stage, dest)
PY
    rm -rf "$tmp"
    grep -q gpuPairs "$dir/include/cuda.h" \
      || die "cuda.h of nvidia-cuda-runtime==$CUDA_HEADERS_VERSION has no gpuPairs (need CUDA 13)"
    touch "$dir/.complete"
  fi
  export DYNSNAP_CUDA_INCLUDE="$dir/include"
}
