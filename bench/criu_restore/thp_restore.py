"""CRIU restore of a process whose big anonymous mapping is marked MADV_HUGEPAGE: stock CRIU 4.2.1
against CRIU with hack/patches/criu/0001 (the mark set before the pages are read), from a warm
and from a cold page cache. CPU only: this measures CRIU's part of a snapshot-tier wake (issue
12), the part that runs before the driver's resume.

Each sample: a fresh bench/criu_restore/holder.py of --gib GiB is dumped with the stock CRIU,
the page cache is left warm (every image read once), dropped (``echo 3 >
/proc/sys/vm/drop_caches``: "cold"), or dropped and then read ahead by POSIX_FADV_WILLNEED
from several threads as the restore starts ("cold-willneed"), then restored with one CRIU
(timed, wall clock of ``criu restore``), and the restored process checks every byte and
reports its AnonHugePages. Variants alternate within a round. Writes one JSON line per sample
to OUT/samples.jsonl and medians to OUT/summary.json.

--read-threads 1,4,8 restores with the patched CRIU once per count (DYNSNAP_CRIU_READ_THREADS,
hack/patches/criu/0002: the restorer's page reads in that many threads) instead of once with its
default; without --stock only the patched CRIU runs.

Run as root:
  python3 bench/criu_restore/thp_restore.py --stock CRIU --patched CRIU --gib 4 --rounds 3 --out DIR
  python3 bench/criu_restore/thp_restore.py --patched CRIU --read-threads 1,2,4,8,16 --caches warm --out DIR
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def wait_file(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"no {path} within {timeout:.0f} s")


def run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, check=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)
    return time.monotonic() - t0


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def warm(images: Path) -> None:
    for f in images.iterdir():
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


def willneed(images: Path) -> list[threading.Thread]:
    """What a pre-read at wake time would do: ask the kernel for every page image at once, one
    thread per 1 GiB slice, while CRIU starts reading from the front."""
    threads = []
    for f in sorted(images.glob("pages-*.img")):
        size = f.stat().st_size
        for off in range(0, size, 1 << 30):
            def advise(path: Path = f, off: int = off, size: int = size) -> None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, off, min(1 << 30, size - off), os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            threads.append(threading.Thread(target=advise))
    for t in threads:
        t.start()
    return threads


VMSTAT = ("compact_stall", "compact_fail", "compact_success", "thp_fault_alloc", "thp_fault_fallback",
          "pgmajfault", "allocstall_normal", "allocstall_movable")


def vmstat() -> dict[str, int]:
    pairs = (line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return {k: int(v) for k, v in pairs if k in VMSTAT}


def sample(args: argparse.Namespace, criu: str, cache: str, root: Path, read_threads: int | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="holder-", dir=root))
    images = work / "images"
    images.mkdir(mode=0o700)
    holder = subprocess.Popen([sys.executable, str(HERE / "holder.py"), str(work), str(args.gib << 10)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, cwd=work)
    restored = 0
    try:
        ready = wait_file(work / "ready", 300)
        dump_s = run([args.stock or args.patched, "dump", "-t", str(holder.pid), "-D", str(images), "-o", "dump.log"],
                     300)
        holder.wait(timeout=30)
        img_bytes = sum(f.stat().st_size for f in images.iterdir())
        threads: list[threading.Thread] = []
        if cache.startswith("cold"):
            drop_caches()
            if cache == "cold-willneed":
                threads = willneed(images)
        else:
            warm(images)
        vm0 = vmstat()
        env = {k: v for k, v in os.environ.items() if k != "DYNSNAP_CRIU_READ_THREADS"}
        if read_threads is not None:
            env["DYNSNAP_CRIU_READ_THREADS"] = str(read_threads)
        restore_s = run([criu, "restore", "-D", str(images), "-o", "restore.log", "--restore-detached",
                         "--pidfile", str(work / "restored.pid")], 300, env)
        for t in threads:
            t.join(timeout=300)
        vm1 = vmstat()
        restored = int((work / "restored.pid").read_text())
        (work / "verify").touch()
        verified = wait_file(work / "verified", 300)
        name = "stock" if criu == args.stock else "patched" if read_threads is None else f"patched-t{read_threads}"
        return {"criu": name, "cache": cache, "gib": args.gib,
                "dump_s": round(dump_s, 3), "restore_s": round(restore_s, 3), "image_bytes": img_bytes,
                "huge_kib_before": ready["anon_huge_kib"], "huge_kib_after": verified["anon_huge_kib"],
                "ok": verified["ok"], "bad_blocks": verified["bad_blocks"],
                "vmstat_during_restore": {k: vm1[k] - vm0[k] for k in vm1 if k in vm0}}
    finally:
        for pid in (holder.pid, restored):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if holder.poll() is None:
            holder.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stock", default="")
    ap.add_argument("--patched", required=True)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--caches", default="warm,cold")
    ap.add_argument("--root", default="/var/tmp", help="where the images go (a disk, not a tmpfs)")
    ap.add_argument("--read-threads", default="", help="comma-separated DYNSNAP_CRIU_READ_THREADS values")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts: list[int | None] = [int(t) for t in args.read_threads.split(",") if t] or [None]
    runs = ([(args.stock, None)] if args.stock else []) + [(args.patched, t) for t in counts]
    variants = [(c, t, cache) for cache in args.caches.split(",") for c, t in runs]
    samples = []
    with open(out / "samples.jsonl", "a") as log:
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else list(reversed(variants))
            for criu, threads, cache in order:
                s = sample(args, criu, cache, Path(args.root), threads) | {"round": r}
                print(json.dumps(s), flush=True)
                log.write(json.dumps(s) + "\n")
                log.flush()
                samples.append(s)
    summary = {}
    for name in sorted({s["criu"] for s in samples}):
        for cache in args.caches.split(","):
            ss = [s for s in samples if s["criu"] == name and s["cache"] == cache]
            summary[f"{name}/{cache}"] = {
                "restore_s_median": statistics.median(s["restore_s"] for s in ss),
                "restore_s": [s["restore_s"] for s in ss],
                "huge_gib_after_median": round(statistics.median(s["huge_kib_after"] for s in ss) / 2**20, 2),
                "all_ok": all(s["ok"] for s in ss), "n": len(ss)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    if not all(s["ok"] for s in samples):
        sys.exit("a restored process failed its pattern check")


if __name__ == "__main__":
    main()
