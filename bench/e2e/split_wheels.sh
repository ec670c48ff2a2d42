#!/usr/bin/env bash
# Prepares what bench/e2e/run_h200.sh needs on the GPU machine beyond the repository, in parts small
# enough to travel one per device call (a call carries at most 64 MiB, the working tree included),
# and prints the device calls that carry them.
#
#   - Dynamo (ai-dynamo + ai-dynamo-runtime $DYNAMO_VERSION) and every package of
#     hack/dynamo-requirements.txt, as cp312 wheels (the GPU machine's python3 is 3.12 with torch and
#     little else), installed here with `pip install --no-deps --target` for python 3.12 (nothing is
#     compiled: wheels only) and packed as one xz'd tar of that site-packages directory. xz takes the
#     75 MB runtime wheel to ~47 MB and the whole set from ~143 MB to ~95 MB: two parts, not three.
#   - the agent's own dependencies (.device/wheels, made by bench/gpu/pack_wheels.sh, as for
#     bench/gpu/agent_h200.sh), installed on the device with `pip install --no-deps --target`;
#   - the tokenizer-only model directory ($DYNSNAP_MODEL_DIR, ~0.7 MB) the frontend tokenizes with.
#
# Output: .device/e2e/partN/ (N = 1..K, each at most PART_MIB MiB), .device/ is git-ignored.
# Usage (repository root, with `./run env` exported): bench/e2e/split_wheels.sh
# Env: PART_MIB (default 55: the tracked tree is ~6 MiB and the call's limit is 64 MiB in all).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
# shellcheck disable=SC1091
source hack/versions.env
PART_MIB=${PART_MIB:-55}
DEST=.device/e2e
CACHE=${E2E_WHEEL_CACHE:-$HOME/.cache/dynsnap/e2e-wheels-cp312-$DYNAMO_VERSION}
PIP=${DYNSNAP_DYNAMO_VENV:?export ./run env first}/bin/pip
MODEL=${DYNSNAP_MODEL_DIR:?export ./run env first}
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_34_x86_64 --platform any --only-binary=:all:)

reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
grep -v '^#' hack/dynamo-requirements.txt | grep . >"$reqs"
echo "ai-dynamo==$DYNAMO_VERSION" >>"$reqs"
key=$(sha256sum "$reqs" | cut -c1-16)

# 1. The wheels (kept in the cache: a second run downloads nothing).
if [[ "$(cat "$CACHE/.complete" 2>/dev/null)" != "$key" ]]; then
  rm -rf "$CACHE"; mkdir -p "$CACHE/dynamo" "$CACHE/agent"
  "$PIP" download -q --progress-bar off --no-deps "${TARGET[@]}" -d "$CACHE/dynamo" -r "$reqs"
  echo "$key" >"$CACHE/.complete"
fi
# The agent's: what `dynsnap agent` imports, as bench/gpu/pack_wheels.sh packs it for bench/gpu/agent_h200.sh
# (pyproject.toml's pins; before 2026-12-07 this list was pydantic's alone, and the agent, which imports
# tenacity, httpx and prometheus-client too, could not start there).
bench/gpu/pack_wheels.sh >/dev/null
echo "wheels: $(find "$CACHE/dynamo" -name '*.whl' | wc -l) for Dynamo ($(du -sh "$CACHE/dynamo" | cut -f1)), \
$(find .device/wheels -name '*.whl' | wc -l) for the agent ($(du -sh .device/wheels | cut -f1))"

# 2. Dynamo's site-packages for python 3.12, packed (also kept: only a new key repacks).
pack="$CACHE/e2e-py.tar.xz"
if [[ ! -f "$pack" || "$(cat "$CACHE/.packed" 2>/dev/null)" != "$key" ]]; then
  stage="$CACHE/stage"; rm -rf "$stage"
  "$PIP" install -q --no-deps --no-compile --no-index --target "$stage" "${TARGET[@]}" "$CACHE"/dynamo/*.whl
  tar -C "$stage" -cf - . | xz -6 -T0 >"$pack.tmp"
  mv "$pack.tmp" "$pack"; rm -rf "$stage"
  echo "$key" >"$CACHE/.packed"
fi

# 3. Parts: the pack in pieces; the last part also takes the agent's wheels, the model directory and
#    the checksum. 4 MiB of each part are left for those.
rm -rf "$DEST"; mkdir -p "$DEST/chunks"
split -b "$((PART_MIB - 4))M" -d -a 2 "$pack" "$DEST/chunks/e2e-py.tar.xz."
n=0
for chunk in "$DEST"/chunks/*; do
  n=$((n + 1)); mkdir -p "$DEST/part$n"; mv "$chunk" "$DEST/part$n/"
done
rmdir "$DEST/chunks"
(cd "$CACHE" && sha256sum e2e-py.tar.xz) >"$DEST/part$n/SHA256SUMS"
mkdir -p "$DEST/part$n/agent-wheels" "$DEST/part$n/model-tiny"
cp .device/wheels/*.whl "$DEST/part$n/agent-wheels/"
cp "$MODEL"/*.json "$DEST/part$n/model-tiny/"

# 4. Sizes against the call's limit, and the device calls.
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total=0
for ((i = 1; i <= n; i++)); do
  b=$(du -sb "$DEST/part$i" | cut -f1); total=$((total + b))
  travel=$(( (tree + ${untracked:-0} + b) / 1048576 ))
  echo "part$i: $((b / 1048576)) MiB; with the working tree $travel MiB of 64"
  (( travel < 64 )) || { echo "part$i does not fit a call: lower PART_MIB"; exit 1; }
done
echo "total to carry: $((total / 1048576)) MiB in $n parts ($(du -b "$pack" | cut -f1) bytes packed)"
echo
echo "Device calls (consecutive, while the machine stays warm; the last one runs the measurement):"
for ((i = 1; i < n; i++)); do
  echo "  run(carry=[\".device/e2e/part$i\"], timeout_s=120,"
  echo "      command=\"mkdir -p /tmp/e2e-parts && cp -r .device/e2e/part$i/. /tmp/e2e-parts/ && ls -l /tmp/e2e-parts\")"
done
echo "  run(carry=[\".device/e2e/part$n\"], timeout_s=600,"
echo "      command=\"mkdir -p /tmp/e2e-parts && cp -r .device/e2e/part$n/. /tmp/e2e-parts/ && bash bench/e2e/run_h200.sh 16 3 60,2,2\")"
