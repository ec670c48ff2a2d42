# shellcheck shell=bash
# Builds the Go-based real parts (etcd, kube-apiserver, kube-controller-manager,
# kwok) from the Go module proxy, cached by version under $CACHE/bin, with the go
# that setup_go chose (hack/lib-gotoolchain.sh).
# Sourced by hack/setup.sh; every function is idempotent.

build_kube() {
  local out="$CACHE/bin/kube-$KUBE_VERSION"
  if [[ -x "$out/kube-apiserver" && -x "$out/kube-controller-manager" ]]; then
    log "kube $KUBE_VERSION: cached"; return 0
  fi
  log "kube $KUBE_VERSION: building kube-apiserver + kube-controller-manager (cold: 15-30 min on 2 cores)"
  resolve_goproxy  # GOPROXY_URL: the staging module list is read from the proxy below
  local src="$CACHE/src/kube-$KUBE_VERSION"
  rm -rf "$src"; mkdir -p "$src" "$out.tmp"
  (
    cd "$src"
    kube_requiring_module dynsnap.local/kubebuild k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager
    CGO_ENABLED=0 go build -tags tools -trimpath -ldflags "$(kube_ldflags)" -o "$out.tmp/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
  ) || die "kube build failed (source kept in $src)"
  rm -rf "$out"; mv "$out.tmp" "$out"
  log "kube $KUBE_VERSION: built"
}

# kube_requiring_module MODULE PKG...: in the current directory, a module named MODULE that
# requires k8s.io/kubernetes@$KUBE_VERSION and imports PKG... (tools.go, tag "tools"), tidied.
# k8s.io/kubernetes' go.mod requires its staging modules at v0.0.0 and replaces them with
# ./staging paths; a requiring module must map each one to its published tag instead.
# Needs GOPROXY_URL (resolve_goproxy): the staging module list is read from the proxy.
kube_requiring_module() {
  local module="$1"; shift
  go mod init "$module" >/dev/null 2>&1
  go mod edit -require="k8s.io/kubernetes@$KUBE_VERSION"
  local staging m
  staging=$(curl -fsS "$GOPROXY_URL/k8s.io/kubernetes/@v/$KUBE_VERSION.mod" \
    | awk '/^\t*k8s.io\/[a-z0-9-]+ v0.0.0$/ {print $1}' | sort -u)
  [[ -n "$staging" ]] || die "could not read the staging module list of k8s.io/kubernetes $KUBE_VERSION"
  for m in $staging; do go mod edit -replace="$m=$m@$KUBE_STAGING_VERSION"; done
  { printf '//go:build tools\n\npackage tools\n\nimport (\n'; printf '\t_ "%s"\n' "$@"; printf ')\n'; } > tools.go
  go mod tidy >/dev/null
}

# kube_ldflags: the version ldflags Kubernetes' own build sets (without them a binary says
# v0.0.0-master and kubelet's version skew against the API server is unknown).
kube_ldflags() {
  local ld="-s -w" minor p
  minor=$(cut -d. -f2 <<<"$KUBE_VERSION")  # v1.34.4 -> 34
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  echo "$ld"
}

build_etcd() {
  local out="$CACHE/bin/etcd-$ETCD_VERSION"
  if [[ -x "$out/etcd" ]]; then log "etcd $ETCD_VERSION: cached"; return 0; fi
  log "etcd $ETCD_VERSION: building"
  local src="$CACHE/src/etcd-$ETCD_VERSION"
  rm -rf "$src"; mkdir -p "$src" "$out.tmp"
  (
    cd "$src"
    go mod init dynsnap.local/etcdbuild >/dev/null 2>&1
    # etcd's own go.mod carries replace lines, so `go install …@v` refuses it;
    # a module that merely requires it needs none.
    go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
    go mod tidy >/dev/null
    CGO_ENABLED=0 go build -tags tools -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3
  ) || die "etcd build failed (source kept in $src)"
  rm -rf "$out"; mv "$out.tmp" "$out"
  log "etcd $ETCD_VERSION: built"
}

build_kwok() {
  local out="$CACHE/bin/kwok-$KWOK_VERSION"
  if [[ -x "$out/kwok" && -f "$out/stages/.complete" ]]; then log "kwok $KWOK_VERSION: cached"; return 0; fi
  log "kwok $KWOK_VERSION: building"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp/stages"
  GOBIN="$out.tmp" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" \
    || die "kwok build failed"
  # v0.8 has no built-in stages: ship the node and pod stages from its module.
  local mod; mod="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION"
  [[ -d "$mod/kustomize/stage" ]] || die "kwok module has no kustomize/stage directory at $mod"
  local f
  for f in "$mod"/kustomize/stage/node/fast/*.yaml "$mod"/kustomize/stage/pod/fast/*.yaml; do
    [[ "$(basename "$f")" == kustomization.yaml ]] || cp "$f" "$out.tmp/stages/"
  done
  chmod -R u+w "$out.tmp"
  # kwok's pod-ready stage also sets every readiness-gate condition True; a real kubelet
  # never writes gate conditions (their owner does), and dynsnap owns one. Drop that block
  # so the stand-in behaves like kubelet here.
  awk '/range \.spec\.readinessGates/ {skip=1; next} skip && /\{\{ end \}\}/ {skip=0; next} !skip' \
    "$out.tmp/stages/pod-ready.yaml" > "$out.tmp/stages/pod-ready.yaml.new"
  mv "$out.tmp/stages/pod-ready.yaml.new" "$out.tmp/stages/pod-ready.yaml"
  grep -q readinessGates "$out.tmp/stages/pod-ready.yaml" && die "could not drop readinessGates from kwok's pod-ready stage"
  touch "$out.tmp/stages/.complete"
  rm -rf "$out"; mv "$out.tmp" "$out"
  log "kwok $KWOK_VERSION: built"
}
