"""Huge pages for the driver's host copy, per process (issue 12, first step): measured.

Runs on the GPU machine (bench/gpu/thp_h200.sh starts it). The lead: with transparent huge pages
set to ``always`` for the whole machine, the CUDA driver's host copy of a checkpointed process
lands on 2 MiB pages and a 16 GiB save and resume get faster. This asks whether one worker can get
that without the system-wide setting, and measures each way that works against the machine as it
is, on one PyTorch worker per way (bench/gpu/worker.py), the same ``dynsnap-cuda --action
save|resume --pid P --json`` calls the agent's executor makes for the ``suspend`` tier:

  base      nothing (THP as the machine has it)
  collapse  after the save, before the resume: ``process_madvise(pidfd, iov, MADV_COLLAPSE)``
            from this process over the worker's large anonymous mappings (the host copy), in
            ``--threads`` threads of ``--chunk-mib`` pieces; its seconds are reported apart
  preload   a second worker started with ``LD_PRELOAD=thp_advise.so`` (bench/gpu/thp_advise.c):
            its own large anonymous mmaps get MADV_HUGEPAGE, the driver's copy too if the driver
            maps it through the dynamic ``mmap`` symbol
  always    reference only, not per process: the base worker with the machine's setting switched
            to ``always`` for that cycle and put back after it

Before the cycles, the kernel is asked (``probe``): the THP settings in sysfs, what
``prctl(PR_GET/SET_THP_DISABLE …)`` answers (a 6.18 kernel knows PR_THP_DISABLE_EXCEPT_ADVISED,
which only disables), ``process_madvise`` of MADV_HUGEPAGE and MADV_COLLAPSE on another process
holding a 64 MiB anonymous mapping (errno of each), and how libcuda reaches mmap (its dynamic
symbols). One warm-up cycle first (these VMs' host memory grows as it is first touched), then
``--rounds`` rounds (each of both sizes), the variants' order reversed every other round. Every cycle records
the helper's seconds and the driver's own (checkpoint/restore ms), the worker's smaps_rollup
(Rss, AnonHugePages) before the save, after it (and after the collapse) and after the resume, the
large anonymous mappings after the save (address, size, Rss, AnonHugePages, THPeligible, VmFlags),
THP counters from /proc/vmstat, and the worker's own check (every byte of its pattern, then new GPU
work). Results: thp.json and bench.log in --out, written after every cycle.

Local logic test (no GPU): ``--fake`` runs ``fake_worker`` and ``fake_helper`` below instead of
worker.py and dynsnap-cuda (``--fake-unit-mib`` MiB per "GiB"), and never touches sysfs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
T0 = time.monotonic()
MIB = 1 << 20
SYS_PIDFD_OPEN = 434
SYS_PROCESS_MADVISE = 440
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
PR_SET_THP_DISABLE = 41
PR_GET_THP_DISABLE = 42
PR_THP_DISABLE_EXCEPT_ADVISED = 1 << 1
THP_SYS = Path("/sys/kernel/mm/transparent_hugepage")
VMSTAT_KEYS = ("thp_fault_alloc", "thp_fault_fallback", "thp_collapse_alloc", "thp_collapse_alloc_failed",
               "pgfault")

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl.restype = ctypes.c_int
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def now() -> float:
    return round(time.monotonic() - T0, 3)


def err_name(e: int) -> str:
    return errno.errorcode.get(e, str(e))


# ---------------------------------------------------------------- the kernel's view of a process


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in MiB (Rss, Anonymous, AnonHugePages)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Rss", "Anonymous", "AnonHugePages"):
                    out[k + "_MiB"] = int(v.split()[0]) // 1024
    except OSError as e:
        out["error"] = err_name(e.errno or 0)
    return out


def smaps(pid: int) -> list[dict]:
    """Every mapping of /proc/PID/smaps: start, end, path, Rss/AnonHugePages (KiB), THPeligible, VmFlags."""
    vmas: list[dict] = []
    cur: dict | None = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = head[0].split("-")
                cur = {"start": int(lo, 16), "end": int(hi, 16), "path": head[5].strip() if len(head) > 5 else ""}
                vmas.append(cur)
            elif cur is not None:
                k, _, v = line.partition(":")
                if k in ("Rss", "Anonymous", "AnonHugePages"):
                    cur[k] = int(v.split()[0])
                elif k == "THPeligible":
                    cur[k] = int(v.strip())
                elif k == "VmFlags":
                    cur[k] = v.strip()
    return vmas


def big_anon(vmas: list[dict], min_mib: int) -> list[dict]:
    """The anonymous private mappings holding at least MIN_MIB resident (where the host copy is)."""
    return [v for v in vmas if v.get("Anonymous", 0) >= min_mib * 1024 and not v["path"].startswith("/")
            and "sh" not in v.get("VmFlags", "").split()]


def vma_row(v: dict, before: set[int]) -> dict:
    return {"start": hex(v["start"]), "size_MiB": (v["end"] - v["start"]) // MIB, "path": v["path"],
            "rss_MiB": v.get("Rss", 0) // 1024, "anon_huge_MiB": v.get("AnonHugePages", 0) // 1024,
            "thp_eligible": v.get("THPeligible"), "vmflags": v.get("VmFlags"), "new": v["start"] not in before}


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in VMSTAT_KEYS:
                out[k] = int(v)
    return out


def thp_sys() -> dict[str, str]:
    out = {}
    for rel in ("enabled", "defrag", "shmem_enabled", "hpage_pmd_size", "khugepaged/defrag",
                "khugepaged/max_ptes_none", "khugepaged/pages_to_scan"):
        try:
            out[rel] = (THP_SYS / rel).read_text().strip()
        except OSError as e:
            out[rel] = f"unreadable: {err_name(e.errno or 0)}"
    for d in sorted(THP_SYS.glob("hugepages-*")):
        with contextlib.suppress(OSError):
            out[f"{d.name}/enabled"] = (d / "enabled").read_text().strip()
    return out


def thp_mode() -> str:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled."""
    txt = (THP_SYS / "enabled").read_text()
    return txt[txt.index("[") + 1:txt.index("]")]


# ---------------------------------------------------------------- process_madvise


def pidfd_open(pid: int) -> int:
    fd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"pidfd_open({pid}): {err_name(e)}")
    return int(fd)


def process_madvise(pidfd: int, start: int, length: int, advice: int) -> tuple[int, int]:
    """One process_madvise call over one range: (return value, errno or 0)."""
    iov = IoVec(start, length)
    rc = libc.syscall(SYS_PROCESS_MADVISE, pidfd, ctypes.byref(iov), 1, advice, 0)
    return int(rc), (ctypes.get_errno() if rc < 0 else 0)


def collapse(pid: int, vmas: list[dict], threads: int, chunk_mib: int) -> dict:
    """MADV_COLLAPSE over VMAS (2 MiB-aligned pieces of CHUNK_MIB) from THREADS threads."""
    align = 2 * MIB
    pieces: list[tuple[int, int]] = []
    for v in vmas:
        lo = (v["start"] + align - 1) // align * align
        hi = v["end"] // align * align
        step = chunk_mib * MIB
        pieces += [(a, min(step, hi - a)) for a in range(lo, hi, step)]
    fd = pidfd_open(pid)
    results: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    nxt = iter(pieces)

    def run() -> None:
        while True:
            with lock:
                p = next(nxt, None)
            if p is None:
                return
            rc, e = process_madvise(fd, p[0], p[1], MADV_COLLAPSE)
            with lock:
                results.append((p[1], rc, e))

    t0 = time.monotonic()
    ts = [threading.Thread(target=run) for _ in range(max(1, threads))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    secs = time.monotonic() - t0
    os.close(fd)
    errs: dict[str, int] = {}
    for _, rc, e in results:
        if rc < 0:
            errs[err_name(e)] = errs.get(err_name(e), 0) + 1
    return {"s": round(secs, 3), "threads": threads, "chunk_MiB": chunk_mib, "calls": len(results),
            "requested_MiB": sum(n for n, _, _ in results) // MIB,
            "advised_MiB": sum(rc for _, rc, _ in results if rc > 0) // MIB, "errors": errs}


# ---------------------------------------------------------------- probes: what the kernel answers


def holder_src(mib: int) -> str:
    return (f"import ctypes,mmap,sys\nm=mmap.mmap(-1,{mib}<<20,flags=mmap.MAP_PRIVATE|mmap.MAP_ANONYMOUS)\n"
            f"m.write(b'x'*({mib}<<20))\na=ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
            "print(a,flush=True)\nsys.stdin.readline()\n")


def probe_prctl() -> dict:
    """Run in a throwaway child (``probe-prctl``): every THP prctl a 6.18 kernel might know."""
    out: dict = {}

    def call(name: str, *args: int) -> None:
        a = list(args) + [0] * (5 - len(args))
        rc = libc.prctl(*a)
        out[name] = {"rc": rc, "errno": err_name(ctypes.get_errno()) if rc < 0 else None}

    call("PR_GET_THP_DISABLE", PR_GET_THP_DISABLE)
    call("PR_SET_THP_DISABLE(0,0) (the only 'enable': clears a disable)", PR_SET_THP_DISABLE, 0, 0)
    call("PR_SET_THP_DISABLE(0,EXCEPT_ADVISED) (flags only with disable)", PR_SET_THP_DISABLE, 0,
         PR_THP_DISABLE_EXCEPT_ADVISED)
    call("PR_SET_THP_DISABLE(1,EXCEPT_ADVISED) (6.18: like 'madvise' for this process)", PR_SET_THP_DISABLE, 1,
         PR_THP_DISABLE_EXCEPT_ADVISED)
    call("PR_GET_THP_DISABLE after EXCEPT_ADVISED (3 when the kernel knows it)", PR_GET_THP_DISABLE)
    call("PR_SET_THP_DISABLE(1,4) (an unknown flag)", PR_SET_THP_DISABLE, 1, 4)
    call("PR_SET_THP_DISABLE(0,0) again", PR_SET_THP_DISABLE, 0, 0)
    call("PR_GET_THP_DISABLE at the end", PR_GET_THP_DISABLE)
    return out


def probe_remote(min_mib: int = 64) -> dict:
    """process_madvise on another process's anonymous mapping: MADV_HUGEPAGE, then MADV_COLLAPSE."""
    h = subprocess.Popen([sys.executable, "-c", holder_src(min_mib)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    out: dict = {"holder_mib": min_mib}
    try:
        addr = int(h.stdout.readline())  # type: ignore[union-attr]
        v = next(x for x in smaps(h.pid) if x["start"] <= addr < x["end"])
        out["vma"] = vma_row(v, set())
        fd = pidfd_open(h.pid)
        lo = (v["start"] + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)
        n = (v["end"] - lo) // (2 * MIB) * (2 * MIB)
        for name, adv in (("MADV_HUGEPAGE", MADV_HUGEPAGE), ("MADV_COLLAPSE", MADV_COLLAPSE)):
            t0 = time.monotonic()
            rc, e = process_madvise(fd, lo, n, adv)
            out[name] = {"rc": rc, "errno": err_name(e) if rc < 0 else None, "s": round(time.monotonic() - t0, 4)}
        os.close(fd)
        v2 = next(x for x in smaps(h.pid) if x["start"] <= addr < x["end"])
        out["vma_after"] = vma_row(v2, set())
    except Exception as e:  # a probe reports, it does not stop the bench
        out["error"] = repr(e)
    finally:
        h.kill()
        h.wait()
    return out


def libcuda_mmap_imports() -> dict:
    """How libcuda.so.1 reaches mmap: its undefined dynamic symbols named like mmap/syscall."""
    path = os.environ.get("DYNSNAP_LIBCUDA") or ""
    if not path:
        o = subprocess.run("ldconfig -p | grep 'libcuda.so.1 ' | head -1", shell=True, capture_output=True,
                           text=True).stdout
        path = o.rsplit("=>", 1)[-1].strip()
    out: dict = {"path": path}
    for tool in (["nm", "-D", "--undefined-only"], ["objdump", "-T"]):
        try:
            o = subprocess.run([*tool, path], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            out[tool[0]] = repr(e)
            continue
        out[tool[0]] = [ln.strip() for ln in o.stdout.splitlines()
                        if any(w in ln for w in ("mmap", "syscall", "madvise", "mremap"))][:40]
        out[tool[0] + "_rc"] = o.returncode
        if o.returncode == 0:
            break
    return out


# ---------------------------------------------------------------- the bench


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = (self.out / "bench.log").open("a", buffering=1)
        self.res: dict = {"args": vars(a), "env": {}, "probes": {}, "workers": {}, "cycles": [], "notes": []}
        self.procs: dict[str, subprocess.Popen] = {}

    def say(self, msg: str) -> None:
        line = f"[{now():7.1f}] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def dump(self) -> None:
        self.res["elapsed_s"] = now()
        (self.out / "thp.json").write_text(json.dumps(self.res, indent=1))

    def helper(self, *args: str) -> dict:
        argv = ([sys.executable, str(Path(__file__).resolve()), "fake-helper", *args] if self.a.fake
                else [self.a.bin, *args])
        t0 = time.monotonic()
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - t0
        js = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        self.say(f"$ {shlex.join(['dynsnap-cuda', *args])} -> rc={p.returncode} {wall:.3f}s {p.stdout.strip()[:300]}")
        if p.stderr.strip():
            self.say(f"  stderr: {p.stderr.strip()[:800]}")
        return {"rc": p.returncode, "wall_s": round(wall, 3), "json": js, "stderr": p.stderr.strip()[:2000]}

    def start_worker(self, name: str, gib: int, seed: int, preload: bool) -> None:
        env = dict(os.environ)
        if preload:
            env["LD_PRELOAD"] = str(Path(self.a.shim).resolve())
            env["DYNSNAP_THP_LOG"] = str(self.out / f"shim-{name}.log")
        if self.a.fake:
            argv = [sys.executable, str(Path(__file__).resolve()), "fake-worker",
                    "--mib", str(gib * self.a.fake_unit_mib)]
        else:
            argv = [sys.executable, str(HERE / "worker.py"), "--gib", str(gib), "--seed", str(seed)]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.procs[name] = p
        self.res["workers"][name] = {"pid": p.pid, "gib": gib, "seed": seed, "preload": preload,
                                     "cmd": shlex.join((["LD_PRELOAD=" + env["LD_PRELOAD"]] if preload else []) + argv)}

    def wait_ready(self) -> None:
        for name, p in self.procs.items():
            t0 = time.monotonic()
            line = p.stdout.readline().strip()  # type: ignore[union-attr]
            if not line.startswith("ready"):
                raise RuntimeError(f"worker {name} did not start: {line!r}")
            self.res["workers"][name]["ready_at_s"] = now()
            self.res["workers"][name]["rollup_ready"] = rollup(p.pid)
            self.say(f"worker {name} pid={p.pid} ready ({time.monotonic() - t0:.1f}s waited): {line}")

    def ask(self, name: str, cmd: str) -> str:
        p = self.procs[name]
        p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        return p.stdout.readline().strip()  # type: ignore[union-attr]

    def stop(self) -> None:
        for p in self.procs.values():
            try:
                p.stdin.write("quit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
                p.wait(timeout=30)
            except Exception:
                p.kill()
                p.wait()

    def cycle(self, name: str, variant: str, label: str) -> dict:
        p = self.procs[name]
        pid = p.pid
        mode_before = None
        if variant == "always":
            mode_before = thp_mode()
            (THP_SYS / "enabled").write_text("always")
        try:
            vm0, r0 = vmstat(), rollup(pid)
            before = {v["start"] for v in smaps(pid)}
            save = self.helper("--action", "save", "--pid", str(pid), "--json", "--timeout", "10000")
            vm1, r1 = vmstat(), rollup(pid)
            maps_saved = [vma_row(v, before) for v in big_anon(smaps(pid), self.a.min_mib)]
            col, r1c = None, None
            if variant == "collapse" and save["rc"] == 0:
                col = collapse(pid, big_anon(smaps(pid), self.a.min_mib), self.a.threads, self.a.chunk_mib)
                r1c = rollup(pid)
                self.say(f"  collapse: {col}; rollup {r1c}")
            vm1c = vmstat()
            resume = self.helper("--action", "resume", "--pid", str(pid), "--json")
            vm2, r2 = vmstat(), rollup(pid)
        finally:
            if mode_before is not None:
                (THP_SYS / "enabled").write_text(mode_before)
        # A worker whose resume failed may still be locked: asking it would block on the driver.
        check = self.ask(name, "check") if resume["rc"] == 0 else f"not asked: resume rc={resume['rc']}"
        ok = save["rc"] == 0 and resume["rc"] == 0 and check.startswith("ok")

        def ms(r: dict, op: str) -> float | None:
            v = (r["json"] or [{}])[0].get("ms", {}).get(op)
            return round(v / 1e3, 3) if v is not None else None

        row = {"label": label, "variant": variant, "worker": name, "pid": pid, "gib": self.res["workers"][name]["gib"],
               "ok": ok, "check": check, "thp_mode_during": "always" if variant == "always" else thp_mode(),
               "save_s": save["wall_s"], "checkpoint_s": ms(save, "checkpoint"),
               "resume_s": resume["wall_s"], "restore_s": ms(resume, "restore"),
               "collapse": col, "rollup_before": r0, "rollup_saved": r1, "rollup_collapsed": r1c,
               "rollup_resumed": r2, "anon_huge_saved_MiB": (r1c or r1).get("AnonHugePages_MiB"),
               "maps_saved": maps_saved,
               "vmstat_save": {k: vm1[k] - vm0[k] for k in vm0}, "vmstat_collapse": {k: vm1c[k] - vm1[k] for k in vm1},
               "vmstat_resume": {k: vm2[k] - vm1c[k] for k in vm1c},
               "save": save, "resume": resume, "t": now()}
        self.say(f"CYCLE {label} {name} {variant}: save {row['save_s']} s (ckpt {row['checkpoint_s']}) "
                 f"{'collapse ' + str(col['s']) + ' s ' if col else ''}resume {row['resume_s']} s "
                 f"(restore {row['restore_s']}) AnonHuge saved {row['anon_huge_saved_MiB']} MiB "
                 f"rollup {r0} -> {r1} -> {r2} thp_faults {row['vmstat_save'].get('thp_fault_alloc')} ok={ok}")
        return row

    def run(self) -> None:
        a = self.a
        env = self.res["env"]
        for k, c in {"uname": "uname -r", "nproc": "nproc",
                     "nvidia_smi": "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader",
                     "torch": f"{sys.executable} -c 'import torch;print(torch.__version__)'"}.items():
            if a.fake and k in ("nvidia_smi", "torch"):
                continue
            env[k] = subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
        env["thp_sys"] = thp_sys()
        self.say(f"env {json.dumps(env)}")
        sizes = [int(x) for x in a.sizes.split(",")]
        variants = a.variants.split(",")
        if a.fake and "always" in variants:
            variants.remove("always")
            self.res["notes"].append("fake: 'always' left out (no sysfs change on a shared machine)")
        # Workers first: they load in parallel with the probes.
        for gib in sizes:
            self.start_worker(f"base{gib}", gib, seed=400 + gib, preload=False)
            if "preload" in variants:
                self.start_worker(f"preload{gib}", gib, seed=500 + gib, preload=True)
        pr = subprocess.run([sys.executable, str(Path(__file__).resolve()), "probe-prctl"], capture_output=True,
                            text=True, timeout=60)
        self.res["probes"]["prctl"] = json.loads(pr.stdout) if pr.returncode == 0 else {"error": pr.stderr[-2000:]}
        self.res["probes"]["remote_madvise"] = probe_remote()
        if not a.fake:
            self.res["probes"]["libcuda"] = libcuda_mmap_imports()
        self.say(f"probes {json.dumps(self.res['probes'])}")
        self.dump()
        self.wait_ready()
        for name in self.procs:
            if name.startswith("preload"):
                self.res["workers"][name]["shim_log_at_ready"] = self.shim_lines(name)
        self.dump()
        if "always" in variants:  # the reference needs sysfs writable: write the mode back to itself
            try:
                (THP_SYS / "enabled").write_text(thp_mode())
            except OSError as e:
                variants.remove("always")
                self.res["notes"].append(f"'always' left out: sysfs not writable ({err_name(e.errno or 0)})")
        broken: set[str] = set()
        if not a.no_warmup:
            self.res["warmup"] = self.cycle(f"base{sizes[0]}", "base", "warmup")
            self.dump()
        # Rounds outermost: a deadline cuts whole rounds of both sizes, not the last size.
        for rnd in range(a.rounds):
            for gib in sizes:
                order = variants if rnd % 2 == 0 else variants[::-1]
                for v in order:
                    if time.monotonic() - T0 > a.deadline_s:
                        self.res["notes"].append(f"{gib} GiB round {rnd} {v}: skipped (deadline {a.deadline_s} s)")
                        continue
                    name = f"{'preload' if v == 'preload' else 'base'}{gib}"
                    if name in broken:
                        self.res["notes"].append(f"{gib} GiB round {rnd} {v}: skipped ({name} failed earlier)")
                        continue
                    row = self.cycle(name, v, f"round{rnd}")
                    self.res["cycles"].append(row)
                    self.dump()
                    if not row["ok"]:  # the others go on; this worker is done
                        broken.add(name)
                        self.res["notes"].append(f"{gib} GiB round {rnd} {v}: FAILED ({row['check']})")
        for name in self.procs:
            if name.startswith("preload"):
                self.res["workers"][name]["shim_log_end"] = self.shim_lines(name)

    def shim_lines(self, name: str) -> dict:
        path = self.out / f"shim-{name}.log"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return {"lines": 0}
        big = [ln for ln in lines if int(ln.split()[1]) >= self.a.min_mib * MIB]
        largest = sorted(big, key=lambda x: -int(x.split()[1]))[:8]
        return {"lines": len(lines), "ge_min_mib": len(big), "largest": largest}

    def summary(self) -> dict:
        out: dict = {}
        for gib in sorted({c["gib"] for c in self.res["cycles"]}, reverse=True):
            for v in dict.fromkeys(c["variant"] for c in self.res["cycles"]):
                cs = [c for c in self.res["cycles"] if c["gib"] == gib and c["variant"] == v]
                if not cs:
                    continue

                def col(k: str, cs: list[dict] = cs) -> list[float]:
                    return [c[k] for c in cs if c[k] is not None]

                coll = [c["collapse"]["s"] for c in cs if c["collapse"]]
                out[f"{gib}GiB {v}"] = {
                    "n": len(cs), "save_s": col("save_s"), "checkpoint_s": col("checkpoint_s"),
                    "collapse_s": coll, "resume_s": col("resume_s"), "restore_s": col("restore_s"),
                    "save_median_s": statistics.median(col("save_s")),
                    "resume_median_s": statistics.median(col("resume_s")),
                    "collapse_median_s": statistics.median(coll) if coll else None,
                    "anon_huge_saved_MiB": col("anon_huge_saved_MiB"),
                    "rss_saved_MiB": [c["rollup_saved"].get("Rss_MiB") for c in cs],
                    "all_ok": all(c["ok"] for c in cs)}
        return out


# ---------------------------------------------------------------- local stand-ins (--fake)


def fake_worker(mib: int) -> None:
    """Stands in, for a local logic test without a GPU, for bench/gpu/worker.py AND for what the CUDA
    driver does inside it at a checkpoint: SIGUSR1 maps MIB MiB anonymous memory with MAP_POPULATE
    through the dynamic ``mmap`` symbol (as driver 580.159 does, seen on the H200: so
    thp_advise.so sees it) and fills it (the device → host copy); SIGUSR2 checks and unmaps it (the restore). Speaks
    worker.py's stdin protocol (ready / check / quit). Marks each step done in /tmp/fake-ckpt-PID."""
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    flag = Path(f"/tmp/fake-ckpt-{os.getpid()}")
    state: dict = {"addr": None, "bad": False}
    n = mib * MIB

    def save(*_: object) -> None:
        # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS|POPULATE: the flags driver 580.159 maps its copy with
        addr = libc.mmap(None, n, 3, 0x8022, -1, 0)
        ctypes.memset(addr, 0x5A, n)
        state["addr"] = addr
        flag.write_text("saved")

    def restore(*_: object) -> None:
        addr = state["addr"]
        if addr:
            buf = (ctypes.c_ubyte * n).from_address(addr)
            state["bad"] = state["bad"] or bytes(buf[:4096]) != b"\x5a" * 4096 or buf[n - 1] != 0x5A
            libc.munmap(addr, n)
        state["addr"] = None
        flag.unlink(missing_ok=True)

    signal.signal(signal.SIGUSR1, save)
    signal.signal(signal.SIGUSR2, restore)
    print(f"ready {os.getpid()} {n}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "check":
            print("bad host copy" if state["bad"] else "ok 0.000", flush=True)
        elif cmd and cmd[0] == "quit":
            break
    flag.unlink(missing_ok=True)


def fake_helper(argv: list[str]) -> int:
    """Stands in for dynsnap-cuda --action save|resume --pid P --json, for fake_worker only: signals
    it and waits (bounded) for its flag; prints dynsnap-cuda's JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--action")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout")
    a = ap.parse_args(argv)
    flag = Path(f"/tmp/fake-ckpt-{a.pid}")
    t0 = time.monotonic()
    os.kill(a.pid, signal.SIGUSR1 if a.action == "save" else signal.SIGUSR2)
    for _ in range(1200):
        if flag.exists() == (a.action == "save"):
            break
        time.sleep(0.05)
    else:
        print(f"fake: pid {a.pid} did not {a.action}", file=sys.stderr)
        return 1
    ms = (time.monotonic() - t0) * 1e3
    steps = {"lock": 0.1, "checkpoint": ms} if a.action == "save" else {"restore": ms, "unlock": 0.1}
    print(json.dumps({"pid": a.pid, "action": a.action, "ok": True, "ms": steps}))
    return 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "probe-prctl":
        print(json.dumps(probe_prctl()))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "fake-helper":
        sys.exit(fake_helper(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "fake-worker":
        fake_worker(int(sys.argv[sys.argv.index("--mib") + 1]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="native/build/dynsnap-cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shim", default="/tmp/thp_advise.so")
    ap.add_argument("--sizes", default="16,2")
    ap.add_argument("--variants", default="base,collapse,preload,always")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="collapse: threads calling process_madvise")
    ap.add_argument("--chunk-mib", type=int, default=512, help="collapse: bytes per process_madvise call")
    ap.add_argument("--min-mib", type=int, default=64, help="anonymous mappings at least this resident")
    ap.add_argument("--deadline-s", type=float, default=300, help="start no cycle after this many seconds")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--fake", action="store_true", help="local logic test: fake_worker/fake_helper, no sysfs")
    ap.add_argument("--fake-unit-mib", type=int, default=32)
    a = ap.parse_args()
    b = Bench(a)
    try:
        b.run()
    except Exception as e:  # keep what was measured
        import traceback
        b.res["error"] = traceback.format_exc()
        b.say(f"ERROR {e!r}")
    finally:
        b.stop()
        b.res["summary"] = b.summary()
        b.dump()
        b.say("SUMMARY " + json.dumps(b.res["summary"]))
        if a.fake or b.res["summary"]:
            print("THP MODE AT END", thp_mode(), flush=True)


if __name__ == "__main__":
    main()
