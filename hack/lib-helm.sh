# shellcheck shell=bash
# helm $HELM_VERSION, built from the Go module proxy (no Debian release packages helm), cached
# under $CACHE/bin/helm-$HELM_VERSION/helm and exported as DYNSNAP_HELM. The tests install, upgrade
# and uninstall deploy/helm/dynsnap with it against the local API server
# (tests/integration/test_helm.py). Sourced by hack/setup.sh; build_helm is idempotent.
# Cold: ~3-5 min on 2 cores (mostly downloading and compiling client-go); warm: a stat.

export DYNSNAP_HELM="$CACHE/bin/helm-$HELM_VERSION/helm"

build_helm() {
  local out="$CACHE/bin/helm-$HELM_VERSION"
  if [[ -x "$out/helm" ]]; then log "helm $HELM_VERSION: cached"; return 0; fi
  # Several setups may run at once (./run env runs one): one builds under a lock, the others wait
  # for it and find the result.
  exec {_helm_lock}>"$CACHE/bin/.helm-$HELM_VERSION.lock"
  flock "$_helm_lock"
  if [[ -x "$out/helm" ]]; then flock -u "$_helm_lock"; log "helm $HELM_VERSION: cached"; return 0; fi
  log "helm $HELM_VERSION: building helm.sh/helm/v3/cmd/helm from the Go module proxy"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  # The same -X values helm's Makefile sets: its version, and the Kubernetes version `helm lint` and
  # `helm template` assume without a cluster (the client-go minor it is built with, 1.<minor>);
  # without them helm says v3.x-dev-ish "unknown" and assumes Kubernetes 1.20.
  local minor=${HELM_K8S_MINOR:?}
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  ld="$ld -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  ld="$ld -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor"
  ld="$ld -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
  GOBIN="$out.tmp" CGO_ENABLED=0 go install -trimpath -ldflags "$ld" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" \
    || die "helm build failed"
  "$out.tmp/helm" version --short | grep -qF "$HELM_VERSION" || die "the helm built does not say $HELM_VERSION"
  rm -rf "$out"; mv "$out.tmp" "$out"
  flock -u "$_helm_lock"
  log "helm $HELM_VERSION: built"
}
