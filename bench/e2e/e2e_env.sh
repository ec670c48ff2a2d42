# shellcheck shell=bash
# Sourced by bench/e2e/run_h200*.sh on the GPU machine, from the repository root of the carried tree:
# what every end-to-end run needs before its measurement. Sets OUT (default /tmp/dynsnap-e2e-out),
# ROOT and PARTS (/tmp/e2e-parts, where the parts bench/e2e/split_wheels.sh makes were carried);
# reassembles and unpacks the carried Dynamo packages into /tmp/e2e-py (once per machine: a second run
# skips it), installs the agent's wheels into /tmp/dynsnap-pydeps, sources bench/gpu/gpu_env.sh
# (NVLink multicast off, dynsnap-cuda built here, the driver's libraries) and puts the agent on
# PYTHONPATH. Defines e2e_keep_logs BYTES: the tail of every run log of /tmp/dynsnap-e2e into
# $OUT/logs.txt.
OUT="${OUT:-/tmp/dynsnap-e2e-out}"
ROOT=$(pwd)
PARTS=/tmp/e2e-parts
mkdir -p "$OUT"

if [[ ! -f /tmp/e2e-py/.complete ]]; then
  cat "$PARTS"/e2e-py.tar.xz.* >/tmp/e2e-py.tar.xz
  (cd /tmp && sha256sum -c "$PARTS/SHA256SUMS") || { echo "the parts do not add up: carry them all again"; exit 1; }
  rm -rf /tmp/e2e-py && mkdir -p /tmp/e2e-py && tar -C /tmp/e2e-py -xJf /tmp/e2e-py.tar.xz || exit 1
  touch /tmp/e2e-py/.complete
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/dynsnap-pydeps "$PARTS"/agent-wheels/*.whl \
  >/dev/null 2>&1 || { echo "cannot install the agent's wheels"; exit 1; }
# shellcheck disable=SC1091
source "$ROOT/bench/gpu/gpu_env.sh"
export PYTHONPATH="/tmp/dynsnap-pydeps:$ROOT"

e2e_keep_logs() {
  local f
  for f in /tmp/dynsnap-e2e/*.log; do
    [[ -f $f ]] && { echo "== $f"; tail -c "$1" "$f"; }
  done >"$OUT/logs.txt" 2>&1
}
