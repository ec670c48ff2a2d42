"""A process that calls the stub driver on its own behalf, as an engine does, for
test_stub_blocking.py (not collected: no test_ prefix).

It loads the library named by ``--lib`` through ctypes, makes the calls an engine makes when it
starts (cuInit, the primary context of device 0 made current, ``--alloc`` bytes of device memory
with a pattern copied in), writes ``ready <pid>`` to ``--out``, then makes ``--call`` in a loop and
appends one line per call that returned: ``<n> <rc> <ok|bad|->`` (``ok``: a cuMemcpyDtoH read the
pattern back). Bounded by ``--count`` calls and ``--seconds``. With ``--start-when FILE`` it waits for
FILE before its first call (a test sets up the state its pid will find). With ``--count 0`` it only starts,
then exits cleanly after ``--linger`` seconds (a clean exit gives the device memory back).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

PATTERN = bytes(range(256)) * 16  # 4 KiB


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--call", default="cuCtxSynchronize")
    ap.add_argument("--alloc", type=int, default=len(PATTERN))
    ap.add_argument("--count", type=int, default=100000)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--linger", type=float, default=0)
    ap.add_argument("--start-when", help="wait (at most 30 s) for this file before the first call")
    a = ap.parse_args()
    cu = ctypes.CDLL(a.lib)
    for _ in range(3000 if a.start_when else 0):
        if os.path.exists(a.start_when):
            break
        time.sleep(0.01)
    ctx, dptr = ctypes.c_void_p(), ctypes.c_uint64()
    steps = [("cuInit", cu.cuInit(0)), ("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)),
             ("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx)),
             ("cuMemAlloc_v2", cu.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(a.alloc)))]
    with open(a.out, "a") as out:
        for name, rc in steps:
            if rc:
                print(f"start {name} rc={rc}", file=out, flush=True)
                return 1
        rc = cu.cuMemcpyHtoD_v2(dptr, PATTERN, ctypes.c_size_t(min(len(PATTERN), a.alloc)))
        print(f"ready {os.getpid()} {dptr.value:#x} rc={rc}", file=out, flush=True)
        if a.count == 0:
            time.sleep(a.linger)
            return 0
        n = len(PATTERN)  # the loop's copies: past the end of an --alloc under 4 KiB
        buf = ctypes.create_string_buffer(n)
        free_b, total_b = ctypes.c_size_t(), ctypes.c_size_t()
        calls = {
            "cuCtxSynchronize": lambda: cu.cuCtxSynchronize(),
            "cuMemGetInfo_v2": lambda: cu.cuMemGetInfo_v2(ctypes.byref(free_b), ctypes.byref(total_b)),
            "cuMemcpyDtoH_v2": lambda: cu.cuMemcpyDtoH_v2(buf, dptr, ctypes.c_size_t(n)),
            "cuMemcpyHtoD_v2": lambda: cu.cuMemcpyHtoD_v2(dptr, PATTERN, ctypes.c_size_t(n)),
            "cuInit": lambda: cu.cuInit(0),
            "cuDeviceGetCount": lambda: cu.cuDeviceGetCount(ctypes.byref(ctypes.c_int())),
        }
        call = calls[a.call]
        end = time.monotonic() + a.seconds
        for i in range(a.count):
            if time.monotonic() > end:
                break
            rc = call()
            check = "-"
            if a.call == "cuMemcpyDtoH_v2" and rc == 0:
                check = "ok" if buf.raw == PATTERN[:n] else "bad"
            print(f"{i} {rc} {check}", file=out, flush=True)
            time.sleep(0.005)
    return 0


if __name__ == "__main__":
    sys.exit(main())
