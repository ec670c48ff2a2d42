# shellcheck shell=bash
# Idempotent setup of everything dynsnap's tests and demo run on. Sourced by
# ./run; `setup_all` builds or finds each real part at its pinned version
# (hack/versions.env) and exports its path as DYNSNAP_*.
# Cold on a fresh 2-core machine: see docs/BENCHMARKS.md.

ROOT="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
export DYNSNAP_CACHE="${DYNSNAP_CACHE:-$HOME/.cache/dynsnap}"
CACHE="$DYNSNAP_CACHE"
# The Go module proxy and the Debian mirror come from the machine's configuration
# (hack/lib-registry.sh); DYNSNAP_GOPROXY overrides the proxy for setup's go commands too.
if [[ -n "${DYNSNAP_GOPROXY:-}" ]]; then export GOPROXY="$DYNSNAP_GOPROXY"; fi
mkdir -p "$CACHE/bin" "$CACHE/src"

log() { echo "[setup] $*" >&2; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

source "$ROOT/hack/lib-registry.sh"
source "$ROOT/hack/lib-gotoolchain.sh"
source "$ROOT/hack/lib-go.sh"
source "$ROOT/hack/lib-python.sh"
[[ -f "$ROOT/hack/lib-criu.sh" ]] && source "$ROOT/hack/lib-criu.sh"
[[ -f "$ROOT/hack/lib-dynamo.sh" ]] && source "$ROOT/hack/lib-dynamo.sh"
[[ -f "$ROOT/hack/lib-cudahdr.sh" ]] && source "$ROOT/hack/lib-cudahdr.sh"
[[ -f "$ROOT/hack/lib-helm.sh" ]] && source "$ROOT/hack/lib-helm.sh"
[[ -f "$ROOT/hack/lib-images.sh" ]] && source "$ROOT/hack/lib-images.sh"
[[ -f "$ROOT/hack/lib-node.sh" ]] && source "$ROOT/hack/lib-node.sh"

export DYNSNAP_ETCD="$CACHE/bin/etcd-$ETCD_VERSION/etcd"
export DYNSNAP_KUBE_APISERVER="$CACHE/bin/kube-$KUBE_VERSION/kube-apiserver"
export DYNSNAP_KUBE_CONTROLLER_MANAGER="$CACHE/bin/kube-$KUBE_VERSION/kube-controller-manager"
export DYNSNAP_KWOK="$CACHE/bin/kwok-$KWOK_VERSION/kwok"
export DYNSNAP_KWOK_STAGES="$CACHE/bin/kwok-$KWOK_VERSION/stages"
export DYNSNAP_NATIVE_BIN="$ROOT/native/build"

# CRIU (apt and a short compile), Dynamo's venv, the CUDA headers (pip) and the images' parts (apt,
# pip, the disk) wait mostly on the network, the Go builds on the CPU: on a cold machine the first four
# are built beside the Go builds, in a subshell whose output is shown after them. The foreground then
# runs all four again as always: they find their builds cached (or fail there with their own message)
# and export what they export.
_setup_beside_go() {
  if declare -F setup_criu >/dev/null; then setup_criu; fi
  if declare -F setup_dynamo >/dev/null; then setup_dynamo; fi
  if declare -F setup_cuda_headers >/dev/null; then setup_cuda_headers; fi
  if declare -F setup_images_parts >/dev/null; then setup_images_parts; fi   # after Dynamo's venv
}

setup_all() {
  local t0=$SECONDS
  setup_go   # go >= GO_MIN_VERSION for etcd, kube-apiserver, kwok (installed or fetched when missing/older)
  setup_python_venv
  local beside_log; beside_log=$(mktemp)
  ( _setup_beside_go ) >"$beside_log" 2>&1 &
  local beside=$!
  build_etcd
  build_kwok
  build_kube
  if declare -F build_helm >/dev/null; then build_helm; fi
  wait "$beside" || log "the builds beside Go's ended with status $?: set up again below"
  if grep -qv ': cached' "$beside_log"; then sed 's/^/  (beside Go) /' "$beside_log" >&2; fi
  rm -f "$beside_log"
  _setup_beside_go
  log "native: make -C native"
  make -s -C "$ROOT/native" >&2 || die "native build failed"
  if declare -F setup_node >/dev/null; then setup_node; fi       # after native/: the pause image carries dynsnap-pause
  if declare -F setup_images >/dev/null; then setup_images; fi   # after native/ and CRIU: the images carry them
  log "setup done in $((SECONDS - t0)) s"
}
