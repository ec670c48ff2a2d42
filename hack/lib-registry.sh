# shellcheck shell=bash
# Where setup's own downloads come from, read from the machine's configuration so
# that the same commands work behind a company mirror:
#   Go module proxy  the first proxy URL in `go env GOPROXY` (override: DYNSNAP_GOPROXY,
#                    which setup.sh also exports as GOPROXY for its go commands); used
#                    to read k8s.io/kubernetes' go.mod (hack/lib-go.sh) and to fetch a
#                    Go toolchain for a go too old to switch itself (hack/lib-gotoolchain.sh).
#   Debian mirror    the apt source that serves Debian's main archive for this
#                    machine's own release (override: DYNSNAP_DEBIAN_MIRROR, keyring
#                    DYNSNAP_DEBIAN_KEYRING); used for CRIU's sid/forky orig tarball
#                    (hack/lib-criu.sh).
# Each is resolved only when a cold build needs it: a warm setup reads neither.
# Test seams: DYNSNAP_APT_ETC (a directory holding sources.list and sources.list.d/;
# default: where apt-config says, else /etc/apt) and DYNSNAP_OS_RELEASE (default
# /etc/os-release).
# Sourced by hack/setup.sh (log/die); every function is idempotent.

# goproxy_first_url LIST: print the first proxy URL of a GOPROXY list (entries
# separated by ',' or '|'), read the way the go command reads it: 'direct' and
# 'off' are not proxies and go never looks past them; a bare host name means
# https://; other schemes (file://) are skipped. Returns 1 when there is none.
goproxy_first_url() {
  local rest="$1" entry
  while [[ -n "$rest" ]]; do
    entry="${rest%%[,|]*}"
    if [[ "$entry" == "$rest" ]]; then rest=""; else rest="${rest#*[,|]}"; fi
    entry="${entry//[[:space:]]/}"
    case "$entry" in
      "") ;;
      direct | off) return 1 ;;
      http://* | https://*) printf '%s\n' "${entry%/}"; return 0 ;;
      *:/* | /*) ;;
      *.* | *:*) printf 'https://%s\n' "${entry%/}"; return 0 ;;
    esac
  done
  return 1
}

# resolve_goproxy: set GOPROXY_URL (no trailing slash) from DYNSNAP_GOPROXY or
# `go env GOPROXY`, or die saying what was found and how to set one.
GOPROXY_URL=""
resolve_goproxy() {
  [[ -n "$GOPROXY_URL" ]] && return 0
  local list from
  if [[ -n "${DYNSNAP_GOPROXY:-}" ]]; then
    list="$DYNSNAP_GOPROXY" from="DYNSNAP_GOPROXY"
  else
    list=$(go env GOPROXY 2>&1) || die "cannot read the Go module proxy: 'go env GOPROXY' failed: $list"
    from="go env GOPROXY"
  fi
  GOPROXY_URL=$(goproxy_first_url "$list") \
    || die "no Go module proxy URL in $from ('$list'): 'direct' and 'off' are not proxies, and go ignores" \
      "what follows them. Setup fetches from a proxy: set one with 'go env -w GOPROXY=<proxy URL>,direct'" \
      "(Go's default names its public module proxy first), or DYNSNAP_GOPROXY=<url> for setup alone"
  log "go module proxy: $GOPROXY_URL (from $from)"
}

# _apt_source_files: apt's one-line list, then its parts directory's *.list and
# *.sources files in apt's (alphabetical) order; other names (*.disabled, *.save) are
# not read by apt either.
_apt_source_files() {
  local list="" parts="" f
  if [[ -n "${DYNSNAP_APT_ETC:-}" ]]; then
    list="$DYNSNAP_APT_ETC/sources.list" parts="$DYNSNAP_APT_ETC/sources.list.d"
  elif command -v apt-config >/dev/null; then
    eval "$(apt-config shell list Dir::Etc::SourceList/f parts Dir::Etc::SourceParts/d)"
  fi
  list="${list:-/etc/apt/sources.list}" parts="${parts:-/etc/apt/sources.list.d}"
  if [[ -f "$list" ]]; then printf '%s\n' "$list"; fi
  for f in "${parts%/}"/*; do
    case "$f" in *.list | *.sources) if [[ -f "$f" ]]; then printf '%s\n' "$f"; fi ;; esac
  done
}

# Reads one-line (deb [opts] uri suite comp...) and deb822 (*.sources: Types, URIs,
# Suites, Components, Signed-By, Enabled) entries and prints the best source of
# Debian's main archive as "uri<TAB>keyring<TAB>file", nothing when there is none.
# A candidate has type deb or deb-src, component main, and suite = the machine's
# codename (bookworm, not bookworm-security or a third party's cloud-sdk-bookworm)
# or a Debian alias (stable, testing, unstable, sid...). Among candidates: the
# codename first, then a URI whose path ends in /debian, then a keyring that is
# Debian's archive keyring (or none), then apt's order. An inline Signed-By key is
# printed with its lines joined by a literal \n.
# shellcheck disable=SC2016
_DEBIAN_APT_AWK='
function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t]+$/, "", s); return s }
function has_word(list, w,   n, a, i) {
  n = split(list, a, /[ \t]+/)
  for (i = 1; i <= n; i++) if (a[i] == w) return 1
  return 0
}
function consider(types, uri, suite, comps, kr, file,   score, seg) {
  if (!has_word(types, "deb") && !has_word(types, "deb-src")) return
  if (uri ~ /^cdrom:/ || !has_word(comps, "main")) return
  sub(/\/+$/, "", uri)
  if (codename != "" && suite == codename) score = 8
  else if (suite ~ /^(stable|oldstable|oldoldstable|testing|unstable|sid)$/) score = 0
  else return
  seg = uri; sub(/.*\//, "", seg)
  if (seg == "debian") score += 4
  if (kr == "" || kr ~ /debian-archive-keyring/) score += 2
  if (!found || score > best) { found = 1; best = score; out = uri "\t" kr "\t" file }
}
function flush(   nu, ns, u, s, i, j) {
  if (para && tolower(f["enabled"]) != "no") {
    nu = split(f["uris"], u, /[ \t]+/); ns = split(f["suites"], s, /[ \t]+/)
    for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++)
      if (u[i] != "" && s[j] != "") consider(f["types"], u[i], s[j], f["components"], f["signed-by"], pfile)
  }
  para = 0; cur = ""; split("", f)
}
FNR == 1 { flush(); deb822 = (FILENAME ~ /\.sources$/) }
deb822 {
  if ($0 ~ /^#/) next
  if ($0 ~ /^[ \t]*$/) { flush(); next }
  if ($0 ~ /^[ \t]/) {
    line = trim($0); if (line == ".") line = ""
    if (cur == "signed-by") f[cur] = (f[cur] == "" ? line : f[cur] "\\n" line)
    else if (cur != "") f[cur] = trim(f[cur] " " line)
    next
  }
  i = index($0, ":"); if (i == 0) next
  cur = tolower(trim(substr($0, 1, i - 1))); f[cur] = trim(substr($0, i + 1)); para = 1; pfile = FILENAME
  next
}
{
  line = $0; sub(/#.*/, "", line); line = trim(line)
  if (line !~ /^deb(-src)?[ \t]/) next
  type = line; sub(/[ \t].*/, "", type); line = trim(substr(line, length(type) + 1))
  kr = ""
  if (substr(line, 1, 1) == "[") {
    i = index(line, "]"); if (i == 0) next
    n = split(substr(line, 2, i - 2), o, /[ \t]+/)
    for (k = 1; k <= n; k++) if (o[k] ~ /^signed-by=/) { kr = o[k]; sub(/^signed-by=/, "", kr) }
    line = trim(substr(line, i + 1))
  }
  n = split(line, w, /[ \t]+/); if (n < 3) next
  comps = ""; for (k = 3; k <= n; k++) comps = comps " " w[k]
  consider(type, w[1], w[2], comps, kr, FILENAME)
}
END { flush(); if (found) print out }
'

# debian_apt_mirror CODENAME FILE...: the best source of Debian's main archive in
# these apt source files (see above), as "uri<TAB>keyring<TAB>file"; 1 if none.
debian_apt_mirror() {
  local codename="$1"; shift
  local found
  found=$(awk -v codename="$codename" "$_DEBIAN_APT_AWK" "$@") || return 1
  [[ -n "$found" ]] || return 1
  printf '%s\n' "$found"
}

# resolve_debian_mirror: set DEBIAN_MIRROR_URI and DEBIAN_MIRROR_KEYRING (a keyring
# file for signed-by=, or empty: apt's trusted keys) from DYNSNAP_DEBIAN_MIRROR or the
# machine's apt sources, or die saying what was read and how to set one.
DEBIAN_MIRROR_URI=""
DEBIAN_MIRROR_KEYRING=""
resolve_debian_mirror() {
  [[ -n "$DEBIAN_MIRROR_URI" ]] && return 0
  local from kr=""
  if [[ -n "${DYNSNAP_DEBIAN_MIRROR:-}" ]]; then
    DEBIAN_MIRROR_URI="${DYNSNAP_DEBIAN_MIRROR%/}" from="DYNSNAP_DEBIAN_MIRROR"
    if [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]]; then
      kr=/usr/share/keyrings/debian-archive-keyring.gpg
    fi
  else
    local osr="${DYNSNAP_OS_RELEASE:-/etc/os-release}" id="" codename="" found
    if [[ -r "$osr" ]]; then
      read -r id codename < <(set +u; . "$osr"; printf '%s %s\n' "${ID:-}" "${VERSION_CODENAME:-}")
    fi
    # Only on Debian does the machine's own release suite name a Debian archive.
    [[ "$id" == debian ]] || codename=""
    local -a files
    mapfile -t files < <(_apt_source_files)
    [[ ${#files[@]} -gt 0 ]] || die "no apt sources found (sources.list, sources.list.d/*.list|*.sources);" \
      "set DYNSNAP_DEBIAN_MIRROR=<URL of a Debian archive mirror, as an apt source names it>"
    found=$(debian_apt_mirror "$codename" "${files[@]}") \
      || die "no apt source serves Debian's main archive for '${codename:-stable/testing/unstable}'" \
        "(read: ${files[*]}; this is ${id:-an unknown system}); set DYNSNAP_DEBIAN_MIRROR=<URL of a Debian" \
        "archive mirror, as an apt source names it> (and DYNSNAP_DEBIAN_KEYRING=<keyring> if needed)"
    DEBIAN_MIRROR_URI="${found%%$'\t'*}" found="${found#*$'\t'}"
    kr="${found%%$'\t'*}" from="${found#*$'\t'}"
    if [[ "$kr" == -----BEGIN* ]]; then
      # deb822 inline key: apt reads an armored keyring from an .asc file.
      mkdir -p "$CACHE/apt-debian-src"
      printf '%b\n' "$kr" > "$CACHE/apt-debian-src/mirror-keyring.asc"
      kr="$CACHE/apt-debian-src/mirror-keyring.asc"
    fi
  fi
  DEBIAN_MIRROR_KEYRING="${DYNSNAP_DEBIAN_KEYRING-$kr}"
  log "debian mirror: $DEBIAN_MIRROR_URI${DEBIAN_MIRROR_KEYRING:+ (signed-by $DEBIAN_MIRROR_KEYRING)} (from $from)"
}
