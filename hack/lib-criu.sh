# shellcheck shell=bash
# CRIU $CRIU_VERSION and its CUDA plugin, built from Debian's orig tarball with
# bookworm's -dev packages and dynsnap's patches (hack/patches/criu/*.patch, applied in
# order), cached under $CACHE/criu-$CRIU_VERSION-p<hash of the patches> (exported as
# DYNSNAP_CRIU_DIR), so a changed patch set is a new build and never a stale binary:
#   sbin/criu                  the binary (exported as DYNSNAP_CRIU)
#   lib/criu/cuda_plugin.so    CRIU's CUDA plugin; criu loads it by default from
#                              here (PLUGINDIR is compiled in)
# Why not bookworm's criu: 3.17 fails on this kernel (6.18) at vdso detection,
# and 4.1.1 cannot dump any TCP/UDP socket on kernels >= 6.16.
# Sourced by hack/setup.sh; setup_criu is idempotent. Cold: ~1 min of compiling
# on 2 cores plus the apt installs (docs/BENCHMARKS.md).

# sha256 of criu_4.2.1.orig.tar.xz as listed in Debian sid's Sources index.
CRIU_ORIG_SHA256="${CRIU_ORIG_SHA256:-29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9}"
CRIU_BUILD_DEPS=(
  gcc make patch pkg-config xz-utils
  libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev libnftables-dev libgnutls28-dev uuid-dev
)
# The tests' fake_slow_criu is a copy of this CRIU with one library more (patchelf --add-needed):
# needed whether CRIU is built now or cached.
CRIU_TEST_DEPS=(patchelf)

# The patches, and why each (docs/CRIU_PATCHES.md):
#   0001  a private anonymous VMA marked MADV_HUGEPAGE gets the mark before the restorer
#         reads its pages, not after: 2 MiB faults instead of 4 KiB ones, and the restored
#         process is on huge pages as when dumped (bench/criu_restore, docs/BENCHMARKS.md).
#   0002  the restorer reads the pages image with several threads (DYNSNAP_CRIU_READ_THREADS,
#         default one per CPU up to 16): faulting in, zeroing and copying the process's memory
#         is most of a snapshot wake, and it scales with CPUs.
#   0003  --tree-mntns: a dump takes the tree's mount namespace as CRIU's own, reached through the
#         tree root's /proc/<pid>/root, so CRIU never runs in a worker's mount namespace (its
#         loader would read the pod's /etc/ld.so.preload there): dynsnap/agent/criu.py.
CRIU_PATCH_DIR="$ROOT/hack/patches/criu"
# Sourcing must not need more than bash (tests/unit/test_setup_go.py sources setup.sh with a PATH
# of bash, dirname and mkdir only): without sha256sum the key is "unhashed", and setup_criu, which
# needs coreutils anyway, is never reached there. The key is of the patches' bytes only, so every
# checkout (CI's clean clone too) finds the same build.
CRIU_PATCH_KEY=unhashed
if command -v sha256sum >/dev/null 2>&1; then
  CRIU_PATCH_KEY=$(cat "$CRIU_PATCH_DIR"/*.patch | sha256sum)
  CRIU_PATCH_KEY=${CRIU_PATCH_KEY:0:12}
fi
export DYNSNAP_CRIU_DIR="$CACHE/criu-$CRIU_VERSION-p$CRIU_PATCH_KEY"
export DYNSNAP_CRIU="$DYNSNAP_CRIU_DIR/sbin/criu"

_criu_apt_deps() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  [[ $EUID -eq 0 ]] || die "criu: missing packages (${missing[*]}); install them or run setup as root"
  log "criu: apt-get install ${missing[*]}"
  apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
    || die "apt-get install of CRIU's packages failed"
}

# Fetches criu_$CRIU_VERSION.orig.tar.xz into $CACHE/src through apt, from a
# private deb-src list for sid and forky on the machine's own Debian mirror
# (resolve_debian_mirror, hack/lib-registry.sh; the system's apt sources are read,
# never changed). The Debian patch tarball may 404 on the mirror; only the orig
# tarball is used and it is checked against CRIU_ORIG_SHA256.
_criu_fetch_orig() {
  local tarball="$CACHE/src/criu_$CRIU_VERSION.orig.tar.xz"
  if [[ -f "$tarball" ]] && echo "$CRIU_ORIG_SHA256  $tarball" | sha256sum -c --quiet - 2>/dev/null; then
    return 0
  fi
  local apt="$CACHE/apt-debian-src"
  mkdir -p "$apt/lists/partial" "$apt/dl"
  resolve_debian_mirror
  local suite
  for suite in sid forky; do
    printf 'deb-src %s%s %s main\n' "${DEBIAN_MIRROR_KEYRING:+[signed-by=$DEBIAN_MIRROR_KEYRING] }" \
      "$DEBIAN_MIRROR_URI" "$suite"
  done > "$apt/sources.list"
  local -a opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=-
    -o "Dir::State::Lists=$apt/lists" -o APT::Sandbox::User=root)
  log "criu: fetching criu_$CRIU_VERSION.orig.tar.xz through apt (deb-src sid/forky from $DEBIAN_MIRROR_URI)"
  apt-get "${opts[@]}" update -qq >&2 || die "apt-get update of the private Debian deb-src list failed"
  local ver
  ver=$(apt-cache "${opts[@]}" showsrc criu 2>/dev/null | awk -v v="$CRIU_VERSION" \
    '$1 == "Version:" && index($2, v "-") == 1 {print $2; exit}')
  [[ -n "$ver" ]] || die "criu: no Debian source version $CRIU_VERSION-* in sid or forky"
  # Exit status ignored: the .debian.tar.xz is sometimes missing on the mirror
  # while the orig tarball arrives; the checksum below decides.
  (cd "$apt/dl" && apt-get "${opts[@]}" source --download-only "criu=$ver" >&2) || true
  [[ -f "$apt/dl/criu_$CRIU_VERSION.orig.tar.xz" ]] || die "criu: criu_$CRIU_VERSION.orig.tar.xz did not arrive"
  echo "$CRIU_ORIG_SHA256  $apt/dl/criu_$CRIU_VERSION.orig.tar.xz" | sha256sum -c --quiet - \
    || die "criu: checksum mismatch for criu_$CRIU_VERSION.orig.tar.xz"
  mv "$apt/dl/criu_$CRIU_VERSION.orig.tar.xz" "$tarball"
}

setup_criu() {
  local out="$DYNSNAP_CRIU_DIR"
  _criu_apt_deps "${CRIU_TEST_DEPS[@]}"
  if [[ -x "$out/sbin/criu" && -f "$out/lib/criu/cuda_plugin.so" ]]; then
    log "criu $CRIU_VERSION: cached"; return 0
  fi
  local t0=$SECONDS
  log "criu $CRIU_VERSION: building (cold: ~1-2 min on 2 cores)"
  _criu_apt_deps "${CRIU_BUILD_DEPS[@]}"
  _criu_fetch_orig
  local src="$CACHE/src/criu-$CRIU_VERSION"
  rm -rf "$src" "$out.tmp"
  mkdir -p "$src" "$out.tmp/sbin" "$out.tmp/lib/criu"
  tar -xf "$CACHE/src/criu_$CRIU_VERSION.orig.tar.xz" -C "$src" --strip-components=1 \
    || die "criu: cannot unpack the orig tarball"
  local patch
  for patch in "$CRIU_PATCH_DIR"/*.patch; do
    patch -d "$src" -p1 --forward --quiet < "$patch" || die "criu: $(basename "$patch") does not apply"
  done
  # PLUGINDIR is compiled into criu as its default plugin directory, so it names
  # the final path, not the staging one. No docs (asciidoc/xmlto not needed),
  # no libcriu/crit (python packaging); only the binary and the CUDA plugin.
  make -C "$src" -j"$(nproc)" criu cuda_plugin PLUGINDIR="$out/lib/criu" > "$src/build.log" 2>&1 \
    || { tail -30 "$src/build.log" >&2; die "criu build failed (log: $src/build.log)"; }
  install -m 0755 "$src/criu/criu" "$out.tmp/sbin/criu"
  install -m 0755 "$src/plugins/cuda/cuda_plugin.so" "$out.tmp/lib/criu/cuda_plugin.so"
  "$out.tmp/sbin/criu" --version >/dev/null || die "criu: built binary does not run"
  rm -rf "$out"; mv "$out.tmp" "$out"
  log "criu $CRIU_VERSION: built in $((SECONDS - t0)) s"
  # `criu check` is informative here (e.g. soft-dirty tracking is off on this
  # kernel, which only matters for pre-dump); a hard failure is worth a warning.
  "$DYNSNAP_CRIU" check >/dev/null 2>&1 || log "criu: WARNING: '$DYNSNAP_CRIU check' failed; run it for details"
}
