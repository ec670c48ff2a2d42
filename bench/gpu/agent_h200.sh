#!/usr/bin/env bash
# The node agent's executor (`dynsnap agent exec`) on the GPU machine, against the real CUDA
# driver: a PyTorch process holding GIB GiB with a known pattern (bench/gpu/worker.py) runs under
# dynsnap-entrypoint as PID 1 of its own pid + mount namespace (the way a worker container does,
# with its control directory on a tmpfs only that namespace sees); the agent captures it
# (tier suspend, then tier snapshot) and wakes it, each by one `dynsnap agent exec` call; the
# pattern is checked and new GPU work run after every wake. Beside it, the cold start of the same
# process: a fresh python3 loading the same bytes from local disk onto the GPU
# (bench/gpu/cold_start.py).
#
# Usage (repository root, GPU machine): bench/gpu/agent_h200.sh [sizes] [tiers]
#   sizes: GiB list (default "1 16"); tiers: default "suspend snapshot"
# Expects .device/criu (criu + its non-glibc libraries: bench/gpu/pack_criu.sh) and .device/wheels
# (the agent's packages for the machine's python3: bench/gpu/pack_wheels.sh) carried. CRIU_BUNDLE=.device/criu-stock (pack_criu.sh stock)
# runs the same with stock CRIU 4.2.1, for the comparison of docs/CRIU_PATCHES.md. Also from the
# environment: TAG (appended to every result file's name, so two runs share one $OUT),
# DROP_BEFORE_WAKE=1 (drop the page cache between capture and wake: a wake from a cold cache),
# COLD_START=0 (skip the cold starts). Results in $OUT: agent-<tier>-<gib>.jsonl (every step's JSON line,
# plus a summary line), cold-<gib>.json, agent-summary.json.
set -uo pipefail
OUT="${OUT:-/tmp/dynsnap-agent}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ROOT=$(pwd)
SIZES="${1:-1 16}"; TIERS="${2:-suspend snapshot}"
python3 -m pip install -q --no-index --no-deps --target /tmp/dynsnap-pydeps .device/wheels/*.whl >/dev/null 2>&1 \
  || { echo "cannot install the carried wheels"; exit 1; }
export PYTHONPATH="/tmp/dynsnap-pydeps:$ROOT"
# CRIU's own libraries for CRIU only: the wrapper sets LD_LIBRARY_PATH for the criu process; the
# agent never passes it on (the helpers CRIU could spawn resolve the system's). A wrapper script is the
# agent's own file: dynsnap-nsexec runs it in a mount namespace of its own, a copy of this one, never
# the worker's (dynsnap/agent/criu.py).
mkdir -p /tmp/dynsnap-criu-bin
CRIU_BUNDLE="${CRIU_BUNDLE:-.device/criu}"; TAG="${TAG:-}"
DROP_BEFORE_WAKE="${DROP_BEFORE_WAKE:-0}"; COLD_START="${COLD_START:-1}"
echo "CRIU bundle $CRIU_BUNDLE: $(cat "$ROOT/$CRIU_BUNDLE/VERSION" 2>/dev/null || echo unversioned)"
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$ROOT/$CRIU_BUNDLE/lib" "$ROOT/$CRIU_BUNDLE/criu" \
  >/tmp/dynsnap-criu-bin/criu
chmod +x /tmp/dynsnap-criu-bin/criu
/tmp/dynsnap-criu-bin/criu --version | head -1
CLOSE_FDS="python3 -c 'import os, sys; os.closerange(3, 65536); os.execvp(sys.argv[1], sys.argv[1:])'"
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }

ask() {  # ask CTL CMD: the worker's file protocol (no pipe to it: CRIU dumps it)
  rm -f "$1/out"; echo "$2" >"$1/cmd"
  for _ in $(seq 1 600); do [[ -f $1/out ]] && { cat "$1/out"; return; }; sleep 0.2; done; echo timeout
}

agent() {  # agent W UID EP ACTION TIER
  local w=$1 uid=$2 ep=$3 action=$4 tier=$5
  python3 -m dynsnap agent --images-root "$w/images" --state-dir "$w/state" \
    --cuda-helper "$ROOT/native/build/dynsnap-cuda" --criu /tmp/dynsnap-criu-bin/criu \
    --nsexec "$ROOT/native/build/dynsnap-nsexec" \
    --tcp-established false --network-lock '' \
    exec "$action" --pod-uid "$uid" --entrypoint-pid "$ep" --tier "$tier" --quiesced
}

summary=(); failed=0
for gib in $SIZES; do
  for tier in $TIERS; do
    w=/tmp/dynsnap-agent-$tier-$gib; rm -rf "$w"; mkdir -p "$w/ctl"
    uid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    # A container: its own pid + mount namespace, the entrypoint as PID 1, an emptyDir at /run/dynsnap,
    # and only stdio open (as a runtime starts it: CRIU cannot dump a descriptor opened outside the
    # worker's mount namespace, and this shell's are).
    setsid unshare --pid --fork --kill-child --mount-proc --mount --propagation private -- sh -c \
      "mkdir -p /run/dynsnap && mount -t tmpfs emptydir /run/dynsnap && exec $CLOSE_FDS \
       $ROOT/native/build/dynsnap-entrypoint --control-dir /run/dynsnap --system-port 9090 --probe-port 18081 -- \
       python3 $ROOT/bench/gpu/worker.py --gib $gib --ctl $w/ctl" </dev/null >"$w/container.log" 2>&1 &
    ushare=$!
    ep=""
    for _ in $(seq 1 100); do ep=$(pgrep -P "$ushare" | head -1); [[ -n $ep ]] && break; sleep 0.1; done
    for _ in $(seq 1 900); do [[ -f $w/ctl/out ]] && break; sleep 0.2; done
    ready=$(cat "$w/ctl/out" 2>/dev/null); echo "[$tier $gib GiB] entrypoint $ep, worker: $ready"
    u0=$(used)
    t0=$(date +%s.%N); agent "$w" "$uid" "$ep" capture "$tier" >"$OUT/agent-$tier-$gib$TAG.jsonl" 2>"$w/capture.err"; crc=$?
    t1=$(date +%s.%N); u1=$(used)
    img=$(du -sb "$w/images" 2>/dev/null | cut -f1); img=${img:-0}
    dropped=false
    [[ $DROP_BEFORE_WAKE == 1 ]] && sync && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null && dropped=true
    t2=$(date +%s.%N); agent "$w" "$uid" "$ep" wake "$tier" >>"$OUT/agent-$tier-$gib$TAG.jsonl" 2>"$w/wake.err"; wrc=$?
    t3=$(date +%s.%N); u2=$(used)
    check=$(ask "$w/ctl" check)
    echo "[$tier $gib GiB] capture rc=$crc $(python3 -c "print(round($t1-$t0,3))") s, wake rc=$wrc \
$(python3 -c "print(round($t3-$t2,3))") s, used MiB $u0 -> $u1 -> $u2, check: $check"
    [[ $crc -ne 0 ]] && { failed=1; tail -5 "$w/capture.err"; }
    [[ $wrc -ne 0 ]] && { failed=1; tail -5 "$w/wake.err"; }
    [[ $check == ok* ]] || failed=1
    summary+=("{\"tier\":\"$tier\",\"gib\":$gib,\"capture_rc\":$crc,\"wake_rc\":$wrc,\"capture_s\":$(python3 -c "print($t1-$t0)"),\
\"wake_s\":$(python3 -c "print($t3-$t2)"),\"cache_dropped_before_wake\":$dropped,\
\"criu\":\"$(cat "$ROOT/$CRIU_BUNDLE/VERSION" 2>/dev/null)\",\"used_mib\":[$u0,$u1,$u2],\"image_bytes\":$img,\"check\":\"$check\"}")
    ask "$w/ctl" quit >/dev/null &
    sleep 1; kill -9 "$ushare" 2>/dev/null; pkill -9 -f "worker.py --gib $gib --ctl $w/ctl" 2>/dev/null
    wait "$ushare" 2>/dev/null
    for f in "$w"/images/*/*/dump.log "$w"/images/*/*/restore.log "$w"/images/*/.staging-*/dump.log; do
      [[ -f $f ]] && { echo "== $tier $gib GiB: $f"; grep -iE "error|warn" "$f" | tail -20; tail -2 "$f"; } >>"$OUT/criu$TAG.log"
    done
    { echo "== $tier $gib GiB"; cat "$w/capture.err" "$w/wake.err"; tail -20 "$w/container.log"; } >>"$OUT/stderr$TAG.log"
  done
  [[ $COLD_START == 1 ]] || continue
  # Cold start of the same process: a fresh python3 loads the same bytes from local disk onto the GPU.
  # Rep 1 after dropping the page cache (when the machine lets us), reps 2-3 from a warm cache.
  python3 bench/gpu/cold_start.py --gib "$gib" --file "/tmp/dynsnap-cold-$gib.bin" --write >/dev/null
  for rep in 1 2 3; do
    dropped=false
    [[ $rep -eq 1 ]] && sync && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null && dropped=true
    t0=$(date +%s.%N)
    cold=$(python3 bench/gpu/cold_start.py --gib "$gib" --file "/tmp/dynsnap-cold-$gib.bin")
    t1=$(date +%s.%N)
    echo "[cold $gib GiB rep $rep, cache dropped: $dropped] $(python3 -c "print(round($t1-$t0,3))") s end to end: $cold"
    summary+=("{\"tier\":\"cold\",\"gib\":$gib,\"rep\":$rep,\"cache_dropped\":$dropped,\
\"end_to_end_s\":$(python3 -c "print($t1-$t0)"),\"detail\":${cold:-null}}")
  done
  rm -f "/tmp/dynsnap-cold-$gib.bin"
done
printf '%s\n' "${summary[@]}" >"$OUT/agent-summary$TAG.jsonl"
cat "$OUT/agent-summary$TAG.jsonl"
# A run with a failed capture, wake or pattern check is no result: it says so by its exit status.
[[ $failed == 0 ]] || { echo "FAILED: a capture, a wake or a check did not succeed (above)"; exit 1; }
