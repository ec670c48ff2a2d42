# shellcheck shell=bash
# Go for setup's builds (etcd, kube, kwok): at least GO_MIN_VERSION (hack/versions.env
# says why). setup_go decides, idempotently:
#   - no go at all: install Debian's golang-go (apt-get, as root); bookworm's is 1.19,
#     so one of the next two steps follows;
#   - go >= GO_MIN_VERSION: used as is;
#   - 1.21 <= go < GO_MIN_VERSION: GOTOOLCHAIN=go$GO_VERSION, so the go command fetches
#     golang.org/toolchain itself through GOPROXY (checked against the checksum
#     database) into its module cache, and runs it from there next time;
#   - go < 1.21 (no toolchain switch): the same golang.org/toolchain module zip fetched
#     here from the module proxy (hack/lib-registry.sh), checked (.info, .mod, the
#     checksum database's h1: line when the proxy serves one, `go version`), unpacked
#     to $CACHE/go-$GO_VERSION and put first on PATH, with GOROOT set to it.
# Only this process's environment changes (./run test inherits it); the system's
# default go stays what it was, apart from installing the distribution's package.
# A warm run does no network access for Go. Exports DYNSNAP_GO, the go it found.
# Sourced by hack/setup.sh (log/die, CACHE, GO_MIN_VERSION, GO_VERSION).

# _go_version: the running go's version as X.Y.Z ("go1.19" reads as 1.19.0). Its
# stderr passes through (a toolchain switch says "go: downloading go1.x" there).
_go_version() {
  local out
  out=$(go version) || { log "go: 'go version' failed"; return 1; }
  [[ "$out" =~ ^go\ version\ go([0-9]+\.[0-9]+)(\.[0-9]+)? ]] \
    || { log "go: cannot read a version in '$out'"; return 1; }
  printf '%s%s\n' "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]:-.0}"
}

# _version_ge A B: A >= B, both dotted numbers.
_version_ge() { printf '%s\n%s\n' "$2" "$1" | sort -V -C; }

_go_arch() {
  case "$(uname -m)" in
    x86_64 | amd64) echo amd64 ;;
    aarch64 | arm64) echo arm64 ;;
    armv6l | armv7l) echo armv6l ;;
    i?86) echo 386 ;;
    ppc64le | s390x | riscv64) uname -m ;;
    loongarch64) echo loong64 ;;
    *) die "go: no Go toolchain is published for machine type $(uname -m)" ;;
  esac
}

setup_go() {
  if ! command -v go >/dev/null; then
    [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null \
      || die "go is not installed: install Go >= $GO_MIN_VERSION, or run setup as root on Debian to install golang-go"
    log "go: not installed; apt-get install golang-go"
    apt-get update -qq >&2 || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends golang-go >&2 \
      || die "apt-get install golang-go failed"
    hash -r
    command -v go >/dev/null || die "golang-go is installed but there is no go on PATH ($PATH)"
  fi
  export DYNSNAP_GO; DYNSNAP_GO="$(command -v go)"
  local have
  have=$(_go_version) || die "cannot tell the version of $DYNSNAP_GO"
  if _version_ge "$have" "$GO_MIN_VERSION"; then
    log "go $have: $DYNSNAP_GO (>= $GO_MIN_VERSION needed)"; return 0
  fi
  if _version_ge "$have" 1.21.0; then
    log "go $have at $DYNSNAP_GO is older than $GO_MIN_VERSION: using GOTOOLCHAIN=go$GO_VERSION"
    export GOTOOLCHAIN="go$GO_VERSION"
    local now
    now=$(_go_version) || die "GOTOOLCHAIN=go$GO_VERSION: go could not fetch or run that toolchain" \
      "(it comes from golang.org/toolchain through GOPROXY='$(go env GOPROXY 2>/dev/null || true)')"
    [[ "$now" == "$GO_VERSION" ]] || die "GOTOOLCHAIN=go$GO_VERSION, yet go reports $now"
    return 0
  fi
  log "go $have at $DYNSNAP_GO is older than $GO_MIN_VERSION and has no toolchain switch (< 1.21)"
  _go_fetch_toolchain
  local dir="$CACHE/go-$GO_VERSION"
  export GOROOT="$dir"
  case ":$PATH:" in
    ":$dir/bin:"*) ;;
    *) export PATH="$dir/bin:$PATH" ;;
  esac
  hash -r
  DYNSNAP_GO="$dir/bin/go"
  [[ "$(_go_version)" == "$GO_VERSION" ]] || die "go on PATH is not $GO_VERSION after putting $dir/bin first"
}

# _go_fetch_toolchain: golang.org/toolchain@v0.0.1-go$GO_VERSION.linux-<arch> from the
# module proxy, unpacked to $CACHE/go-$GO_VERSION (cached: no network when present).
_go_fetch_toolchain() {
  local dir="$CACHE/go-$GO_VERSION"
  if [[ -f "$dir/.complete" && -x "$dir/bin/go" ]]; then log "go $GO_VERSION: cached ($dir)"; return 0; fi
  local arch t0=$SECONDS
  arch=$(_go_arch)
  resolve_goproxy
  local mod=golang.org/toolchain ver="v0.0.1-go$GO_VERSION.linux-$arch"
  local url="$GOPROXY_URL/$mod/@v/$ver" tmp="$dir.tmp"
  log "go $GO_VERSION: fetching $mod@$ver from $GOPROXY_URL"
  rm -rf "$tmp" "$tmp.dl"; mkdir -p "$tmp.dl"
  curl -fsSL "$url.info" -o "$tmp.dl/info" || die "go: cannot fetch $url.info"
  grep -Eq "\"Version\"[[:space:]]*:[[:space:]]*\"$ver\"" "$tmp.dl/info" \
    || die "go: $url.info does not name $ver: $(head -c 300 "$tmp.dl/info")"
  curl -fsSL "$url.mod" -o "$tmp.dl/mod" || die "go: cannot fetch $url.mod"
  grep -qx "module $mod" "$tmp.dl/mod" || die "go: $url.mod is not 'module $mod'"
  curl -fsSL "$url.zip" -o "$tmp.dl/zip" || die "go: cannot fetch $url.zip"
  # The checksum database's line for this zip, through the proxy as go itself asks
  # for it (its signature is not checked here: that needs Ed25519).
  local sumdb want="" got
  sumdb=$(go env GOSUMDB 2>/dev/null || true); sumdb="${sumdb%%[+ ]*}"
  if [[ "$sumdb" == off ]]; then
    log "go: GOSUMDB=off: no checksum database line to check the zip against"
  elif want=$(curl -fsS "$GOPROXY_URL/sumdb/${sumdb:-sum.golang.org}/lookup/$mod@$ver" 2>/dev/null \
      | awk -v m="$mod" -v v="$ver" '$1 == m && $2 == v {print $3; exit}') && [[ -n "$want" ]]; then
    :
  else
    want=""
    log "go: WARNING: $GOPROXY_URL serves no checksum database line for $mod@$ver; checking .info, .mod and go version only"
  fi
  got=$(_go_zip_unpack "$tmp.dl/zip" "$mod@$ver" "$tmp") || die "go: cannot unpack $url.zip"
  if [[ -n "$want" && "$got" != "$want" ]]; then
    die "go: $url.zip hashes to $got, the checksum database says $want"
  fi
  # Module zips carry no mode bits: mark the tools executable as the go command
  # does for toolchains it downloads (pkg/tool and lib first, bin last).
  local d
  for d in "$tmp/pkg/tool" "$tmp/bin"; do
    if [[ -d "$d" ]]; then find "$d" -type f -exec chmod 0755 {} +; fi
  done
  if [[ -d "$tmp/lib" ]]; then find "$tmp/lib" -type f -name 'go_?*_?*_exec' -exec chmod 0755 {} +; fi
  local says
  says=$(env -u GOROOT GOTOOLCHAIN=local "$tmp/bin/go" version 2>&1) || die "go: the fetched $tmp/bin/go does not run: $says"
  [[ "$says" == "go version go$GO_VERSION linux/$arch" ]] \
    || die "go: the fetched toolchain says '$says', not go$GO_VERSION linux/$arch"
  rm -rf "$dir" "$tmp.dl"; mv "$tmp" "$dir"
  touch "$dir/.complete"
  log "go $GO_VERSION: fetched to $dir in $((SECONDS - t0)) s${want:+ (zip hash $want matches the checksum database)}"
}

# _go_zip_unpack ZIP MODULE@VERSION DEST: unpack a module zip (every entry under
# "<module>@<version>/") into DEST and print its go.sum hash: h1: = base64(sha256 of
# "<sha256 hex>  <name>\n" over the sorted entry names), as
# golang.org/x/mod/sumdb/dirhash.HashZip computes it.
_go_zip_unpack() {
  "${DYNSNAP_PYTHON:-python3}" - "$@" <<'PY'
import base64, hashlib, os, shutil, sys, zipfile
zpath, prefix, dest = sys.argv[1], sys.argv[2] + "/", sys.argv[3]
sums = {}
with zipfile.ZipFile(zpath) as z:
    for info in z.infolist():
        name = info.filename
        rel = name[len(prefix):]
        if not name.startswith(prefix) or "\n" in name or rel.startswith("/") or ".." in rel.split("/"):
            sys.exit(f"unexpected entry {name!r} in the module zip")
        h = hashlib.sha256()
        target = os.path.join(dest, rel)
        if name.endswith("/"):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
        sums[name] = h.hexdigest()
summary = "".join(f"{sums[n]}  {n}\n" for n in sorted(sums))
print("h1:" + base64.b64encode(hashlib.sha256(summary.encode()).digest()).decode())
PY
}
