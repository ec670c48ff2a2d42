# shellcheck shell=bash
# dynsnap's three images, built for real from Debian packages: no base-image registry is
# reachable here, so the build files in deploy/images/ (for registries people use) have this
# local twin that needs only the machine's Debian mirror (hack/lib-registry.sh) and PyPI:
#   dynsnap-controller   Debian's python3 + a venv at /opt/dynsnap with dynsnap's wheel (built from
#                        this checkout, without dynsnap.testenv and the demo) and its dependencies'
#                        wheels; runs as uid 65532
#   dynsnap-agent        the same + CRIU $CRIU_VERSION with its CUDA plugin (hack/lib-criu.sh's build),
#                        dynsnap-cuda (+ cuda-checkpoint), dynsnap-nsexec, the runtime libraries CRIU links, iproute2
#                        (ss), dynsnap-install-node-tools; runs as root
#   dynsnap-entrypoint   busybox-static (for `cp`) + the static dynsnap-entrypoint and
#                        libdynsnap-thp.so (the examples' two init containers copy them); uid 65532
#   dynsnap-dynamo       the test environment's Dynamo worker/frontend image (what NVIDIA's
#                        vllm-runtime image is to a cluster): Debian's python3 (3.11, the ABI of the
#                        local Dynamo venv) + a venv at /opt/dynamo with that venv's site-packages
#                        (ai-dynamo and ai-dynamo-runtime $DYNAMO_VERSION and their pinned
#                        dependencies, hack/lib-dynamo.sh) + the tokenizer-only model directory at
#                        /opt/dynamo/model; tagged $DYNAMO_VERSION
# Each root filesystem comes from mmdebstrap; each image is an OCI image layout written by
# hack/oci_image.py. The two Python images have two layers: the Debian tree with a venv of
# dynsnap's dependencies (changes with the packages and the pins: cached), then dynsnap itself
# and the image's own files (changes with every edit of dynsnap/: a few MB, repacked in seconds);
# the entrypoint image is one layer, and so is the Dynamo image (cached apart: it changes only with
# Dynamo's pins and the model directory). tests/integration/test_images.py checks their contents;
# tests/integration/test_real_node_wake.py and tests/integration/node/ run all four as pods of the
# real node.
#
# Cache (all under $CACHE):
#   images-base/<flavor>-<suite>-<hash>.tar   mmdebstrap's trees (key: suite, packages, options)
#   images-base/debs/                          the .debs they came from (a rebuild downloads none)
#   images-wheels-cp<ver>-<hash>/              dependency wheels (key: pyproject.toml, the dev
#                                              venv's pins; the trees' CPython in the name)
#   images-layers/<flavor>-<hash>/             the first layer of a Python image (key: its tree and
#                                              its wheels)
#   images-layers/dynamo-<hash>/               the Dynamo image's layer (key: its tree, the Dynamo
#                                              venv's requirements, the model directory)
#   images-<version>-<hash>/dynsnap-*/         the OCI layouts (key: every input, the dynsnap
#                                              package's sources included); the newest few kept
# Exports DYNSNAP_IMAGES (that images-<version>-<hash> directory).
# Cold: a few minutes; after an edit of dynsnap/: seconds; warm: a hash of the inputs
# (docs/BENCHMARKS.md). Building needs root (mmdebstrap's root mode, chroot).
# Sourced by hack/setup.sh (log/die, $CACHE, $ROOT, versions.env); setup_images is idempotent and
# builds under a lock when setups run at once.

IMAGES_PY_PKGS=(python3 ca-certificates)
# CRIU's runtime libraries (the -dev packages hack/lib-criu.sh builds with, as libraries), iproute2 for
# `ss -K` (the agent resets a woken worker's stale API-server connections with it) and nftables for `nft`
# (the agent clears the network lock a cut-off dump left: dynsnap/agent/netlock.py).
IMAGES_AGENT_PKGS=("${IMAGES_PY_PKGS[@]}" iproute2 nftables libprotobuf-c1 libnl-3-200 libnet1 libbsd0 libnftables1
  libgnutls30 libuuid1)
# The Dynamo image's tree: Dynamo's compiled modules (its runtime, tokenizers) link libstdc++.
IMAGES_DYNAMO_PKGS=("${IMAGES_PY_PKGS[@]}" libstdc++6)
IMAGES_KEEP=3   # image directories of other inputs kept (other checkouts, a branch switched back)

_images_apt_deps() {
  local missing=() p
  for p in mmdebstrap eatmydata; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  [[ $EUID -eq 0 ]] || die "images: missing packages (${missing[*]}); install them or run setup as root"
  log "images: apt-get install ${missing[*]}"
  apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
    || die "apt-get install of ${missing[*]} failed"
}

# The Debian release the images are made of: this machine's own (the CRIU and dynsnap-cuda put
# into the agent image were built here, against its libraries), else bookworm.
_images_suite() {
  if [[ -n "${DYNSNAP_IMAGES_SUITE:-}" ]]; then echo "$DYNSNAP_IMAGES_SUITE"; return; fi
  local id="" codename=""
  # shellcheck disable=SC1090  # os-release, or the test seam hack/lib-registry.sh also reads
  read -r id codename < <(set +u; . "${DYNSNAP_OS_RELEASE:-/etc/os-release}"; printf '%s %s\n' "${ID:-}" \
    "${VERSION_CODENAME:-}")
  if [[ "$id" == debian && -n "$codename" ]]; then echo "$codename"; else echo bookworm; fi
}

# _images_base FLAVOR VARIANT PKG...: print the path of mmdebstrap's tree for these packages,
# making it first when it is not cached.
_images_base() {
  local flavor="$1" variant="$2"; shift 2
  local suite; suite=$(_images_suite)
  local debs="$CACHE/images-base/debs"
  # Documentation stays out (a tenth of the tree), the copyright files stay in (the licences of
  # what the image redistributes).
  local -a opts=(--mode=root "--variant=$variant" --format=tar --skip=output/dev --skip=output/mknod
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*')
  # bookworm's essential set would pull in usrmerge (and with it perl); the hook merges /usr itself.
  # eatmydata: dpkg's fsyncs are pointless for a tree that becomes a tarball (a third of the time).
  # Neither applies to the extract variant (no dpkg runs).
  if [[ "$variant" != extract ]]; then
    opts+=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr --hook-dir=/usr/share/mmdebstrap/hooks/eatmydata)
  fi
  local key; key=$(printf '%s\n' "$suite" "${opts[@]}" "$@" | sha256sum | cut -c1-12)
  local out="$CACHE/images-base/$flavor-$suite-$key.tar"
  if [[ -f "$out" ]]; then echo "$out"; return 0; fi
  resolve_debian_mirror
  mkdir -p "$debs"
  local t0=$SECONDS
  local include; include=$(IFS=,; echo "$*")
  # The debs are kept between builds: the second and later trees download nothing.
  # shellcheck disable=SC2016  # "$1" is the hooks' own argument (the tree), expanded by mmdebstrap
  # The build machine's resolver and host name are no part of an image (the runtime provides them).
  mmdebstrap "${opts[@]}" \
    ${DEBIAN_MIRROR_KEYRING:+"--keyring=$DEBIAN_MIRROR_KEYRING"} "--include=$include" \
    --skip=essential/unlink --setup-hook='mkdir -p "$1"/var/cache/apt/archives' \
    --setup-hook="sync-in $debs /var/cache/apt/archives/" \
    --customize-hook="sync-out /var/cache/apt/archives $debs" \
    --customize-hook='rm -f "$1"/etc/resolv.conf "$1"/etc/hostname; touch "$1"/etc/resolv.conf "$1"/etc/hostname' \
    "$suite" "$out.tmp" "$DEBIAN_MIRROR_URI" > "$CACHE/images-base/$flavor.log" 2>&1 \
    || { tail -20 "$CACHE/images-base/$flavor.log" >&2; rm -f "$out.tmp"
         die "images: mmdebstrap of the $flavor tree failed (log: $CACHE/images-base/$flavor.log)"; }
  mv "$out.tmp" "$out"
  log "images: $flavor tree ($suite: $*) in $((SECONDS - t0)) s"
  echo "$out"
}

# A hash of the dynsnap package as the images carry it (its sources, not its bytecode).
_images_src_hash() {
  (cd "$ROOT" && find dynsnap -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path 'dynsnap/testenv/*' \
     ! -path dynsnap/demo.py -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; sha256sum pyproject.toml) \
    | sha256sum | cut -c1-16
}

# dynsnap's wheel, built from a copy of the checkout without dynsnap.testenv (the local test
# environment: the harness, and cryptography for its certificates) and the demo that needs it.
_images_dynsnap_wheel() {
  local dest="$1" src; src=$(mktemp -d)
  cp "$ROOT/pyproject.toml" "$src/"
  (cd "$ROOT" && tar --exclude=__pycache__ --exclude='*.pyc' --exclude=dynsnap/testenv \
     --exclude=dynsnap/demo.py -cf - dynsnap) | tar -xf - -C "$src"
  "$DYNSNAP_VENV/bin/pip" wheel -q --no-deps --no-build-isolation -w "$dest" "$src" >&2 \
    || { rm -rf "$src"; die "images: building dynsnap's wheel failed"; }
  rm -rf "$src"
}

# _images_wheels PYVER: print the directory of the dependency wheels for CPython PYVER (3.11),
# downloading them when not cached. Pinned to the versions the dev venv (the one the tests run
# in) holds, so the images carry what the tests proved; pip itself is among them, for the
# install inside the tree.
_images_wheels() {
  local pyver="$1" pins; pins=$(mktemp)
  "$DYNSNAP_VENV/bin/pip" freeze --exclude-editable --all > "$pins"
  local key; key=$(cat "$ROOT/pyproject.toml" "$pins" | sha256sum | cut -c1-12)
  local dir="$CACHE/images-wheels-cp${pyver/./}-$key"
  if [[ -f "$dir/.complete" ]]; then rm -f "$pins"; echo "$dir"; return 0; fi
  local whl; whl=$(mktemp -d)
  _images_dynsnap_wheel "$whl"
  rm -rf "$dir"; mkdir -p "$dir"
  local pip_ver; pip_ver=$("$DYNSNAP_VENV/bin/pip" --version | awk '{print $2}')
  local m; m=$(uname -m)
  log "images: downloading the wheels of dynsnap's dependencies for CPython $pyver"
  # Binary wheels only, for the image's CPython on glibc: nothing is compiled in the image.
  "$DYNSNAP_VENV/bin/pip" download -q --only-binary=:all: --implementation cp --python-version "$pyver" \
    --abi "cp${pyver/./}" --platform "manylinux_2_36_$m" --platform "manylinux_2_28_$m" \
    --platform "manylinux_2_17_$m" --platform "manylinux2014_$m" -c "$pins" -d "$dir" \
    "$whl"/dynsnap-*.whl "pip==$pip_ver" >&2 \
    || { rm -rf "$dir" "$whl" "$pins"; die "images: pip download of dynsnap's dependencies failed"; }
  rm -f "$dir"/dynsnap-*.whl; rm -rf "$whl" "$pins"
  touch "$dir/.complete"
  echo "$dir"
}

# Scratch space for the trees: tmpfs when it has room (unpacking and packing a 200 MB tree is
# mostly disk writes: 4 s there against 13 s on this disk), else the cache's disk. Only builds
# under the lock use it, so whatever an interrupted build left there is removed first.
_images_scratch() {
  local shm=/dev/shm
  if [[ -d $shm && -w $shm ]] && (( $(df -Pk "$shm" | awk 'NR == 2 {print $4}') > 2 * 1024 * 1024 )); then
    echo "$shm"
  else
    echo "$CACHE"
  fi
}

_IMAGES_CHROOT_ENV=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8)
# Bump when what _images_deps_layer puts into a layer changes (its cache key).
IMAGES_DEPS_RECIPE=1

# _images_deps_dir FLAVOR BASE.tar WHEELS: where that first layer is cached.
_images_deps_dir() {
  local key; key=$(printf '%s\n' "$IMAGES_DEPS_RECIPE" "$(basename "$2")" "$(basename "$3")" | sha256sum | cut -c1-12)
  echo "$CACHE/images-layers/$1-$key"
}

# _images_deps_layer FLAVOR BASE.tar WHEELS: print the directory holding the first layer of a
# Python image (layer.json + its blob), making it when not cached: mmdebstrap's tree + a venv at
# /opt/dynsnap with every dependency wheel installed by the tree's own Python (scripts say
# #!/opt/dynsnap/bin/python), from the wheels only (--no-index); pip runs from its wheel and
# stays out of the venv. dynsnap itself goes into the second layer (it changes far more often).
_images_deps_layer() {
  local flavor="$1" base="$2" wheels="$3"
  local dir; dir=$(_images_deps_dir "$flavor" "$base" "$wheels")
  if [[ -f "$dir/.complete" ]]; then echo "$dir"; return 0; fi
  local t0=$SECONDS tree; tree=$(mktemp -d "$IMAGES_WORK/deps-tree.XXXXXX")
  tar -xf "$base" -C "$tree" || die "images: unpacking $base failed"
  "${_IMAGES_CHROOT_ENV[@]}" chroot "$tree" /usr/bin/python3 -m venv --without-pip /opt/dynsnap \
    || die "images: python3 -m venv in the $flavor tree failed"
  mkdir -p "$tree/tmp/wheels"
  cp "$wheels"/*.whl "$tree/tmp/wheels/"
  local pip_whl="" w
  local -a deps=()
  for w in "$tree"/tmp/wheels/*.whl; do
    w=$(basename "$w")
    if [[ "$w" == pip-* ]]; then pip_whl="$w"; else deps+=("/tmp/wheels/$w"); fi
  done
  "${_IMAGES_CHROOT_ENV[@]}" chroot "$tree" /opt/dynsnap/bin/python "/tmp/wheels/$pip_whl/pip" install -q \
    --no-index --no-deps --no-cache-dir --disable-pip-version-check "${deps[@]}" >&2 \
    || die "images: pip install of dynsnap's dependencies in the $flavor tree failed"
  rm -rf "$tree/tmp/wheels" "$tree/root/.cache"
  rm -rf "$dir"; mkdir -p "$dir"
  "$DYNSNAP_VENV/bin/python" "$ROOT/hack/oci_image.py" layer --rootfs "$tree" --out "$dir/layer.json" >/dev/null \
    || die "images: packing the $flavor dependency layer failed"
  rm -rf "$tree"
  touch "$dir/.complete"
  log "images: $flavor dependency layer in $((SECONDS - t0)) s"
  echo "$dir"
}

# _images_top_layer TREE MARKER OUT.json: a layer of what changed in TREE after MARKER was
# touched (new and rewritten files, their directories up to the root).
_images_top_layer() {
  local tree="$1" marker="$2" out="$3" list; list=$(mktemp)
  (cd "$tree" && find . -newer "$marker" ! -path . -print | awk '
     { p = $0; print p; while (sub(/\/[^\/]*$/, "", p) && p != ".") if (!seen[p]++) print p }' \
     | LC_ALL=C sort -u) > "$list"
  "$DYNSNAP_VENV/bin/python" "$ROOT/hack/oci_image.py" layer --rootfs "$tree" --files-from "$list" --out "$out" >/dev/null \
    || { rm -f "$list"; die "images: packing $out failed"; }
  rm -f "$list"
}

# _images_image NAME LAYOUT CONFIG_JSON HISTORY_JSON LAYER.json...: write the image layout.
_images_image() {
  local name="$1" layout="$2" config="$3" history="$4"; shift 4
  local spec; spec=$(mktemp)
  printf '{"name": "%s", "tag": "%s", "created": "%s", "config": %s, "history": %s}\n' \
    "$name" "$IMAGES_TAG" "$IMAGES_CREATED" "$config" "$history" > "$spec"
  "$DYNSNAP_VENV/bin/python" "$ROOT/hack/oci_image.py" image --layout "$layout" --spec "$spec" "$@" >> "$layout.summary" \
    || { rm -f "$spec"; die "images: writing the $name layout failed"; }
  rm -f "$spec"
}

# _images_python_image NAME FLAVOR BASE.tar WHEELS DYNSNAP_WHEEL_DIR OUT EXTRA_FN CONFIG HISTORY:
# layer 1 from _images_deps_layer; layer 2: dynsnap's wheel installed on top (--no-deps) and what
# EXTRA_FN TREE adds (the image's own files).
_images_python_image() {
  local name="$1" flavor="$2" base="$3" wheels="$4" dwheel="$5" out="$6" extra="$7" config="$8" history="$9"
  local t0=$SECONDS deps; deps=$(_images_deps_layer "$flavor" "$base" "$wheels")
  local tree="$IMAGES_WORK/$flavor" marker="$IMAGES_WORK/$flavor.marker"
  mkdir -p "$tree"
  tar -xzf "$deps/$("$DYNSNAP_VENV/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["blob"])' "$deps/layer.json")" \
    -C "$tree" || die "images: unpacking the $flavor dependency layer failed"
  touch "$marker"
  mkdir -p "$tree/tmp/wheels"
  cp "$dwheel"/dynsnap-*.whl "$wheels"/pip-*.whl "$tree/tmp/wheels/"
  local pip_whl dyn_whl
  pip_whl=$(cd "$tree/tmp/wheels" && ls pip-*.whl) dyn_whl=$(cd "$tree/tmp/wheels" && ls dynsnap-*.whl)
  "${_IMAGES_CHROOT_ENV[@]}" chroot "$tree" /opt/dynsnap/bin/python "/tmp/wheels/$pip_whl/pip" install -q \
    --no-index --no-deps --no-cache-dir --disable-pip-version-check "/tmp/wheels/$dyn_whl" >&2 \
    || die "images: pip install of dynsnap in the $flavor tree failed"
  rm -rf "$tree/tmp/wheels" "$tree/root/.cache"
  "$extra" "$tree"
  _images_top_layer "$tree" "$marker" "$IMAGES_WORK/$name-top.json"
  _images_image "$name" "$out/$name" "$config" "$history" "$deps/layer.json" "$IMAGES_WORK/$name-top.json"
  rm -rf "$tree"
  log "images: $name in $((SECONDS - t0)) s"
}

# Bump when what _images_dynamo_layer puts into the layer changes (its cache key).
IMAGES_DYNAMO_RECIPE=1

# _images_dynamo_dir BASE.tar: where the Dynamo image's layer is cached.
_images_dynamo_dir() {
  local key; key=$( { printf '%s\n' "$IMAGES_DYNAMO_RECIPE" "$DYNAMO_VERSION" "$(basename "$1")"
    cat "$DYNSNAP_DYNAMO_VENV/.complete"; (cd "$DYNSNAP_MODEL_DIR" && LC_ALL=C sha256sum -- *); } \
    | sha256sum | cut -c1-12)
  echo "$CACHE/images-layers/dynamo-$key"
}

# _images_dynamo_layer BASE.tar PYVER: print the directory holding the Dynamo image's one layer
# (layer.json + its blob), making it when not cached: mmdebstrap's python tree, a venv at /opt/dynamo
# made by the tree's own python3 and filled with the local Dynamo venv's site-packages (pip left
# out: nothing is installed in the image), the model directory at /opt/dynamo/model. The wheels'
# compiled modules are for CPython PYVER (the ABI): the local venv must be of the same minor version.
# Its bytecode stays (3.11.x share one magic number): a worker starts without compiling 700 MB.
_images_dynamo_layer() {
  local base="$1" pyver="$2"
  local dir; dir=$(_images_dynamo_dir "$base")
  if [[ -f "$dir/.complete" ]]; then echo "$dir"; return 0; fi
  local site="$DYNSNAP_DYNAMO_VENV/lib/python$pyver/site-packages"
  [[ -d "$site" ]] || die "images: the Dynamo venv ($DYNSNAP_DYNAMO_VENV) has no python$pyver site-packages: \
the image's python3 is $pyver, and Dynamo's compiled modules are built for one CPython minor version"
  local t0=$SECONDS tree; tree=$(mktemp -d "$IMAGES_WORK/dynamo-tree.XXXXXX")
  tar -xf "$base" -C "$tree" || die "images: unpacking $base failed"
  "${_IMAGES_CHROOT_ENV[@]}" chroot "$tree" /usr/bin/python3 -m venv --without-pip /opt/dynamo \
    || die "images: python3 -m venv in the dynamo tree failed"
  tar -C "$site" --exclude='./pip' --exclude='./pip-*.dist-info' -cf - . \
    | tar -C "$tree/opt/dynamo/lib/python$pyver/site-packages" -xf - \
    || die "images: copying the Dynamo venv's site-packages failed"
  mkdir -p "$tree/opt/dynamo/model"
  (cd "$DYNSNAP_MODEL_DIR" && cp -- *.json "$tree/opt/dynamo/model/") || die "images: copying the model directory failed"
  # Dynamo's own check (hack/lib-dynamo.sh's), by Debian's python3 in the tree.
  "${_IMAGES_CHROOT_ENV[@]}" chroot "$tree" /opt/dynamo/bin/python3 -c 'import dynamo.frontend, dynamo.mocker, dynamo._core' \
    || die "images: dynamo.frontend / dynamo.mocker do not import in the dynamo tree"
  rm -rf "$tree/root/.cache"
  rm -rf "$dir"; mkdir -p "$dir"
  "$DYNSNAP_VENV/bin/python" "$ROOT/hack/oci_image.py" layer --rootfs "$tree" --out "$dir/layer.json" >/dev/null \
    || die "images: packing the dynamo layer failed"
  rm -rf "$tree"
  touch "$dir/.complete"
  log "images: dynamo layer in $((SECONDS - t0)) s"
  echo "$dir"
}

_images_controller_files() {
  # The controller's user: not root, and named, so that tools inside show a name.
  echo "dynsnap:x:65532:65532:dynsnap:/nonexistent:/usr/sbin/nologin" >> "$1/etc/passwd"
  echo "dynsnap:x:65532:" >> "$1/etc/group"
}

_images_agent_files() {
  local t="$1" native="$ROOT/native/build"
  # shellcheck disable=SC2153  # DYNSNAP_CRIU: exported by hack/lib-criu.sh
  install -D -m 0755 "$DYNSNAP_CRIU" "$t/usr/local/sbin/criu"
  install -D -m 0755 "$DYNSNAP_CRIU_DIR/lib/criu/cuda_plugin.so" "$t/usr/local/lib/criu/cuda_plugin.so"
  install -D -m 0755 "$native/dynsnap-cuda" "$t/usr/local/bin/dynsnap-cuda"
  ln -sfn dynsnap-cuda "$t/usr/local/bin/cuda-checkpoint"
  # CRIU's and ss's launcher into a worker's namespaces (never its mount namespace): dynsnap/agent/nsexec.py
  install -D -m 0755 "$native/dynsnap-nsexec" "$t/usr/local/bin/dynsnap-nsexec"
  install -D -m 0755 "$ROOT/deploy/images/agent/dynsnap-install-node-tools" "$t/usr/local/bin/dynsnap-install-node-tools"
  "${_IMAGES_CHROOT_ENV[@]}" chroot "$t" /usr/local/sbin/criu --version >/dev/null \
    || die "images: CRIU does not run in the agent tree (a runtime library missing from IMAGES_AGENT_PKGS?)"
}

# A fresh work directory under the scratch space (IMAGES_WORK), whatever an interrupted build left
# there removed first. Under the images lock.
_images_work() {
  local scratch; scratch=$(_images_scratch)
  rm -rf "$scratch"/dynsnap-images-build.*
  IMAGES_WORK=$(mktemp -d "$scratch/dynsnap-images-build.XXXXXX")
}

# The parts every image is made from, each cached under its own key (made when not cached): the four
# mmdebstrap trees, the trees' CPython version and the dependency wheels for it. Sets the caller's
# locals py_base, agent_base, bb_base, dyn_base, pyver and wheels.
_images_parts() {
  py_base=$(_images_base python essential "${IMAGES_PY_PKGS[@]}")
  agent_base=$(_images_base agent essential "${IMAGES_AGENT_PKGS[@]}")
  bb_base=$(_images_base busybox extract busybox-static)
  dyn_base=$(_images_base dynamo essential "${IMAGES_DYNAMO_PKGS[@]}")
  # The wheels are for the trees' CPython (Debian's python3 of that release).
  pyver=$(tar -tf "$py_base" | sed -n 's|^\./usr/bin/python\(3\.[0-9]*\)$|\1|p' | head -1)
  [[ -n "$pyver" ]] || die "images: no python3 in the $py_base tree"
  wheels=$(_images_wheels "$pyver")
}

# What of the images needs neither native/ nor CRIU's build: the parts above, both Python images'
# dependency layers and the Dynamo image's layer (after Dynamo's venv and the model directory). On a
# cold machine hack/setup.sh makes them beside the Go builds (they wait on apt, pip and the disk more
# than on the CPU), so setup_images after native/ only adds the top layers. Says nothing when all of
# it is cached. Needs root, as setup_images does; without it, setup_images says so later.
setup_images_parts() {
  [[ $EUID -eq 0 ]] || return 0
  _images_apt_deps
  mkdir -p "$CACHE/images-base" "$CACHE/images-layers"
  local lock; exec {lock}>"$CACHE/images-base/.lock"
  flock "$lock"
  _images_work
  local py_base agent_base bb_base dyn_base pyver wheels
  _images_parts
  _images_deps_layer python "$py_base" "$wheels" >/dev/null
  _images_deps_layer agent "$agent_base" "$wheels" >/dev/null
  _images_dynamo_layer "$dyn_base" "$pyver" >/dev/null
  rm -rf "$IMAGES_WORK"
  exec {lock}>&-
}

setup_images() {
  local version; version=$("$DYNSNAP_VENV/bin/python" -c 'import sys,tomllib; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' \
    "$ROOT/pyproject.toml") || die "images: cannot read the version from pyproject.toml"
  local native="$ROOT/native/build"
  local -a inputs=("$DYNSNAP_CRIU" "$DYNSNAP_CRIU_DIR/lib/criu/cuda_plugin.so" "$native/dynsnap-cuda"
    "$native/dynsnap-nsexec" "$native/dynsnap-entrypoint" "$native/libdynsnap-thp.so" "$ROOT/hack/lib-images.sh" "$ROOT/hack/oci_image.py"
    "$ROOT/deploy/images/agent/dynsnap-install-node-tools")
  local f; for f in "${inputs[@]}" "$DYNSNAP_DYNAMO_VENV/.complete" "$DYNSNAP_MODEL_DIR/.complete"; do
    [[ -f "$f" ]] || die "images: $f is missing (built earlier in setup)"
  done
  # Everything the images are made of; the dev venv's package list stands for the pinned wheels.
  local key; key=$( { printf '%s\n' "$version" "$(_images_suite)" "${IMAGES_AGENT_PKGS[@]}" "${IMAGES_DYNAMO_PKGS[@]}"
    _images_src_hash
    sha256sum "${inputs[@]}" | cut -d' ' -f1; ls "$DYNSNAP_VENV"/lib/python3*/site-packages
    echo "$DYNAMO_VERSION"; cat "$DYNSNAP_DYNAMO_VENV/.complete"; (cd "$DYNSNAP_MODEL_DIR" && sha256sum -- *); } \
    | sha256sum | cut -c1-12)
  local out="$CACHE/images-$version-$key"
  export DYNSNAP_IMAGES="$out"
  if [[ -f "$out/.complete" ]]; then log "images $version: cached ($out)"; return 0; fi
  _images_apt_deps
  [[ $EUID -eq 0 ]] || die "images: building them needs root (mmdebstrap's root mode, chroot)"
  mkdir -p "$CACHE/images-base" "$CACHE/images-layers"
  exec {_images_lock}>"$CACHE/images-base/.lock"
  flock "$_images_lock"
  if [[ -f "$out/.complete" ]]; then flock -u "$_images_lock"; log "images $version: cached ($out)"; return 0; fi
  local t0=$SECONDS
  _images_work
  log "images $version: building dynsnap-controller, dynsnap-agent, dynsnap-entrypoint, dynsnap-dynamo"
  local py_base agent_base bb_base dyn_base pyver wheels
  _images_parts
  IMAGES_TAG="$version"
  IMAGES_CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  local dwheel="$IMAGES_WORK/dynsnap-wheel"; mkdir -p "$dwheel"; _images_dynsnap_wheel "$dwheel"
  local suite; suite=$(_images_suite)
  local labels="\"org.opencontainers.image.version\": \"$version\", \"org.opencontainers.image.source\": \"deploy/images\""
  local path="PATH=/opt/dynsnap/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

  _images_python_image dynsnap-controller python "$py_base" "$wheels" "$dwheel" "$out.tmp" _images_controller_files \
    "{\"Entrypoint\": [\"/opt/dynsnap/bin/dynsnap\"], \"Cmd\": [\"controller\"], \"User\": \"65532:65532\",
      \"WorkingDir\": \"/\", \"Env\": [\"$path\", \"PYTHONDONTWRITEBYTECODE=1\"],
      \"Labels\": {$labels, \"org.opencontainers.image.title\": \"dynsnap-controller\"}}" \
    "[\"mmdebstrap $suite ${IMAGES_PY_PKGS[*]} + /opt/dynsnap venv: dynsnap's dependencies\",
      \"dynsnap $version (wheel, without dynsnap.testenv), user dynsnap (65532)\"]"

  _images_python_image dynsnap-agent agent "$agent_base" "$wheels" "$dwheel" "$out.tmp" _images_agent_files \
    "{\"Entrypoint\": [\"/opt/dynsnap/bin/dynsnap\"], \"Cmd\": [\"agent\"], \"User\": \"0:0\",
      \"WorkingDir\": \"/\", \"Env\": [\"$path\", \"PYTHONDONTWRITEBYTECODE=1\",
        \"DYNSNAP_AGENT_CRIU=/var/lib/dynsnap/bin/criu\", \"DYNSNAP_AGENT_CRIU_LIBDIR=/var/lib/dynsnap/lib/criu\",
        \"DYNSNAP_AGENT_CUDA_HELPER=/var/lib/dynsnap/bin/dynsnap-cuda\",
        \"NVIDIA_VISIBLE_DEVICES=all\", \"NVIDIA_DRIVER_CAPABILITIES=compute,utility\"],
      \"Labels\": {$labels, \"org.opencontainers.image.title\": \"dynsnap-agent\"}}" \
    "[\"mmdebstrap $suite ${IMAGES_AGENT_PKGS[*]} + /opt/dynsnap venv: dynsnap's dependencies\",
      \"dynsnap $version (wheel, without dynsnap.testenv), CRIU $CRIU_VERSION + CUDA plugin, dynsnap-cuda\"]"

  # dynsnap-entrypoint: busybox (the init container's `cp`) and the static binary, nothing else.
  local t1=$SECONDS ep="$IMAGES_WORK/entrypoint" bb="$IMAGES_WORK/busybox"
  mkdir -p "$bb" "$ep/bin" "$ep/usr/local/bin" "$ep/etc" "$ep/tmp" "$ep/usr/share/doc/busybox-static"
  tar -xf "$bb_base" -C "$bb"
  local bbin; bbin=$(find "$bb" -path '*/bin/busybox' -type f | head -1)
  [[ -n "$bbin" ]] || die "images: no busybox in $bb_base"
  install -m 0755 "$bbin" "$ep/bin/busybox"
  ln -s busybox "$ep/bin/cp"; ln -s busybox "$ep/bin/sh"
  if [[ -f "$bb/usr/share/doc/busybox-static/copyright" ]]; then
    cp "$bb/usr/share/doc/busybox-static/copyright" "$ep/usr/share/doc/busybox-static/"
  fi
  install -m 0755 "$native/dynsnap-entrypoint" "$ep/usr/local/bin/dynsnap-entrypoint"
  # The examples' second init container (dynsnap-thp) copies it next to the entrypoint, which preloads it.
  install -m 0644 "$native/libdynsnap-thp.so" "$ep/usr/local/bin/libdynsnap-thp.so"
  chmod 1777 "$ep/tmp"
  printf 'root:x:0:0:root:/root:/bin/sh\ndynsnap:x:65532:65532:dynsnap:/nonexistent:/bin/false\n' > "$ep/etc/passwd"
  printf 'root:x:0:\ndynsnap:x:65532:\n' > "$ep/etc/group"
  "$DYNSNAP_VENV/bin/python" "$ROOT/hack/oci_image.py" layer --rootfs "$ep" --out "$IMAGES_WORK/entrypoint.json" >/dev/null \
    || die "images: packing the entrypoint layer failed"
  _images_image dynsnap-entrypoint "$out.tmp/dynsnap-entrypoint" \
    "{\"Cmd\": [\"cp\", \"/usr/local/bin/dynsnap-entrypoint\", \"/dynsnap/bin/dynsnap-entrypoint\"],
      \"User\": \"65532:65532\", \"WorkingDir\": \"/\", \"Env\": [\"PATH=/bin\"],
      \"Labels\": {$labels, \"org.opencontainers.image.title\": \"dynsnap-entrypoint\"}}" \
    "[\"busybox-static ($suite) + native/build/dynsnap-entrypoint, libdynsnap-thp.so\"]" "$IMAGES_WORK/entrypoint.json"
  log "images: dynsnap-entrypoint in $((SECONDS - t1)) s"

  # dynsnap-dynamo: `python3` on PATH is the venv's (a DGD's `python3 -m dynamo.frontend` as written).
  local t2=$SECONDS dyn; dyn=$(_images_dynamo_layer "$dyn_base" "$pyver")
  IMAGES_TAG="$DYNAMO_VERSION" _images_image dynsnap-dynamo "$out.tmp/dynsnap-dynamo" \
    "{\"Cmd\": [\"python3\"], \"User\": \"0:0\", \"WorkingDir\": \"/\",
      \"Env\": [\"PATH=/opt/dynamo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\"],
      \"Labels\": {\"org.opencontainers.image.version\": \"$DYNAMO_VERSION\",
                   \"org.opencontainers.image.source\": \"hack/lib-images.sh\",
                   \"org.opencontainers.image.title\": \"dynsnap-dynamo\"}}" \
    "[\"mmdebstrap $suite ${IMAGES_DYNAMO_PKGS[*]} + /opt/dynamo venv: ai-dynamo $DYNAMO_VERSION (hack/lib-dynamo.sh's) + model-tiny\"]" \
    "$dyn/layer.json"
  log "images: dynsnap-dynamo in $((SECONDS - t2)) s"

  rm -rf "$IMAGES_WORK"
  # Trees, layers and wheels of other inputs (an older package list or pins) are not used again.
  local f py_deps agent_deps
  py_deps=$(_images_deps_dir python "$py_base" "$wheels") agent_deps=$(_images_deps_dir agent "$agent_base" "$wheels")
  for f in "$CACHE"/images-base/*.tar "$CACHE"/images-layers/*/ "$CACHE"/images-wheels-*/; do
    case "${f%/}" in
      "$py_base" | "$agent_base" | "$bb_base" | "${wheels%/}" | "$py_deps" | "$agent_deps" | "$dyn_base" | "$dyn") ;;
      *) rm -rf "$f" ;;
    esac
  done
  cat "$out.tmp"/*.summary > "$out.tmp/images.jsonl"; rm -f "$out.tmp"/*.summary
  touch "$out.tmp/.complete"
  rm -rf "$out"; mv "$out.tmp" "$out"
  # Keep the newest few image directories of other inputs, drop older ones.
  local old
  # shellcheck disable=SC2012  # our own directory names: no odd characters
  old=$(ls -1dt "$CACHE"/images-[0-9]*-*/ 2>/dev/null | { grep -vF "$out/" || true; } \
    | tail -n +"$((IMAGES_KEEP + 1))")
  if [[ -n "$old" ]]; then echo "$old" | xargs -r rm -rf; fi
  flock -u "$_images_lock"
  log "images $version: built in $((SECONDS - t0)) s ($out)"
}
