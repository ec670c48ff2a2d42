"""A CPU process standing in for the CUDA driver's host copy in a checkpointed worker, for
bench/criu_restore/thp_restore.py, restore_log_timing.sh and tests/native/test_criu_patches.py.

It maps N GiB private and anonymous, marks it MADV_HUGEPAGE before touching it (what
libdynsnap-thp does to the driver's copy), fills it with a pattern where every 1 MiB block
carries its own index, then idles: every 0.05 s it looks for ``verify`` in its work directory
and answers in ``verified`` with the pattern check and its AnonHugePages. CRIU dumps it and
restores it; the restored process answers the same way from where it stopped. It ends when its
caller kills it, or after an hour. With THREADS, that many more threads idle beside it, and both
answers list the process's thread ids (a restore must bring each back). With CHILD_MIB, it first
forks a child that holds CHILD_MIB MiB the same way (its blocks numbered from 2^20, so that a page
of one process landing in the other shows), answering in WORKDIR/child.

Run: python3 holder.py WORKDIR MIB [THREADS [CHILD_MIB]]   (stdio and session are the caller's to detach)
"""
from __future__ import annotations

import json
import mmap
import os
import sys
import threading
import time

MIB = 1 << 20


def block(i: int, base: bytes) -> bytes:
    return i.to_bytes(8, "little") + base[8:]


def anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def tids() -> list[int]:
    return sorted(int(t) for t in os.listdir("/proc/self/task"))


def hold(work: str, mib: int, threads: int, salt: int) -> None:
    stop = threading.Event()
    for _ in range(threads):
        threading.Thread(target=stop.wait, args=(3600,), daemon=True).start()
    size = mib << 20
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    base = bytes(range(256)) * (MIB // 256)
    for i in range(size // MIB):
        m[i * MIB:(i + 1) * MIB] = block(salt + i, base)
    with open(os.path.join(work, "ready.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "anon_huge_kib": anon_huge_kib(), "tids": tids()}, f)
    os.rename(os.path.join(work, "ready.tmp"), os.path.join(work, "ready"))
    req = os.path.join(work, "verify")
    for _ in range(int(3600 / 0.05)):  # the caller kills it; an hour at most
        if os.path.exists(req):
            t0 = time.monotonic()
            bad = [i for i in range(size // MIB) if m[i * MIB:(i + 1) * MIB] != block(salt + i, base)]
            out = {"pid": os.getpid(), "ok": not bad, "bad_blocks": bad[:10], "verify_s": time.monotonic() - t0,
                   "anon_huge_kib": anon_huge_kib(), "tids": tids()}
            os.unlink(req)
            with open(os.path.join(work, "verified.tmp"), "w") as f:
                json.dump(out, f)
            os.rename(os.path.join(work, "verified.tmp"), os.path.join(work, "verified"))
        time.sleep(0.05)


def main() -> None:
    work, mib = sys.argv[1], int(sys.argv[2])
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    child_mib = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    if child_mib:  # a child of its own, forked before any thread: CRIU dumps and restores both
        child_work = os.path.join(work, "child")
        os.makedirs(child_work, exist_ok=True)
        if os.fork() == 0:
            try:
                hold(child_work, child_mib, 0, 1 << 20)  # its blocks carry other indices than its parent's
            finally:
                os._exit(0)
    hold(work, mib, threads, 0)


if __name__ == "__main__":
    main()
