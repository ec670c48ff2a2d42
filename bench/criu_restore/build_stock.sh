#!/usr/bin/env bash
# Builds stock CRIU 4.2.1 (Debian's orig tarball, none of hack/patches/criu) for comparison in
# bench/criu_restore/thp_restore.py and tests/native/test_criu_patches.py, and prints the
# binary's path. Needs ./run setup first (the tarball and the build packages); ~1-2 min on 2
# cores; cached under ~/.cache/dynsnap/criu-4.2.1-stock.
set -euo pipefail
cache="${DYNSNAP_CACHE:-$HOME/.cache/dynsnap}"
out="$cache/criu-4.2.1-stock"
if [[ ! -x "$out/criu/criu" ]]; then
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  tar -xf "$cache/src/criu_4.2.1.orig.tar.xz" -C "$out.tmp" --strip-components=1
  make -C "$out.tmp" -j"$(nproc)" criu > "$out.tmp/build.log" 2>&1 || { tail -30 "$out.tmp/build.log" >&2; exit 1; }
  rm -rf "$out"; mv "$out.tmp" "$out"
fi
echo "$out/criu/criu"
