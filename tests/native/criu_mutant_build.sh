#!/usr/bin/env bash
# Builds CRIU 4.2.1 with hack/patches/criu/*.patch as they are in the working tree now (a mutant
# of one of them, while tests/native/mutate_criu.py runs) into BUILD/src, and prints nothing.
# The first call unpacks and builds everything (~1 min on 2 cores); later calls put back the
# orig tarball's copy of each file a patch touches, apply the patches again and rebuild only
# what changed (seconds). Needs ./run setup first (the tarball and the build packages).
# Usage: criu_mutant_build.sh BUILD    (the binary: BUILD/src/criu/criu)
set -euo pipefail
build=${1:?usage: criu_mutant_build.sh BUILD}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tarball="${DYNSNAP_CACHE:-$HOME/.cache/dynsnap}/src/criu_4.2.1.orig.tar.xz"
[[ -f "$tarball" ]] || { echo "no $tarball: run ./run setup" >&2; exit 1; }
src="$build/src"
patches=("$root"/hack/patches/criu/*.patch)
if [[ ! -f "$src/Makefile" ]]; then
  rm -rf "$src"; mkdir -p "$src"
  tar -xf "$tarball" -C "$src" --strip-components=1
else
  mapfile -t touched < <(sed -n 's|^+++ b/||p' "${patches[@]}" | sort -u)
  tar -xf "$tarball" -C "$src" --strip-components=1 "${touched[@]/#/criu-4.2.1/}"
fi
for p in "${patches[@]}"; do
  patch -d "$src" -p1 --forward --quiet < "$p" || { echo "$(basename "$p") does not apply" >&2; exit 1; }
done
make -C "$src" -j"$(nproc)" criu > "$src/build.log" 2>&1 || { tail -30 "$src/build.log" >&2; exit 1; }
