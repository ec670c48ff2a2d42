"""The CUDA driver checkpoint API called directly through ctypes, with nothing else.

A yardstick for dynsnap-cuda (bench/gpu/ckpt_variants.py): this process loads
libcuda.so.1 and makes only the checkpoint calls. It enumerates no device,
creates no context and, unless ``--init`` is given, does not call ``cuInit``
(it calls it only if the driver answers CUDA_ERROR_NOT_INITIALIZED, and says
so). Prints one JSON line with each driver call's milliseconds.

    python3 bench/gpu/raw_ckpt.py save|resume|lock|checkpoint|restore|unlock PID [--init]

``save`` is lock (10000 ms timeout, as dynsnap-cuda's save) then checkpoint;
``resume`` is restore then unlock. ``DYNSNAP_LIBCUDA`` overrides the library path.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

NOT_INITIALIZED = 3
STEPS = {"save": ["lock", "checkpoint"], "resume": ["restore", "unlock"], "lock": ["lock"],
         "checkpoint": ["checkpoint"], "restore": ["restore"], "unlock": ["unlock"]}
FN = {"lock": "cuCheckpointProcessLock", "checkpoint": "cuCheckpointProcessCheckpoint",
      "restore": "cuCheckpointProcessRestore", "unlock": "cuCheckpointProcessUnlock"}


class LockArgs(ctypes.Structure):  # CUcheckpointLockArgs: 64 bytes
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=sorted(STEPS))
    ap.add_argument("pid", type=int)
    ap.add_argument("--init", action="store_true", help="call cuInit(0) first")
    ap.add_argument("--timeout-ms", type=int, default=10000, help="lock timeout")
    a = ap.parse_args()
    lib = ctypes.CDLL(os.environ.get("DYNSNAP_LIBCUDA") or "libcuda.so.1")
    res: dict = {"pid": a.pid, "action": a.action, "ms": {}, "rc": {}, "init": None}

    def init() -> None:
        t0 = time.monotonic()
        rc = lib.cuInit(0)
        res["init"] = {"rc": rc, "ms": (time.monotonic() - t0) * 1e3}

    if a.init:
        init()
    lock_args = LockArgs(timeoutMs=a.timeout_ms)
    for step in STEPS[a.action]:
        f = getattr(lib, FN[step])
        f.argtypes = [ctypes.c_int, ctypes.c_void_p]
        arg = ctypes.byref(lock_args) if step == "lock" else None
        t0 = time.monotonic()
        rc = f(a.pid, arg)
        if rc == NOT_INITIALIZED and res["init"] is None:
            init()
            res["init"]["needed"] = True
            t0 = time.monotonic()
            rc = f(a.pid, arg)
        res["ms"][step] = (time.monotonic() - t0) * 1e3
        res["rc"][step] = rc
        if rc != 0:
            break
    res["ok"] = all(rc == 0 for rc in res["rc"].values()) and len(res["rc"]) == len(STEPS[a.action])
    print(json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
