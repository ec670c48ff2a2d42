# shellcheck shell=bash
# The real node's parts, installed or built here; nothing is started (dynsnap/testenv/node.py
# starts them for a test session, with every file under the run's own directory):
#   kubelet $KUBE_VERSION   built from the Go module proxy like the control plane (a module that
#                           requires k8s.io/kubernetes, hack/lib-go.sh), the same version ldflags;
#                           its own cache directory $CACHE/bin/kubelet-$KUBE_VERSION, so the
#                           control plane's kube-$KUBE_VERSION stays valid
#   kube-scheduler          the same way ($CACHE/bin/kube-scheduler-$KUBE_VERSION): the chart's pods
#                           on a real node need one (build_kube_scheduler says why)
#   containerd, runc        Debian bookworm's packages (NODE_CONTAINERD_VERSION, NODE_RUNC_VERSION)
#   CNI plugins             Debian's containernetworking-plugins (bridge, host-local, loopback)
#   dynsnap-pause           the pod sandbox image: native/build/dynsnap-pause (static C, waits
#                           for SIGTERM/SIGINT, reaps children) as a one-layer OCI image layout at
#                           $CACHE/pause-<hash>/dynsnap-pause
# Exports DYNSNAP_KUBELET, DYNSNAP_KUBE_SCHEDULER, DYNSNAP_CONTAINERD, DYNSNAP_CONTAINERD_SHIM,
# DYNSNAP_CTR, DYNSNAP_RUNC, DYNSNAP_CNI_BIN, DYNSNAP_PAUSE_IMAGE (the layout) and DYNSNAP_PAUSE_REF (its image name).
# Images reach a node's containerd when it runs: RealNode.import_image (node.py) makes the archive
# `ctr -n k8s.io images import` reads from an OCI layout (this pause image's, hack/lib-images.sh's).
# runc, not crun: runc 1.1.5 runs the pods here once containerd keeps the CRI from lowering
# oom_score_adj (node_config.py says why); crun is not needed.
# Cold: the kubelet build (minutes: the Go build cache is warm from the control plane's) and
# the apt install (docs/BENCHMARKS.md); warm: stats and dpkg queries.
# Sourced by hack/setup.sh (log/die, $CACHE, $ROOT, versions.env); setup_node is idempotent.

export DYNSNAP_KUBELET="$CACHE/bin/kubelet-$KUBE_VERSION/kubelet"
export DYNSNAP_KUBE_SCHEDULER="$CACHE/bin/kube-scheduler-$KUBE_VERSION/kube-scheduler"

build_kubelet() {
  local out="$CACHE/bin/kubelet-$KUBE_VERSION"
  if [[ -x "$out/kubelet" ]]; then log "kubelet $KUBE_VERSION: cached"; return 0; fi
  exec {_kubelet_lock}>"$CACHE/bin/.kubelet-$KUBE_VERSION.lock"
  flock "$_kubelet_lock"
  if [[ -x "$out/kubelet" ]]; then flock -u "$_kubelet_lock"; log "kubelet $KUBE_VERSION: cached"; return 0; fi
  log "kubelet $KUBE_VERSION: building k8s.io/kubernetes/cmd/kubelet"
  resolve_goproxy
  local src="$CACHE/src/kubelet-$KUBE_VERSION"
  rm -rf "$src" "$out.tmp"; mkdir -p "$src" "$out.tmp"
  (
    cd "$src"
    kube_requiring_module dynsnap.local/kubeletbuild k8s.io/kubernetes/cmd/kubelet
    # Static, as Kubernetes' release kubelet is (CGO off).
    CGO_ENABLED=0 go build -tags tools -trimpath -ldflags "$(kube_ldflags)" -o "$out.tmp/kubelet" \
      k8s.io/kubernetes/cmd/kubelet
  ) || die "kubelet build failed (source kept in $src)"
  "$out.tmp/kubelet" --version | grep -qxF "Kubernetes $KUBE_VERSION" \
    || die "the kubelet built does not say Kubernetes $KUBE_VERSION: $("$out.tmp/kubelet" --version)"
  rm -rf "$out"; mv "$out.tmp" "$out"
  flock -u "$_kubelet_lock"
  log "kubelet $KUBE_VERSION: built"
}

# kube-scheduler, from the same module and release: the chart's Deployment and DaemonSet pods have no
# nodeName (the DaemonSet controller leaves the binding to the scheduler, with a node affinity per
# node), so a real node's workloads need one. The session's control plane does not run it (kwok's
# fake nodes and the sandboxes bind their pods themselves); dynsnap/testenv/workloads.py starts it
# for the tests that run the chart as pods. Its own cache directory, like kubelet's.
build_kube_scheduler() {
  local out="$CACHE/bin/kube-scheduler-$KUBE_VERSION"
  if [[ -x "$out/kube-scheduler" ]]; then log "kube-scheduler $KUBE_VERSION: cached"; return 0; fi
  exec {_sched_lock}>"$CACHE/bin/.kube-scheduler-$KUBE_VERSION.lock"
  flock "$_sched_lock"
  if [[ -x "$out/kube-scheduler" ]]; then flock -u "$_sched_lock"; log "kube-scheduler $KUBE_VERSION: cached"; return 0; fi
  log "kube-scheduler $KUBE_VERSION: building k8s.io/kubernetes/cmd/kube-scheduler"
  resolve_goproxy
  local src="$CACHE/src/kube-scheduler-$KUBE_VERSION"
  rm -rf "$src" "$out.tmp"; mkdir -p "$src" "$out.tmp"
  (
    cd "$src"
    kube_requiring_module dynsnap.local/schedulerbuild k8s.io/kubernetes/cmd/kube-scheduler
    CGO_ENABLED=0 go build -tags tools -trimpath -ldflags "$(kube_ldflags)" -o "$out.tmp/kube-scheduler" \
      k8s.io/kubernetes/cmd/kube-scheduler
  ) || die "kube-scheduler build failed (source kept in $src)"
  "$out.tmp/kube-scheduler" --version | grep -qxF "Kubernetes $KUBE_VERSION" \
    || die "the kube-scheduler built does not say Kubernetes $KUBE_VERSION: $("$out.tmp/kube-scheduler" --version)"
  rm -rf "$out"; mv "$out.tmp" "$out"
  flock -u "$_sched_lock"
  log "kube-scheduler $KUBE_VERSION: built"
}

# Debian's packages of the runtime (bookworm: containerd 1.6.20, runc 1.1.5, the CNI plugins 1.1.1).
# None starts anything: containerd ships only a systemd unit (there is no systemd here) and node.py
# runs its own containerd with its own config; /etc/containerd/config.toml is not read. nftables: `nft`,
# with which the tests read a worker's network namespace for CRIU's network lock (the agent's image has its own).
NODE_APT_PKGS=(containerd runc containernetworking-plugins nftables)
export DYNSNAP_CONTAINERD=/usr/bin/containerd DYNSNAP_CONTAINERD_SHIM=/usr/bin/containerd-shim-runc-v2
export DYNSNAP_CTR=/usr/bin/ctr DYNSNAP_RUNC=/usr/sbin/runc DYNSNAP_CNI_BIN=/usr/lib/cni

# _node_pkg_version PKG: its installed Debian version, or nothing.
_node_pkg_version() {
  dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null | awk '$3 == "installed" {print $4}'
}

# _node_check_version PKG UPSTREAM: the installed PKG is upstream version UPSTREAM (Debian writes
# 1.6.20~ds1-1+deb12u3: a security update moves only the part after the upstream version).
_node_check_version() {
  local have; have=$(_node_pkg_version "$1")
  [[ "$have" == "$2" || "$have" == "$2"[~+-]* ]] \
    || die "node: $1 ${have:-(not installed)} is installed, $2 is pinned (hack/versions.env); the node is tested with $2"
}

_node_apt() {
  local missing=() p
  for p in "${NODE_APT_PKGS[@]}"; do [[ -n "$(_node_pkg_version "$p")" ]] || missing+=("$p"); done
  if [[ ${#missing[@]} -gt 0 ]]; then
    [[ $EUID -eq 0 ]] || die "node: missing packages (${missing[*]}); install them or run setup as root"
    log "node: apt-get install ${missing[*]}"
    apt-get update -qq >&2 || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 \
      "${missing[@]}" >&2 || die "apt-get install of ${missing[*]} failed"
  fi
  _node_check_version containerd "$NODE_CONTAINERD_VERSION"
  _node_check_version runc "$NODE_RUNC_VERSION"
  _node_check_version containernetworking-plugins "$NODE_CNI_PLUGINS_VERSION"
  local f
  for f in "$DYNSNAP_CONTAINERD" "$DYNSNAP_CONTAINERD_SHIM" "$DYNSNAP_CTR" "$DYNSNAP_RUNC" \
    "$DYNSNAP_CNI_BIN/bridge" "$DYNSNAP_CNI_BIN/host-local" "$DYNSNAP_CNI_BIN/loopback"; do
    [[ -x "$f" ]] || die "node: $f is missing after installing ${NODE_APT_PKGS[*]}"
  done
}

# The pod sandbox image: native/build/dynsnap-pause alone (it needs no libraries: static), one layer,
# run as 65535 like Kubernetes' own pause image. Its tag is a hash of what it is made of, so a
# changed binary is a new image and containerd never runs a stale one under the old name.
NODE_PAUSE_NAME=localhost/dynsnap-pause
_node_pause_image() {
  local bin="$ROOT/native/build/dynsnap-pause"
  [[ -x "$bin" ]] || die "node: $bin is missing (make -C native builds it)"
  local key; key=$(cat "$bin" "$ROOT/hack/oci_image.py" | sha256sum | cut -c1-12)
  local out="$CACHE/node-pause-$key"
  export DYNSNAP_PAUSE_IMAGE="$out/dynsnap-pause" DYNSNAP_PAUSE_REF="$NODE_PAUSE_NAME:$key"
  if [[ -f "$out/.complete" ]]; then log "node: pause image cached ($DYNSNAP_PAUSE_REF)"; return 0; fi
  local work; work=$(mktemp -d)
  mkdir -p "$work/rootfs"
  install -m 0755 "$bin" "$work/rootfs/pause"
  "$DYNSNAP_VENV/bin/python" "$ROOT/hack/oci_image.py" layer --rootfs "$work/rootfs" --out "$work/layer.json" >/dev/null \
    || { rm -rf "$work"; die "node: packing the pause layer failed"; }
  printf '{"name": "%s", "tag": "%s", "created": "%s", "config": %s, "history": ["%s"]}\n' \
    "$NODE_PAUSE_NAME" "$key" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    '{"Entrypoint": ["/pause"], "User": "65535:65535", "WorkingDir": "/"}' \
    "native/build/dynsnap-pause (native/pause/pause.c)" > "$work/spec.json"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  "$DYNSNAP_VENV/bin/python" "$ROOT/hack/oci_image.py" image --layout "$out.tmp/dynsnap-pause" --spec "$work/spec.json" \
    "$work/layer.json" >/dev/null || { rm -rf "$work" "$out.tmp"; die "node: writing the pause image layout failed"; }
  rm -rf "$work"
  touch "$out.tmp/.complete"
  rm -rf "$out"; mv "$out.tmp" "$out"
  # Pause images of other binaries are not used again.
  local old; for old in "$CACHE"/node-pause-*/; do [[ "${old%/}" == "$out" ]] || rm -rf "$old"; done
  log "node: pause image built ($DYNSNAP_PAUSE_REF)"
}

setup_node() {
  build_kubelet
  build_kube_scheduler
  _node_apt
  _node_pause_image
  # kubelet's two fixed host paths (its device-plugin socket directory's parent and the
  # /var/log/containers links): node.py mounts the run's own directories over them in kubelet's
  # mount namespace, so on the host they are only these empty mount points.
  if [[ $EUID -eq 0 ]]; then mkdir -p /var/lib/kubelet /var/log/containers; fi
}
