"""dynsnap-cuda on a real GPU: save/resume of PyTorch processes, measured.

Runs on the GPU machine (bench/gpu/run_h200.sh starts it). Every section
spawns bench/gpu/worker.py processes holding a known pattern, drives
``dynsnap-cuda`` against them, checks the pattern and new GPU work after each
wake, and appends its figures to ``results.json``; every CLI call is logged
with its exact command line. A section that fails records its error and the
next one still runs.

    python3 bench/gpu/ckpt_bench.py --bin native/build/dynsnap-cuda --out DIR \
        [--sections smoke,sizes,maps,overlap,pair10,busy,helpercost] [--sizes 1,4,16,64] [--preload LIB]

``--preload native/build/libdynsnap-thp.so`` starts every worker with that library in its
LD_PRELOAD, as dynsnap-entrypoint starts a worker by default (the driver's host copy on huge pages).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30


class Bench:
    def __init__(self, binary: str, out: Path, preload: str = "") -> None:
        self.bin = binary
        self.preload = preload
        self.out = out
        self.log = (out / "bench.log").open("a", buffering=1)
        self.results: dict = {}
        self.workers: list[subprocess.Popen] = []

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))

    def cli(self, *args: str, timeout: float = 300) -> dict:
        """One dynsnap-cuda call: its exit, wall time, output, and its own peak resident size (``maxrss_kib``,
        from wait4(2) of that child alone: what the agent's cgroup holds for it while it runs; issue 39's
        agent memory limit is set from it)."""
        cmd = [self.bin, *args]
        t0 = time.monotonic()
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            finally:
                timer.cancel()
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        wall = time.monotonic() - t0
        maxrss = int(usage.ru_maxrss)  # KiB on Linux
        per_pid = [r for r in (json.loads(x) for x in stdout.splitlines() if x.startswith("{")) if "pid" in r]
        self.say(f"$ {shlex.join(['dynsnap-cuda', *args])}  -> rc={proc.returncode} {wall:.3f}s "
                 f"maxrss {maxrss / 1024:.1f} MiB")
        if stderr.strip():
            self.say(f"  stderr: {stderr.strip()}")
        if stdout.strip() and not per_pid:
            self.say(f"  stdout: {stdout.strip()}")
        self.results.setdefault("helper_maxrss_kib", []).append({"args": list(args), "maxrss_kib": maxrss})
        return {"rc": proc.returncode, "wall_s": wall, "json": per_pid, "stdout": stdout,
                "stderr": stderr.strip(), "cmd": shlex.join(["dynsnap-cuda", *args]), "maxrss_kib": maxrss}

    def worker(self, gib: int, seed: int) -> subprocess.Popen:
        t0 = time.monotonic()
        env = dict(os.environ)
        if self.preload:
            env["LD_PRELOAD"] = ":".join(x for x in (self.preload, env.get("LD_PRELOAD", "")) if x)
        p = subprocess.Popen([sys.executable, str(HERE / "worker.py"), "--gib", str(gib),
                              "--seed", str(seed)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        line = p.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("ready"):
            raise RuntimeError(f"worker did not start: {line!r}")
        self.workers.append(p)
        self.say(f"worker pid={p.pid} {gib} GiB seed={seed} up in {time.monotonic() - t0:.1f}s")
        return p

    def ask(self, p: subprocess.Popen, cmd: str) -> str:
        p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        return p.stdout.readline().strip()  # type: ignore[union-attr]

    def check(self, p: subprocess.Popen) -> bool:
        r = self.ask(p, "check")
        self.say(f"  check pid={p.pid}: {r}")
        return r.startswith("ok")

    def stop_workers(self) -> None:
        for p in self.workers:
            try:
                p.stdin.write("quit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
                p.wait(timeout=30)
            except Exception:
                p.kill()
                p.wait()
        self.workers = []

    def state(self, *pids: int) -> str:
        return self.cli("--get-state", "--pid", ",".join(map(str, pids)))["stdout"].strip()


def gpu_used_mib() -> int:
    """GPU memory in use, as another process (nvidia-smi) sees it."""
    try:
        o = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30).stdout
        return int(o.split()[0])
    except Exception:
        return -1


def gpu_uuid(index: int = 0) -> str:
    o = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30).stdout.split()
    return o[index]


def ms(r: dict, op: str) -> list[float]:
    return [x["ms"].get(op, -1) for x in r["json"]]


def sec_smoke(b: Bench) -> dict:
    p = b.worker(1, seed=11)
    res = {"state_running": b.state(p.pid),
           "restore_tid": b.cli("--get-restore-tid", "--pid", str(p.pid))["stdout"].strip()}
    s = b.cli("--action", "save", "--pid", str(p.pid), "--json")
    res["state_after_save"] = b.state(p.pid)
    r = b.cli("--action", "resume", "--pid", str(p.pid), "--json")
    res.update(save_rc=s["rc"], resume_rc=r["rc"], state_after_resume=b.state(p.pid),
               intact=b.check(p), save_json=s["json"], resume_json=r["json"])
    b.stop_workers()
    return res


def sec_sizes(b: Bench, sizes: list[int], reps: int) -> list[dict]:
    rows = []
    for n, rep in ((n, r) for n in sizes for r in range(reps)):
        if rep == 0:
            p = b.worker(n, seed=100 + n)
        used0 = gpu_used_mib()
        s = b.cli("--action", "save", "--pid", str(p.pid), "--json", timeout=600)
        used1 = gpu_used_mib()
        r = b.cli("--action", "resume", "--pid", str(p.pid), "--json", timeout=600)
        used2 = gpu_used_mib()
        ok = b.check(p)
        ck = ms(s, "checkpoint")[0] / 1e3 if s["json"] else -1
        rs = ms(r, "restore")[0] / 1e3 if r["json"] else -1
        row = {"gib": n, "rep": rep, "save_rc": s["rc"], "resume_rc": r["rc"], "intact_and_new_work": ok,
               "used_mib_before": used0, "used_mib_saved": used1, "used_mib_resumed": used2,
               "lock_ms": ms(s, "lock"), "checkpoint_s": ck, "restore_s": rs,
               "unlock_ms": ms(r, "unlock"), "save_wall_s": s["wall_s"], "resume_wall_s": r["wall_s"],
               "checkpoint_GBps": n * GIB / 1e9 / ck if ck > 0 else None,
               "restore_GBps": n * GIB / 1e9 / rs if rs > 0 else None,
               "bytes_freed_reported": s["json"][0].get("bytes") if s["json"] else None,
               "save_cmd": s["cmd"], "resume_cmd": r["cmd"]}
        b.say(f"SIZE {json.dumps(row)}")
        rows.append(row)
        if rep == reps - 1:
            b.stop_workers()
        b.results["sizes"] = rows
        b.save()
    return rows


def sec_maps(b: Bench) -> dict:
    p = b.worker(2, seed=21)
    pid = str(p.pid)
    uuid = gpu_uuid(0)
    bare = uuid.removeprefix("GPU-").replace("-", "")
    res: dict = {"uuid": uuid}
    b.cli("--action", "save", "--pid", pid)
    bogus = "GPU-" + "deadbeef" * 4
    for name, m in [("nonexistent_uuid", f"0={bogus}"), ("nonexistent_index", "0=1"),
                    ("miscounted", f"0=0,{bogus}=0")]:
        r = b.cli("--action", "resume", "--pid", pid, "--gpu-map", m)
        res[name] = {"map": m, "rc": r["rc"], "stderr": r["stderr"], "state_after": b.state(p.pid)}
    r = b.cli("--action", "resume", "--pid", pid, "--need-bytes", str(10**15))
    res["free_memory_refusal"] = {"rc": r["rc"], "stderr": r["stderr"], "state_after": b.state(p.pid)}
    r = b.cli("--action", "resume", "--pid", pid, "--gpu-map", f"0={bare.upper()}", "--json")
    res["identity_index_to_uuid"] = {"rc": r["rc"], "state_after": b.state(p.pid), "intact": b.check(p)}
    b.cli("--action", "save", "--pid", pid)
    r = b.cli("--action", "restore", "--pid", pid, "--device-map", f"{uuid}={uuid}")
    u = b.cli("--action", "unlock", "--pid", pid)
    res["identity_uuid_restore_unlock"] = {"rc": [r["rc"], u["rc"]], "intact": b.check(p)}
    b.stop_workers()
    return res


def sec_overlap(b: Bench, gib: int, reps: int) -> dict:
    ps = [b.worker(gib, seed=31), b.worker(gib, seed=32)]
    pids = f"{ps[0].pid},{ps[1].pid}"
    t: dict[str, list[float]] = {k: [] for k in ("save_serial", "save_parallel", "resume_serial",
                                                 "resume_parallel")}
    ok = True
    for i in range(reps):
        order = ["serial", "parallel"] if i % 2 == 0 else ["parallel", "serial"]
        for mode in order:
            extra = ["--serial"] if mode == "serial" else []
            s = b.cli("--action", "save", "--pid", pids, "--json", *extra)
            r = b.cli("--action", "resume", "--pid", pids, "--json", *extra)
            ok = ok and s["rc"] == 0 and r["rc"] == 0 and all(b.check(p) for p in ps)
            t[f"save_{mode}"].append(s["wall_s"])
            t[f"resume_{mode}"].append(r["wall_s"])
    med = {k: statistics.median(v) for k, v in t.items()}
    res = {"gib_each": gib, "reps": reps, "all_ok": ok, "walls_s": t, "median_s": med,
           "save_serial_over_parallel": med["save_serial"] / med["save_parallel"],
           "resume_serial_over_parallel": med["resume_serial"] / med["resume_parallel"],
           "cmd": f"dynsnap-cuda --action save|resume --pid {pids} --json [--serial]"}
    b.stop_workers()
    return res


def sec_pair10(b: Bench, gib: int, reps: int) -> dict:
    ps = [b.worker(gib, seed=41), b.worker(gib, seed=42)]
    pids = f"{ps[0].pid},{ps[1].pid}"
    rows = []
    for i in range(reps):
        used0 = gpu_used_mib()
        s = b.cli("--action", "save", "--pid", pids, "--json")
        used1 = gpu_used_mib()
        st = b.state(*[p.pid for p in ps])
        r = b.cli("--action", "resume", "--pid", pids, "--json")
        oks = [b.check(p) for p in ps]
        rows.append({"rep": i, "save_rc": s["rc"], "resume_rc": r["rc"], "save_s": s["wall_s"],
                     "resume_s": r["wall_s"], "used_mib_before": used0, "used_mib_saved": used1,
                     "states_saved": st, "intact": oks})
    b.stop_workers()
    return {"gib_each": gib, "reps": rows,
            "all_ok": all(x["save_rc"] == 0 and x["resume_rc"] == 0 and all(x["intact"]) for x in rows),
            "cmd": f"dynsnap-cuda --action save --pid {pids} --json; ... --action resume ..."}


def sec_memcost(b: Bench, gib: int, reps: int) -> dict:
    """What the helper's own GPU memory sampling (a context per sample) adds to save/resume."""
    p = b.worker(gib, seed=61)
    t: dict[str, list[float]] = {k: [] for k in ("save", "save_skip_mem", "resume", "resume_skip_mem")}
    ok = True
    for _ in range(reps):
        for extra in ([], ["--skip-mem"]):
            sfx = "_skip_mem" if extra else ""
            s = b.cli("--action", "save", "--pid", str(p.pid), *extra)
            r = b.cli("--action", "resume", "--pid", str(p.pid), *extra)
            ok = ok and s["rc"] == 0 and r["rc"] == 0 and b.check(p)
            t["save" + sfx].append(s["wall_s"])
            t["resume" + sfx].append(r["wall_s"])
    b.stop_workers()
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"gib": gib, "all_ok": ok, "walls_s": t, "median_s": med,
            "cmd": f"dynsnap-cuda --action save|resume --pid PID [--skip-mem]  ({gib} GiB worker)"}


def sec_helpercost(b: Bench, gib: int, reps: int) -> dict:
    """What one helper call costs the agent beyond the driver's work: ``--get-state`` (the agent's
    observation before every step, one call per GPU pid), ``--mem-info`` (what the agent ran before
    and after every save and resume until the helper printed its own ``gpus`` line), and the
    save/resume walls beside their driver times."""
    p = b.worker(gib, seed=71)
    pid = str(p.pid)
    walls: dict[str, list[float]] = {k: [] for k in ("get_state_running", "mem_info", "get_state_checkpointed")}
    for _ in range(reps):
        walls["get_state_running"].append(b.cli("--get-state", "--pid", pid)["wall_s"])
        walls["mem_info"].append(b.cli("--mem-info")["wall_s"])
    s = b.cli("--action", "save", "--pid", pid, "--json")
    for _ in range(reps):
        walls["get_state_checkpointed"].append(b.cli("--get-state", "--pid", pid)["wall_s"])
    r = b.cli("--action", "resume", "--pid", pid, "--json")
    ok = s["rc"] == 0 and r["rc"] == 0 and b.check(p)
    gpus = [json.loads(x) for x in (s["stdout"] + r["stdout"]).splitlines() if x.startswith('{"gpus"')]
    b.stop_workers()
    return {"gib": gib, "reps": reps, "all_ok": ok, "walls_s": walls,
            "median_s": {k: statistics.median(v) for k, v in walls.items()},
            "save_wall_minus_driver_s": s["wall_s"] - sum(ms(s, "lock") + ms(s, "checkpoint")) / 1e3,
            "resume_wall_minus_driver_s": r["wall_s"] - sum(ms(r, "restore") + ms(r, "unlock")) / 1e3,
            "gpus_lines": gpus, "save_stderr": s["stderr"], "resume_stderr": r["stderr"],
            "cmd": f"dynsnap-cuda --get-state --pid {pid} | --mem-info  ({reps}x each; {gib} GiB worker)"}


def sec_busy(b: Bench, spin_s: float, timeout_ms: int) -> dict:
    busy, idle = b.worker(2, seed=51), b.worker(2, seed=52)
    pids = f"{busy.pid},{idle.pid}"
    res: dict = {"spin_s": spin_s, "lock_timeout_ms": timeout_ms}
    b.say(f"  busy pid={busy.pid}: {b.ask(busy, f'sleep {spin_s}')}")
    time.sleep(0.5)
    s = b.cli("--action", "save", "--pid", pids, "--timeout", str(timeout_ms), "--json", timeout=120)
    res["save_while_busy"] = {"rc": s["rc"], "wall_s": s["wall_s"], "stderr": s["stderr"], "json": s["json"],
                              "states_after": b.state(busy.pid, idle.pid), "cmd": s["cmd"]}
    if s["rc"] == 0:  # the lock did not wait for the kernel: undo, or 'sync' would block
        b.cli("--action", "resume", "--pid", pids)
    lk = b.cli("--action", "lock", "--pid", str(busy.pid), "--timeout", str(timeout_ms), timeout=120)
    res["plain_lock_while_busy"] = {"rc": lk["rc"], "wall_s": lk["wall_s"], "stderr": lk["stderr"],
                                    "state_after": b.state(busy.pid), "cmd": lk["cmd"]}
    if lk["rc"] == 0:
        b.cli("--action", "unlock", "--pid", str(busy.pid))
    t0 = time.monotonic()
    b.say(f"  busy pid={busy.pid}: {b.ask(busy, 'sync')} after {time.monotonic() - t0:.1f}s")
    s2 = b.cli("--action", "save", "--pid", pids, "--json")
    r2 = b.cli("--action", "resume", "--pid", pids, "--json")
    res["after_idle"] = {"save_rc": s2["rc"], "resume_rc": r2["rc"],
                         "intact": [b.check(busy), b.check(idle)]}
    b.stop_workers()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="smoke,sizes,maps,overlap,pair10,busy")
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=1, help="save/resume cycles per size")
    ap.add_argument("--preload", default="", help="a library for every worker's LD_PRELOAD (libdynsnap-thp.so)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(os.path.abspath(a.bin), out, os.path.abspath(a.preload) if a.preload else "")
    b.results["preload"] = b.preload
    env = {k: subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
           for k, c in {"nvidia_smi": "nvidia-smi --query-gpu=name,uuid,driver_version,memory.total "
                                      "--format=csv,noheader",
                        "uname": "uname -r",
                        "torch": f"{sys.executable} -c 'import torch;print(torch.__version__)'"}.items()}
    b.results["env"] = env
    b.say(f"env {env}")
    sections = {
        "smoke": lambda: sec_smoke(b),
        "sizes": lambda: sec_sizes(b, [int(x) for x in a.sizes.split(",")], a.reps),
        "memcost": lambda: sec_memcost(b, gib=4, reps=3),
        "maps": lambda: sec_maps(b),
        "overlap": lambda: sec_overlap(b, gib=8, reps=3),
        "pair10": lambda: sec_pair10(b, gib=4, reps=10),
        "busy": lambda: sec_busy(b, spin_s=20, timeout_ms=3000),
        "helpercost": lambda: sec_helpercost(b, gib=1, reps=10),
    }
    for name in a.sections.split(","):
        b.say(f"=== {name}")
        t0 = time.monotonic()
        try:
            b.results[name] = sections[name]()
        except Exception:
            b.results[name] = {"error": traceback.format_exc()}
            b.say(traceback.format_exc())
            for p in b.workers:
                p.kill()
            b.workers = []
        b.results.setdefault("section_s", {})[name] = time.monotonic() - t0
        b.say(f"=== {name} done in {time.monotonic() - t0:.1f}s: {json.dumps(b.results[name])[:2000]}")
        b.save()


if __name__ == "__main__":
    main()
