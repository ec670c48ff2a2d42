#!/usr/bin/env bash
# CRIU 4.2.1 + its CUDA plugin, with dynsnap-cuda as the cuda-checkpoint it
# execs, on the GPU machine: dump and restore a tree of ${WORKERS:-1} PyTorch
# processes (bench/gpu/launcher.py) holding ${GIB:-16} GiB each with a known
# pattern, then check every pattern and new GPU work.
# Expects the criu bundle carried in .device/criu (criu, plugins/, lib/) and
# native/build built (bench/gpu/run_h200.sh builds it). Results:
# $OUT/criu-$NAME.json and the CUDA/error lines of CRIU's logs.
set -uo pipefail
OUT="${OUT:-/tmp/dynsnap-criu}"; mkdir -p "$OUT"
ROOT=$(pwd); GIB="${GIB:-16}"; WORKERS="${WORKERS:-1}"; NAME="${NAME:-single}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=/tmp/criu-$NAME; rm -rf "$W"; mkdir -p "$W/img" "$W/ctl"
# criu's own libraries only for criu; the bundle holds no glibc, so the
# cuda-checkpoint it spawns still resolves libc from the system.
criu() { LD_LIBRARY_PATH="$ROOT/.device/criu/lib" "$ROOT/.device/criu/criu" "$@" --libdir "$ROOT/.device/criu/plugins"; }
export PATH="$ROOT/native/build:$PATH"
ask() {  # ask DIR CMD [tries]
  rm -f "$1/out"; echo "$2" >"$1/cmd"
  for _ in $(seq 1 "${3:-300}"); do [[ -f $1/out ]] && { cat "$1/out"; return; }; sleep 0.2; done; echo timeout
}
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; }
setsid python3 bench/gpu/launcher.py --workers "$WORKERS" --gib "$GIB" --ctl "$W/ctl" </dev/null >"$W/tree.log" 2>&1 &
ROOTPID=$!
PIDS=()
for i in $(seq 0 $((WORKERS - 1))); do
  for _ in $(seq 1 600); do [[ -f $W/ctl/$i/out ]] && break; sleep 0.2; done
  PIDS+=("$(awk '{print $2}' "$W/ctl/$i/out")")
done
echo "tree root $ROOTPID, workers ${PIDS[*]}"
pre=(); for i in $(seq 0 $((WORKERS - 1))); do pre+=("$(ask "$W/ctl/$i" check)"); done
u0=$(used); t0=$(date +%s.%N)
criu dump -t "$ROOTPID" -D "$W/img" -v4 -o dump.log; drc=$?
t1=$(date +%s.%N); u1=$(used)
# Reap the dumped tree: a zombie keeps its pid, and the restore needs it.
wait "$ROOTPID" 2>/dev/null
# (the workers too: while one lives, even as a zombie, the session id, which
# is the root's pid, stays taken)
for p in "$ROOTPID" "${PIDS[@]}"; do
  for _ in $(seq 1 100); do [[ -e /proc/$p ]] || break; sleep 0.1; done
done
ps -o pid,ppid,stat,cmd -p "$(IFS=,; echo "$ROOTPID,${PIDS[*]}")" 2>/dev/null | tail -n +2
img=$(du -sb "$W/img" | cut -f1)
cores=$(for p in "${PIDS[@]}"; do [[ -f $W/img/core-$p.img ]] && echo -n "$p:yes " || echo -n "$p:no "; done)
rrc=-1; t2=0; t3=0; post=()
if [[ $drc -eq 0 ]]; then
  t2=$(date +%s.%N)
  criu restore -D "$W/img" -d -v4 -o restore.log; rrc=$?
  t3=$(date +%s.%N)
  if [[ $rrc -eq 0 ]]; then
    for i in $(seq 0 $((WORKERS - 1))); do post+=("$(ask "$W/ctl/$i" check)"); done
  fi
fi
u2=$(used)
state=$(cuda-checkpoint --get-state --pid "$(IFS=,; echo "${PIDS[*]}")" 2>&1 | tr '\n' ' ')
for f in dump restore; do
  [[ -f $W/img/$f.log ]] && { grep -iE "cuda|error|warn" "$W/img/$f.log" | tail -80; tail -3 "$W/img/$f.log"; } >"$OUT/criu-$NAME-$f.log"
done
python3 - "$OUT/criu-$NAME.json" <<PY
import json, sys
json.dump({"gib_each": $GIB, "workers": $WORKERS, "root_pid": $ROOTPID, "worker_pids": "${PIDS[*]}",
  "dump_rc": $drc, "restore_rc": $rrc, "dump_s": $t1 - $t0, "restore_s": $t3 - $t2,
  "image_bytes": $img, "core_images": "$cores", "used_mib_before_dumped_restored": [$u0, $u1, $u2],
  "pre_check": "${pre[*]}", "post_check": "${post[*]:-}", "state_after": "$state",
  "dump_cmd": "criu dump -t ROOTPID -D IMG -v4 -o dump.log --libdir .device/criu/plugins (cuda-checkpoint on PATH = dynsnap-cuda)",
  "restore_cmd": "criu restore -D IMG -d -v4 -o restore.log --libdir .device/criu/plugins"},
  open(sys.argv[1], "w"), indent=1)
PY
cat "$OUT/criu-$NAME.json"; cat "$OUT/criu-$NAME-dump.log" | tail -15; cat "$OUT/criu-$NAME-restore.log" 2>/dev/null | tail -15
kill -- -"$ROOTPID" 2>/dev/null; kill "${PIDS[@]}" "$ROOTPID" 2>/dev/null; sleep 1; true
