#!/usr/bin/env bash
# Packs the CRIU this machine built (hack/lib-criu.sh: CRIU 4.2.1 with dynsnap's patches) into
# .device/criu for the GPU machine, which has glibc but none of CRIU's other libraries:
#   .device/criu/criu                 the binary
#   .device/criu/plugins/cuda_plugin.so
#   .device/criu/lib/                 every library ldd names that is not glibc's own
#   .device/criu/VERSION              the build directory's name (version and patch key)
# bench/gpu/agent_h200.sh and criu_h200.sh run it with LD_LIBRARY_PATH=.device/criu/lib.
# Run from the repository root after ./run setup; carry .device/criu in the device call.
# `pack_criu.sh stock` packs stock CRIU 4.2.1 (bench/criu_restore/build_stock.sh, no plugin) into
# .device/criu-stock instead, for CRIU_BUNDLE=.device/criu-stock bench/gpu/agent_h200.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
eval "$("$ROOT/run" env 2>/dev/null | grep -E '^DYNSNAP_CRIU(_DIR)?=' | sed 's/^/export /')"
[[ -x "${DYNSNAP_CRIU:-}" && -d "${DYNSNAP_CRIU_DIR:-}" ]] || { echo "no CRIU build: run ./run setup" >&2; exit 1; }
out="$ROOT/.device/criu"
if [[ "${1:-}" == stock ]]; then
  DYNSNAP_CRIU=$("$ROOT/bench/criu_restore/build_stock.sh"); DYNSNAP_CRIU_DIR=""; out="$ROOT/.device/criu-stock"
fi
rm -rf "$out.tmp"
mkdir -p "$out.tmp/lib" "$out.tmp/plugins"
install -m 0755 "$DYNSNAP_CRIU" "$out.tmp/criu"
plugin=()
if [[ -n "$DYNSNAP_CRIU_DIR" ]]; then
  plugin=("$DYNSNAP_CRIU_DIR/lib/criu/cuda_plugin.so")
  install -m 0755 "${plugin[0]}" "$out.tmp/plugins/cuda_plugin.so"
fi
# glibc's own libraries come from the GPU machine; everything else travels.
ldd "$DYNSNAP_CRIU" "${plugin[@]}" | awk '/=> \//{print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|libresolv|ld-linux-x86-64)\.so' |
  while read -r lib; do install -m 0644 "$lib" "$out.tmp/lib/"; done
if [[ -n "$DYNSNAP_CRIU_DIR" ]]; then basename "$DYNSNAP_CRIU_DIR"; else echo criu-4.2.1-stock; fi > "$out.tmp/VERSION"
rm -rf "$out"; mv "$out.tmp" "$out"
echo "packed $(cat "$out/VERSION") into $out ($(du -sh "$out" | cut -f1))"
