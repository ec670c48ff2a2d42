"""16 GiB checkpoint: does dynsnap-cuda itself cost time? Four ways to drive the driver.

Runs on the GPU machine (bench/gpu/run_variants.sh starts it). One throwaway
worker goes through one default save/resume first (the warm-up: host memory on
these VMs grows as it is first touched). Then one worker of ``--gib`` GiB goes
through rounds of these variants, the order reversed every other round:

  a  dynsnap-cuda --action save --pid P --json; --action resume --pid P --json
  b  the same with --skip-mem (still cuInit, but no device enumeration, no
     primary context, no cuMemGetInfo around the checkpoint)
  c  bench/gpu/raw_ckpt.py: ctypes, the four checkpoint calls only
  d  CRIU-plugin style: dynsnap-cuda --action lock, then checkpoint, then
     restore, then unlock, each its own process
  e  raw_ckpt.py --init: c plus cuInit(0) in the helper (only when c ran
     without cuInit)
  f  a with DYNSNAP_LIBNVML=/nonexistent: the free memory is read through a
     CUDA primary context, as every dynsnap-cuda did before NVML (the fallback)

With ``--refusal``, the worker is then saved once more and the free-memory
check is tried on the real GPU before its resume: ``--need-bytes`` above the
free memory must exit 3 and leave the process checkpointed, through NVML and
through the fallback, and each refusing call's wall time is taken (a helper
that only samples: cuInit, enumeration, the reading, exit).

Each cycle records the driver calls' seconds, the helper's wall time, host
memory (/proc/meminfo, the worker's RSS, page faults), the worker's CPU time,
GPU memory after the save, and the worker's own check (pattern intact and new
GPU work). A sampler thread logs MemTotal/MemFree every 0.25 s throughout.
Results: variants.json and bench.log in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_bench import Bench, gpu_used_mib

HERE = Path(__file__).resolve().parent
T0 = time.monotonic()


def now() -> float:
    return round(time.monotonic() - T0, 3)


def meminfo() -> dict[str, int]:
    keys = ("MemTotal", "MemFree", "MemAvailable", "Cached", "AnonPages", "Mlocked", "Unevictable")
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in keys:
                out[k + "_MiB"] = int(v.split()[0]) // 1024
    return out


def vmstat() -> dict[str, int]:
    keys = ("pgfault", "pgmajfault", "pgalloc_normal", "pgfree", "thp_fault_alloc")
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in keys:
                out[k] = int(v)
    return out


def proc(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin"):
                    out[k + "_MiB"] = int(v.split()[0]) // 1024
        with open(f"/proc/{pid}/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        out["utime_s"], out["stime_s"] = int(st[11]) / tck, int(st[12]) / tck
        out["threads"] = int(st[17])
    except OSError:
        pass
    return out


def snap(pid: int) -> dict:
    return {"t": now(), "mem": meminfo(), "vm": vmstat(), "worker": proc(pid)}


class Sampler(threading.Thread):
    def __init__(self, every: float) -> None:
        super().__init__(daemon=True)
        self.every, self.rows, self.stop = every, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            m = meminfo()
            self.rows.append([now(), m["MemTotal_MiB"], m["MemFree_MiB"]])
            self.stop.wait(self.every)


class Runner:
    def __init__(self, b: Bench) -> None:
        self.b = b

    def run(self, argv: list[str], label: str, env: dict[str, str] | None = None) -> dict:
        t0 = time.monotonic()
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                           env={**os.environ, **env} if env else None)
        wall = time.monotonic() - t0
        js = [r for r in (json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")) if "pid" in r]
        self.b.say(f"$ {label}  -> rc={p.returncode} {wall:.3f}s {p.stdout.strip()[:400]}")
        if p.stderr.strip():
            self.b.say(f"  stderr: {p.stderr.strip()[:1000]}")
        return {"rc": p.returncode, "wall_s": wall, "json": js, "cmd": label, "stderr": p.stderr.strip(),
                "stdout": p.stdout.strip()}

    def cli(self, *args: str, env: dict[str, str] | None = None) -> dict:
        pre = [f"{k}={v}" for k, v in (env or {}).items()]
        return self.run([self.b.bin, *args], shlex.join([*pre, "dynsnap-cuda", *args]), env)

    def raw(self, *args: str) -> dict:
        return self.run([sys.executable, str(HERE / "raw_ckpt.py"), *args],
                        shlex.join(["python3", "bench/gpu/raw_ckpt.py", *args]))


def ms_of(results: list[dict], op: str) -> float | None:
    for r in results:
        for j in r["json"]:
            if op in j.get("ms", {}):
                return j["ms"][op]
    return None


NO_NVML = {"DYNSNAP_LIBNVML": "/nonexistent/libnvidia-ml.so.1"}


def save_steps(r: Runner, v: str, pid: str) -> list[dict]:
    if v == "a":
        return [r.cli("--action", "save", "--pid", pid, "--json")]
    if v == "f":
        return [r.cli("--action", "save", "--pid", pid, "--json", env=NO_NVML)]
    if v == "b":
        return [r.cli("--action", "save", "--pid", pid, "--json", "--skip-mem")]
    if v == "c":
        return [r.raw("save", pid)]
    if v == "e":
        return [r.raw("save", pid, "--init")]
    out = [r.cli("--action", "lock", "--pid", pid, "--json")]
    if out[0]["rc"] == 0:
        out.append(r.cli("--action", "checkpoint", "--pid", pid, "--json"))
    return out


def resume_steps(r: Runner, v: str, pid: str) -> list[dict]:
    if v == "a":
        return [r.cli("--action", "resume", "--pid", pid, "--json")]
    if v == "f":
        return [r.cli("--action", "resume", "--pid", pid, "--json", env=NO_NVML)]
    if v == "b":
        return [r.cli("--action", "resume", "--pid", pid, "--json", "--skip-mem")]
    if v == "c":
        return [r.raw("resume", pid)]
    if v == "e":
        return [r.raw("resume", pid, "--init")]
    out = [r.cli("--action", "restore", "--pid", pid, "--json")]
    if out[0]["rc"] == 0:
        out.append(r.cli("--action", "unlock", "--pid", pid, "--json"))
    return out


def cycle(b: Bench, r: Runner, p: subprocess.Popen, v: str, label: str) -> dict:
    pid = str(p.pid)
    s0 = snap(p.pid)
    sv = save_steps(r, v, pid)
    s1 = snap(p.pid)
    used = gpu_used_mib()
    s1b = snap(p.pid)
    rs = resume_steps(r, v, pid)
    s2 = snap(p.pid)
    ok = all(x["rc"] == 0 for x in sv + rs) and b.check(p)
    ck, rt = ms_of(sv, "checkpoint"), ms_of(rs, "restore")
    w0, w1, w2 = s0["worker"], s1["worker"], s2["worker"]
    row = {
        "label": label, "variant": v, "pid": p.pid, "ok_intact_new_work": ok,
        "checkpoint_s": ck / 1e3 if ck is not None else None,
        "restore_s": rt / 1e3 if rt is not None else None,
        "lock_ms": ms_of(sv, "lock"), "unlock_ms": ms_of(rs, "unlock"),
        "save_wall_s": sum(x["wall_s"] for x in sv), "resume_wall_s": sum(x["wall_s"] for x in rs),
        "mem_source": [j.get("mem_source") for x in sv + rs for j in x["json"]],
        "bytes": [j.get("bytes") for x in sv + rs for j in x["json"]],
        "gpu_used_mib_saved": used,
        "t_save": [s0["t"], s1["t"]], "t_resume": [s1b["t"], s2["t"]],
        "memtotal_mib": [s0["mem"]["MemTotal_MiB"], s1["mem"]["MemTotal_MiB"], s2["mem"]["MemTotal_MiB"]],
        "memfree_mib": [s0["mem"]["MemFree_MiB"], s1["mem"]["MemFree_MiB"], s2["mem"]["MemFree_MiB"]],
        "worker_rss_mib": [w0.get("VmRSS_MiB"), w1.get("VmRSS_MiB"), w2.get("VmRSS_MiB")],
        "worker_cpu_s_save": round(w1.get("utime_s", 0) + w1.get("stime_s", 0)
                                   - w0.get("utime_s", 0) - w0.get("stime_s", 0), 2),
        "worker_cpu_s_resume": round(w2.get("utime_s", 0) + w2.get("stime_s", 0)
                                     - w1.get("utime_s", 0) - w1.get("stime_s", 0), 2),
        "pgfault_save": s1["vm"].get("pgfault", 0) - s0["vm"].get("pgfault", 0),
        "pgfault_resume": s2["vm"].get("pgfault", 0) - s1b["vm"].get("pgfault", 0),
        "snaps": [s0, s1, s2],
        "steps": sv + rs,
    }
    b.say(f"CYCLE {label} {v}: ckpt {row['checkpoint_s']} s restore {row['restore_s']} s "
          f"save wall {row['save_wall_s']:.2f} resume wall {row['resume_wall_s']:.2f} ok={ok} "
          f"MemTotal {row['memtotal_mib']} MemFree {row['memfree_mib']} RSS {row['worker_rss_mib']} "
          f"cpu {row['worker_cpu_s_save']}/{row['worker_cpu_s_resume']} "
          f"pgfault {row['pgfault_save']}/{row['pgfault_resume']} gpu_saved {used} "
          f"mem_source {row['mem_source']} bytes {row['bytes']}")
    return row


def free_mib(stderr: str) -> int | None:
    m = re.search(r"has (\d+) MiB free", stderr)
    return int(m.group(1)) if m else None


def refusal(b: Bench, r: Runner, p: subprocess.Popen, reps: int) -> dict:
    """The free-memory check on the real GPU, through NVML and through the fallback."""
    pid = str(p.pid)
    out: dict = {"save": r.cli("--action", "save", "--pid", pid, "--json")}
    out["state_saved"] = r.cli("--get-state", "--pid", pid)
    try:
        out["nvidia_smi_free_used_total_mib"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia_smi_free_used_total_mib"] = repr(e)
    huge = str(1 << 50)
    for name, env in (("nvml", None), ("cuda", NO_NVML)):
        calls = [r.cli("--action", "resume", "--pid", pid, "--need-bytes", huge, "--json", env=env)
                 for _ in range(reps)]
        out[name] = {"rc": [c["rc"] for c in calls], "wall_s": [round(c["wall_s"], 4) for c in calls],
                     "mem_source": [c["json"][0].get("mem_source") if c["json"] else None for c in calls],
                     "free_mib": [free_mib(c["stderr"]) for c in calls], "stderr": calls[0]["stderr"]}
    # Tight: 256 MiB more than NVML reports free must refuse; the saved need alone must pass.
    fr = out["nvml"]["free_mib"][0]
    tight = {"rc": None, "stderr": "no NVML figure to go from", "json": []}
    if fr is not None:
        tight = r.cli("--action", "resume", "--pid", pid, "--need-bytes", str((fr + 256) << 20), "--json")
    out["tight"] = {"rc": tight["rc"], "stderr": tight["stderr"], "json": tight["json"]}
    out["state_after_refusals"] = r.cli("--get-state", "--pid", pid)
    out["resume"] = r.cli("--action", "resume", "--pid", pid, "--json")
    out["intact"] = b.check(p)
    out["ok"] = (all(x == 3 for k in ("nvml", "cuda") for x in out[k]["rc"]) and tight["rc"] == 3
                 and set(out["nvml"]["mem_source"]) == {"nvml"} and set(out["cuda"]["mem_source"]) == {"cuda"}
                 and out["state_saved"]["stdout"] == out["state_after_refusals"]["stdout"] == "checkpointed"
                 and out["resume"]["rc"] == 0 and out["intact"])
    b.say(f"REFUSAL nvml free {out['nvml']['free_mib'][0]} MiB walls {out['nvml']['wall_s']}; "
          f"cuda free {out['cuda']['free_mib'][0]} MiB walls {out['cuda']['wall_s']}; "
          f"tight rc {tight['rc']}; smi free,used,total {out['nvidia_smi_free_used_total_mib']}; ok={out['ok']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--variants", default="a,b,c,d")
    ap.add_argument("--min-rounds", type=int, default=2)
    ap.add_argument("--max-rounds", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=300,
                    help="start no cycle after this many seconds (beyond --min-rounds, none at all)")
    ap.add_argument("--cycle-s", type=float, default=25, help="time one cycle is assumed to take")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--refusal", type=int, default=0, metavar="REPS",
                    help="then the free-memory refusal check, REPS refusing calls per source")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(os.path.abspath(a.bin), out)
    r = Runner(b)
    sampler = Sampler(0.25)
    sampler.start()
    res: dict = {"gib": a.gib, "env": {}, "warmup": None, "cycles": [], "notes": []}
    for k, c in {"nvidia_smi": "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader",
                 "uname": "uname -r", "nproc": "nproc"}.items():
        res["env"][k] = subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
    res["env"]["meminfo_start"] = meminfo()
    b.say(f"env {res['env']}")

    def dump() -> None:
        res["mem_series"] = sampler.rows
        (out / "variants.json").write_text(json.dumps(res, indent=1))

    try:
        if not a.no_warmup:
            w = b.worker(a.gib, seed=300)
            res["warmup"] = cycle(b, r, w, "a", "warmup")
            b.stop_workers()
            dump()
        p = b.worker(a.gib, seed=301)
        vs = a.variants.split(",")
        for rnd in range(a.max_rounds):
            order = vs if rnd % 2 == 0 else vs[::-1]
            for v in order:
                if rnd >= a.min_rounds and time.monotonic() - T0 + a.cycle_s > a.deadline_s:
                    res["notes"].append(f"round {rnd} {v}: skipped (deadline)")
                    continue
                if v == "e" and not any(c["variant"] == "c" and not (c["steps"][0]["json"] or [{}])[0]
                                        .get("init") for c in res["cycles"]):
                    res["notes"].append(f"round {rnd} e: skipped (c needed cuInit, so e == c)")
                    continue
                row = cycle(b, r, p, v, f"round{rnd}")
                res["cycles"].append(row)
                dump()
                if not row["ok_intact_new_work"]:
                    res["notes"].append(f"round {rnd} {v}: FAILED, stopping")
                    raise RuntimeError("cycle failed")
        if a.refusal:
            res["refusal"] = refusal(b, r, p, a.refusal)
            dump()
    except Exception as e:  # keep what was measured
        res["error"] = repr(e)
        b.say(f"ERROR {e!r}")
    finally:
        b.stop_workers()
        sampler.stop.set()
        summary = {}
        for v in sorted({c["variant"] for c in res["cycles"]}):
            cs = [c for c in res["cycles"] if c["variant"] == v]
            ck = [c["checkpoint_s"] for c in cs if c["checkpoint_s"] is not None]
            rt = [c["restore_s"] for c in cs if c["restore_s"] is not None]
            summary[v] = {"checkpoint_s": [round(x, 2) for x in ck], "restore_s": [round(x, 2) for x in rt],
                          "checkpoint_median_s": round(statistics.median(ck), 2) if ck else None,
                          "restore_median_s": round(statistics.median(rt), 2) if rt else None,
                          "all_ok": all(c["ok_intact_new_work"] for c in cs),
                          "cmds": sorted({s["cmd"] for c in cs for s in c["steps"]})}
        if res["warmup"]:
            wu = res["warmup"]
            summary["warmup"] = {"checkpoint_s": wu["checkpoint_s"], "restore_s": wu["restore_s"],
                                 "ok": wu["ok_intact_new_work"], "memtotal_mib": wu["memtotal_mib"]}
        res["summary"] = summary
        res["elapsed_s"] = now()
        dump()
        b.say("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    main()
