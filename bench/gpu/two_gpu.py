"""Two GPUs, two NCCL ranks (issue 11), measured with dynsnap-cuda and CRIU on the GPU machine.

Runs on the two-GPU machine (bench/gpu/run_h200x2.sh starts it). Every experiment drives real
PyTorch ranks (bench/gpu/nccl_rank.py: one process per GPU, one NCCL communicator) and records
every CLI call with its exact command line, exit status, JSON and stderr, the driver's process
states and the per-GPU and per-process memory nvidia-smi reports. An experiment that fails records
its error and the next one still runs; one that would not fit in the time left is skipped and
says so.

    bwcmp     all-reduce bandwidth, 64 KiB to 1 GiB, of NCCL's defaults against the capturable sets,
              three rounds interleaved
    bisect    the three NCCL switches (P2P, SHM, cuMem) in the 7 combinations that turn any off,
              plus P2P and SHM off with only cuMem's host allocations off: NCCL_DEBUG=INFO's
              transport lines, all-reduce bandwidth, then one `save` of both ranks and one
              `resume`; the smallest set that passes is used by the phases after it
    loop      10 cycles of all-reduces, idle, `save` of both, GPU memory on both GPUs, `resume`,
              all-reduce and pattern checked; overlapped and --serial alternating
    swap      ranks of different sizes, saved and resumed with --gpu-map 0=1,1=0: per-process
              placement before and after, pattern, new work, the collective; then back home
    busy      `save` while a collective is in flight (one rank inside it, then both ranks in a
              queue of them), with a 3 s lock timeout: rolled back, no rank locked, the collective
              finishes right
    pytest    tests/gpu/test_two_gpus_gpu.py: the agent's preflight on real ranks
    criu      CRIU 4.2.1 + its CUDA plugin with dynsnap-cuda as cuda-checkpoint: a tree of both
              ranks dumped and restored (once more 65 s later if the restore fails), the
              collective and the pattern after
    defaults  the eighth combination, NCCL's defaults, last: bandwidth, save, resume; if the
              restore fails, recovery without killing the ranks (retry, one rank at a time, the
              other order), then a rank killed; the driver's answer and both states after each
              step; and one rank of a second default pair saved and resumed alone while its
              peer runs

    python3 bench/gpu/two_gpu.py --bin native/build/dynsnap-cuda --out DIR [--phases ...]
        [--budget SECONDS] [--dry]

``--dry`` runs the ranks without a GPU (nccl_rank.py --dry) against whatever libcuda
DYNSNAP_LIBCUDA names (the stub, locally): it checks this script's logic, nothing about GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RANK = HERE / "nccl_rank.py"
MIB = 1 << 20

# The switches the issue names: the value that turns each off. Unset means NCCL's default.
SWITCHES = {"P": ("NCCL_P2P_DISABLE", "1"), "S": ("NCCL_SHM_DISABLE", "1"), "C": ("NCCL_CUMEM_ENABLE", "0")}
HOST = ("NCCL_CUMEM_HOST_ENABLE", "0")  # what NCCL_DEBUG shows in use beside them (cuMem host buffers)
ALL_NCCL = [v for v, _ in SWITCHES.values()] + [HOST[0]]
# bisect order: the most restrictive first. NCCL's defaults (whose restore was seen failing, leaving both
# ranks checkpointed) run last of all, in their own phase, so that whatever a failed restore leaves
# behind on the GPUs cannot touch the other experiments.
COMBOS = ["PSC", "PSH", "PS", "PC", "SC", "P", "S", "C"]
BW_SIZES = [(64 << 10, 100), (1 << 20, 50), (16 << 20, 20), (256 << 20, 5)]
# CRIU runs: (name, NCCL set, extra env, dump?). What the runs found, in order (docs/BENCHMARKS.md): CRIU
# 4.2.1 cannot dump the io_uring rank 0 holds (PyTorch's TCPStore server runs on libuv; UV_USE_IO_URING=0
# does not remove it, USE_LIBUV=0 does); then the restore could not bind a listening socket of rank 0,
# also 5 s later: its port was held by a TIME_WAIT connection NCCL closed at start-up, and 65 s later
# the same images restored. NCCL_RAS_ENABLE=0 (both ranks listened on 127.0.0.1:28028, NCCL's RAS port)
# was set on the way and kept; whether it is needed was not tested alone. CRIU_VARIANTS is what the
# last run tried; the earlier ones are in the results of their runs.
NO_LIBUV_NO_RAS = {"USE_LIBUV": "0", "NCCL_RAS_ENABLE": "0"}
CRIU_VARIANTS = (("PC-no-libuv-no-ras", "PC", NO_LIBUV_NO_RAS, True),
                 ("PS-no-libuv-no-ras", "PS", NO_LIBUV_NO_RAS, True))
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
              7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def combo_env(name: str) -> dict[str, str]:
    if name.startswith("defaults"):
        return {}
    env = {}
    for c in name:
        var, val = HOST if c == "H" else SWITCHES[c]
        env[var] = val
    return env


class Pair:
    """Two ranks started by this script (or a launcher tree's two ranks), reached by their files."""

    def __init__(self, d: Driver, name: str, env: dict[str, str], mib: tuple[int, int], port: int,
                 debug: bool = False, launch: bool = False) -> None:
        self.d, self.name, self.env = d, name, env
        self.work = d.work / name
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.ctl = [self.work / "0", self.work / "1"]
        e = {k: v for k, v in os.environ.items() if k not in ALL_NCCL}
        e.update(MULTICAST_OFF)
        e.update(env)
        if debug:
            e.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV,P2P,SHM,NET,ALLOC,BOOTSTRAP")
        else:
            e.pop("NCCL_DEBUG", None)
        dry = ["--dry"] if d.dry else []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.root: subprocess.Popen[bytes] | None = None
        self.logs = [self.work / "r0.log", self.work / "r1.log"]
        if launch:
            log = (self.work / "tree.log").open("wb")
            self.root = subprocess.Popen([sys.executable, str(RANK), "launch", "--port", str(port), "--mib",
                                          f"{mib[0]},{mib[1]}", "--ctl", str(self.work), *dry],
                                         env=e, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            self.logs = [self.work / "tree.log"]
        else:
            for r in (0, 1):
                log = self.logs[r].open("wb")
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(RANK), "rank", "--rank", str(r), "--port", str(port), "--mib", str(mib[r]),
                     "--ctl", str(self.ctl[r]), *dry],
                    env=e, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self.pids: list[int] = []

    def wait_ready(self, timeout: float = 240) -> bool:
        outs = [self.d.wait_out(c, timeout) for c in self.ctl]
        ok = all(o.startswith("ready") for o in outs)
        self.pids = [int(o.split()[1]) if o.startswith("ready") else 0 for o in outs]
        self.d.say(f"[{self.name}] ranks {'ready' if ok else 'NOT ready'}: {outs}")
        return ok

    @property
    def pidlist(self) -> str:
        return ",".join(str(p) for p in self.pids)

    def ask(self, cmd: str | list[str], timeout: float = 60) -> list[str]:
        """The same command to both ranks at once (a collective needs both), or one each."""
        cmds = [cmd, cmd] if isinstance(cmd, str) else cmd
        for c, x in zip(self.ctl, cmds, strict=True):
            if x:
                self.d.send(c, x)
        outs = [self.d.wait_out(c, timeout) if x else "" for c, x in zip(self.ctl, cmds, strict=True)]
        self.d.say(f"[{self.name}] {cmds} -> {outs}")
        return outs

    def ask_one(self, r: int, cmd: str, timeout: float = 60) -> str:
        self.d.send(self.ctl[r], cmd)
        out = self.d.wait_out(self.ctl[r], timeout)
        self.d.say(f"[{self.name}] rank {r} {cmd!r} -> {out}")
        return out

    def kill(self) -> None:
        for p in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        for pr in [*self.procs, *([self.root] if self.root else [])]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pr.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pr.wait(timeout=20)

    def nccl_lines(self) -> list[str]:
        out = []
        for lg in self.logs:
            with contextlib.suppress(OSError):
                out += [ln for ln in lg.read_text(errors="replace").splitlines() if "NCCL" in ln]
        return out


def oks(outs: list[str]) -> bool:
    return bool(outs) and all(o.startswith("ok") for o in outs)


class Driver:
    def __init__(self, a: argparse.Namespace) -> None:
        self.bin, self.out, self.dry = a.bin, Path(a.out), a.dry
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(a.work)
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.log = (self.out / "bench.log").open("a", buffering=1)
        self.nccl_log = (self.out / "nccl-debug.log").open("a", buffering=1)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + float(a.budget)
        self.results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": a.budget}
        self.port = 29500
        self.pairs: list[Pair] = []
        self.loop_pair: Pair | None = None

    # -- plumbing --

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def next_port(self) -> int:
        self.port += 7
        return self.port

    def send(self, ctl: Path, cmd: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (ctl / "out").unlink()
        tmp = ctl / "cmd.tmp"
        tmp.write_text(cmd + "\n")
        tmp.rename(ctl / "cmd")

    def wait_out(self, ctl: Path, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                text = (ctl / "out").read_text().strip()
                (ctl / "out").unlink()
                return text
            except FileNotFoundError:
                time.sleep(0.02)
        return "timeout"

    def cli(self, *args: str, timeout: float = 300) -> dict[str, Any]:
        cmd = [self.bin, *args]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, out, err = p.returncode, p.stdout, p.stderr.strip()
        except subprocess.TimeoutExpired as e:
            rc, out, err = -9, str(e.stdout or ""), f"timed out after {timeout} s"
        wall = time.monotonic() - t0
        per_pid = [r for r in (json.loads(x) for x in out.splitlines() if x.startswith("{")) if "pid" in r]
        shown = shlex.join(["dynsnap-cuda", *args])
        self.say(f"$ {shown}  -> rc={rc} {wall:.3f}s")
        if err:
            self.say(f"  stderr: {err}")
        if out.strip() and not per_pid:
            self.say(f"  stdout: {out.strip()}")
        return {"cmd": shown, "rc": rc, "wall_s": round(wall, 4), "json": per_pid, "stdout": out.strip(),
                "stderr": err}

    def states(self, pids: list[int]) -> dict[str, str]:
        """Each pid's driver state, one --get-state call per pid (a failure of one names its own)."""
        out = {}
        for p in pids:
            r = self.cli("--get-state", "--pid", str(p), timeout=30)
            out[str(p)] = r["stdout"] if r["rc"] == 0 else f"error: {r['stderr']}"
        return out

    def smi(self) -> dict[str, Any]:
        """Per-GPU memory in use and per-process placement, as nvidia-smi (NVML) reports them."""
        if not shutil.which("nvidia-smi"):
            return {"gpus": [], "apps": []}

        def q(*args: str) -> list[list[str]]:
            p = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                               text=True, timeout=30)
            return [[c.strip() for c in ln.split(",")] for ln in p.stdout.splitlines() if ln.strip()]

        gpus = [{"index": int(r[0]), "uuid": r[1], "used_mib": int(r[2])}
                for r in q("--query-gpu=index,uuid,memory.used") if len(r) == 3]
        apps = [{"pid": int(r[0]), "uuid": r[1], "used_mib": int(r[2]) if r[2].isdigit() else r[2]}
                for r in q("--query-compute-apps=pid,gpu_uuid,used_memory") if len(r) == 3 and r[0].isdigit()]
        return {"gpus": gpus, "apps": apps}

    def placement(self, pair: Pair, smi: dict[str, Any]) -> list[dict[str, Any]]:
        """Where each rank lives: the GPU index whose UUID nvidia-smi lists beside the rank's pid."""
        index = {g["uuid"]: g["index"] for g in smi["gpus"]}
        out = []
        for r, pid in enumerate(pair.pids):
            apps = [a for a in smi["apps"] if a["pid"] == pid]
            out.append({"rank": r, "pid": pid, "gpus": [index.get(a["uuid"], a["uuid"]) for a in apps],
                        "used_mib": [a["used_mib"] for a in apps]})
        return out

    def phase(self, name: str, need_s: float, fn: Callable[[], Any]) -> None:
        if self.left() < need_s:
            self.say(f"== {name}: skipped, {self.left():.0f} s left and it needs about {need_s:.0f} s")
            self.results[name] = {"skipped": f"{self.left():.0f} s left, needs about {need_s:.0f} s"}
            self.save()
            return
        self.say(f"== {name} ({self.left():.0f} s left)")
        t0 = time.monotonic()
        try:
            fn()
        except Exception:
            self.say(f"{name} FAILED:\n{traceback.format_exc()}")
            self.results.setdefault(name, {})["error"] = traceback.format_exc()
        self.results.setdefault(name, {})["phase_s"] = round(time.monotonic() - t0, 1)
        self.save()

    def start(self, name: str, env: dict[str, str], mib: tuple[int, int], debug: bool = False,
              launch: bool = False) -> Pair:
        p = Pair(self, name, env, mib, self.next_port(), debug=debug, launch=launch)
        self.pairs.append(p)
        return p

    def stop(self, pair: Pair) -> None:
        pair.kill()
        if pair.logs and pair.logs[0].name != "tree.log":
            self.nccl_log.write(f"===== {pair.name} env={pair.env}\n")
            self.nccl_log.write("\n".join(pair.nccl_lines()) + "\n")

    # -- experiments --

    def env_facts(self) -> None:
        facts: dict[str, Any] = {"nccl_env_in_image": {k: v for k, v in os.environ.items() if k.startswith("NCCL")},
                                 "multicast_off": {k: os.environ.get(k) for k in MULTICAST_OFF}}
        for cmd in (["nvidia-smi", "-L"], ["nvidia-smi", "topo", "-m"], ["uname", "-r"],
                    [sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.device_count(), "
                     "torch.cuda.nccl.version())"]):
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
                facts[" ".join(cmd[:2])] = (p.stdout + p.stderr).strip()
            except (OSError, subprocess.TimeoutExpired) as e:
                facts[" ".join(cmd[:2])] = str(e)
        self.results["facts"] = facts
        self.say(json.dumps(facts, indent=1))

    def capture_cycle(self, p: Pair, rec: dict[str, Any], *, bw: bool) -> None:
        """bandwidth, a checked all-reduce, one save of both, one resume of both, checks."""
        if bw:
            spec = ",".join(f"{s}:{n}" for s, n in BW_SIZES)
            outs = p.ask(f"bw {spec}", timeout=180)
            rec["bw_before"] = [json.loads(o) if o.startswith("[") else o for o in outs]
        rec["ar_before"] = p.ask("ar 3")
        rec["smi_before"] = self.smi()
        rec["save"] = self.cli("--action", "save", "--pid", p.pidlist, "--json")
        rec["after_save"] = {"states": self.states(p.pids), "smi": self.smi()}
        rec["resume"] = self.cli("--action", "resume", "--pid", p.pidlist, "--json")
        rec["after_resume"] = {"states": self.states(p.pids)}
        if rec["resume"]["rc"] == 0:
            rec["ar_after"] = p.ask("ar 3")
            rec["check_after"] = p.ask("check")
            if bw:
                outs = p.ask(f"bw {16 << 20}:20,{256 << 20}:5", timeout=120)
                rec["bw_after"] = [json.loads(o) if o.startswith("[") else o for o in outs]
        rec["capturable"] = (rec["save"]["rc"] == 0 and rec["resume"]["rc"] == 0
                             and oks(rec.get("ar_after", [])) and oks(rec.get("check_after", [])))

    def after_step(self, p: Pair, live: list[int]) -> dict[str, Any]:
        """States after a recovery step; a pid the step left locked is unlocked, and ranks found
        running again are checked."""
        st = self.states(live)
        out: dict[str, Any] = {"states": st}
        locked = [pid for pid in live if st.get(str(pid)) == "locked"]
        if locked:
            out["unlock"] = self.cli("--action", "unlock", "--pid", ",".join(map(str, locked)), "--json")
            out["states_after_unlock"] = st = self.states(live)
        if all(st.get(str(pid)) == "running" for pid in live):
            if len(live) == 2:
                out["ar"] = p.ask("ar 3", timeout=30)
            out["check"] = [p.ask_one(p.pids.index(pid), "check", timeout=30) for pid in live]
        return out

    def recover(self, p: Pair) -> dict[str, Any]:
        """Can a pair whose restore failed be brought back without killing it?"""
        a, b = p.pids
        steps: list[dict[str, Any]] = []

        def step(name: str, *args: str, live: list[int] | None = None) -> bool:
            live = live or [a, b]
            r = self.cli(*args, timeout=120)
            steps.append({"step": name, "cli": r, **self.after_step(p, live)})
            self.save()
            return all(s == "running" for s in self.states(live).values())

        done = step("retry: resume both again", "--action", "resume", "--pid", f"{a},{b}", "--json")
        if not done:
            step("rank 1 alone: restore", "--action", "restore", "--pid", str(b), "--json")
            step("rank 0 alone: restore", "--action", "restore", "--pid", str(a), "--json")
            time.sleep(5)
            done = step("5 s later, the other order, one at a time: resume --serial 1,0", "--action", "resume",
                        "--pid", f"{b},{a}", "--serial", "--json")
        if not done:
            os.kill(b, signal.SIGKILL)
            time.sleep(2)
            steps.append({"step": "rank 1 killed (SIGKILL)", "states": self.states([a])})
            step("then rank 0 alone: restore", "--action", "restore", "--pid", str(a), "--json", live=[a])
        return {"pids": [a, b], "steps": steps}

    def bisect(self) -> None:
        res: dict[str, Any] = {"order": COMBOS, "combos": {}}
        self.results["bisect"] = res
        # all pairs start at once (a rank's start, PyTorch and NCCL, is most of a pair's cost) and wait
        # idle, making no CUDA call, until their turn
        pairs = {c: self.start(f"bisect-{c}", combo_env(c), (512, 512), debug=True) for c in COMBOS}
        ready = {c: pr.wait_ready() for c, pr in pairs.items()}
        for c in COMBOS:
            pr = pairs[c]
            rec: dict[str, Any] = {"env": combo_env(c), "ready": ready[c], "pids": pr.pids}
            res["combos"][c] = rec
            try:
                if ready[c]:
                    self.capture_cycle(pr, rec, bw=True)
            except Exception:
                rec["error"] = traceback.format_exc()
                self.say(rec["error"])
            self.stop(pr)
            self.say(f"[bisect {c}] capturable={rec.get('capturable')}")
            self.save()
        ok = [c for c in COMBOS if res["combos"][c].get("capturable") and "H" not in c]
        res["capturable"] = ok
        minimal = sorted(ok, key=lambda c: (0 if c == "defaults" else len(c), -self.bw_at(res["combos"][c])))
        res["minimal"] = minimal[0] if minimal else None
        self.say(f"[bisect] capturable: {ok}; smallest: {res['minimal']}")

    @staticmethod
    def bw_at(rec: dict[str, Any], size: int = 256 << 20) -> float:
        try:
            rows: list[dict[str, Any]] = rec["bw_before"][0]
            return float(next(r["busbw_GBps"] for r in rows if r["bytes"] == size))
        except (KeyError, IndexError, StopIteration, TypeError):
            return 0.0

    def bwcmp(self) -> None:
        """All-reduce bandwidth of NCCL's defaults against the capturable sets, 3 rounds interleaved."""
        combos = ["defaults", "PC", "PS", "PSC"]
        sizes = [(64 << 10, 200), (1 << 20, 100), (16 << 20, 50), (256 << 20, 10), (1 << 30, 3)]
        spec = ",".join(f"{sz}:{n}" for sz, n in sizes)
        res: dict[str, Any] = {"combos": {c: {"env": combo_env(c), "rounds": []} for c in combos}, "spec": spec}
        self.results["bwcmp"] = res
        pairs = {c: self.start(f"bw-{c}", combo_env(c), (256, 256)) for c in combos}
        ready = {c: pr.wait_ready() for c, pr in pairs.items()}
        for rnd in range(3):
            for c in combos if rnd % 2 == 0 else combos[::-1]:
                if ready[c]:
                    outs = pairs[c].ask(f"bw {spec}", timeout=120)
                    res["combos"][c]["rounds"].append([json.loads(o) if o.startswith("[") else o for o in outs])
            self.save()
        for pr in pairs.values():
            self.stop(pr)

    def defaults(self) -> None:
        res: dict[str, Any] = {"env": {}}
        self.results["defaults"] = res
        main = self.start("defaults", {}, (512, 512), debug=True)
        # a second default pair: one rank saved and resumed alone while its peer runs
        alone = self.start("defaults-one-rank", {}, (512, 512), debug=True)
        res["ready"] = main.wait_ready()
        ready_alone = alone.wait_ready()
        res["pids"] = main.pids
        try:
            if res["ready"]:
                self.capture_cycle(main, res, bw=True)
                if not res["capturable"] and res["save"]["rc"] == 0:
                    self.results["recover"] = self.recover(main)
        except Exception:
            res["error"] = traceback.format_exc()
            self.say(res["error"])
        self.stop(main)
        self.save()
        rec: dict[str, Any] = {"env": {}, "ready": ready_alone, "pids": alone.pids}
        self.results.setdefault("recover", {})["one_rank_alone"] = rec
        try:
            if ready_alone:
                rec["ar_before"] = alone.ask("ar 3")
                b = alone.pids[1]
                rec["save_rank1"] = self.cli("--action", "save", "--pid", str(b), "--json")
                rec["states_after_save"] = self.states(alone.pids)
                rec["resume_rank1"] = self.cli("--action", "resume", "--pid", str(b), "--json")
                rec["after_resume"] = self.after_step(alone, alone.pids)
        except Exception:
            rec["error"] = traceback.format_exc()
        self.stop(alone)

    def safe_combo(self) -> str:
        return self.results.get("bisect", {}).get("minimal") or "PSC"

    def loop(self) -> None:
        combo = self.safe_combo()
        res: dict[str, Any] = {"combo": combo, "env": combo_env(combo), "mib": [3072, 1024], "cycles": []}
        self.results["loop"] = res
        p = self.start("loop", combo_env(combo), (3072, 1024))
        self.loop_pair = p
        if not p.wait_ready():
            res["error"] = "ranks not ready"
            return
        res["pids"] = p.pids
        for i in range(10):
            serial = ["--serial"] if i % 2 else []
            c: dict[str, Any] = {"cycle": i, "mode": "serial" if serial else "overlapped"}
            res["cycles"].append(c)
            c["ar_busy"] = p.ask("ar 20")
            time.sleep(1.0)  # idle
            c["smi_before"] = self.smi()
            c["save"] = self.cli("--action", "save", "--pid", p.pidlist, "--json", *serial)
            c["states_saved"] = self.states(p.pids)
            c["smi_saved"] = self.smi()
            c["placement_saved"] = self.placement(p, c["smi_saved"])
            c["resume"] = self.cli("--action", "resume", "--pid", p.pidlist, "--json", *serial)
            c["states_resumed"] = self.states(p.pids)
            c["ar_after"] = p.ask("ar 20")
            c["check_after"] = p.ask("check")
            c["ok"] = (c["save"]["rc"] == 0 and c["resume"]["rc"] == 0 and oks(c["ar_after"])
                       and oks(c["check_after"]))
            self.save()
            if not c["ok"]:
                break
        for mode in ("overlapped", "serial"):
            cs = [c for c in res["cycles"] if c["mode"] == mode and c["ok"]]
            if cs:
                res[f"{mode}_save_wall_median_s"] = statistics.median(c["save"]["wall_s"] for c in cs)
                res[f"{mode}_resume_wall_median_s"] = statistics.median(c["resume"]["wall_s"] for c in cs)
        res["all_ok"] = len(res["cycles"]) == 10 and all(c["ok"] for c in res["cycles"])

    def swap(self) -> None:
        p = self.loop_pair
        res: dict[str, Any] = {}
        self.results["swap"] = res
        if p is None or not p.pids:
            res["error"] = "no loop pair"
            return
        for rnd in ("away", "home"):
            r: dict[str, Any] = {}
            res[rnd] = r
            r["where_before"] = p.ask("where")
            r["smi_before"] = self.smi()
            r["placement_before"] = self.placement(p, r["smi_before"])
            r["save"] = self.cli("--action", "save", "--pid", p.pidlist, "--json")
            r["smi_saved"] = self.smi()
            r["resume"] = self.cli("--action", "resume", "--pid", p.pidlist, "--gpu-map", "0=1,1=0", "--json")
            r["states"] = self.states(p.pids)
            r["smi_after"] = self.smi()
            r["placement_after"] = self.placement(p, r["smi_after"])
            r["where_after"] = p.ask("where")
            r["check"] = p.ask("check")
            r["ar"] = p.ask("ar 5")
            r["bw"] = p.ask(f"bw {16 << 20}:20,{256 << 20}:5")
            before = [x["gpus"] for x in r["placement_before"]]
            after = [x["gpus"] for x in r["placement_after"]]
            r["moved"] = all(len(b) == 1 and len(a_) == 1 and a_[0] == 1 - b[0] for b, a_ in zip(before, after,
                                                                                                   strict=True))
            r["ok"] = r["resume"]["rc"] == 0 and r["moved"] and oks(r["check"]) and oks(r["ar"])
            self.save()
            if r["resume"]["rc"] != 0:
                break

    def busy(self) -> None:
        p = self.loop_pair
        res: dict[str, Any] = {"timeout_ms": 3000}
        self.results["busy"] = res
        if p is None or not p.pids:
            res["error"] = "no loop pair"
            return
        # (a) rank 0 inside an all-reduce that rank 1 has not entered: its kernel waits on the GPU
        a: dict[str, Any] = {}
        res["one_rank_inside"] = a
        a["rank0_start"] = p.ask_one(0, "ar_start 64 1")
        time.sleep(0.5)
        a["save"] = self.cli("--action", "save", "--pid", p.pidlist, "--timeout", "3000", "--json", timeout=60)
        a["states"] = self.states(p.pids)
        if a["save"]["rc"] == 0:  # not expected: the lock got through; bring the pair back before going on
            a["resume"] = self.cli("--action", "resume", "--pid", p.pidlist, "--json")
        a["rank1_start"] = p.ask_one(1, "ar_start 64 1")
        a["wait"] = p.ask("ar_wait")
        a["ar"] = p.ask("ar 3")
        a["ok"] = (a["save"]["rc"] == 1 and "rolled back" in a["save"]["stderr"]
                   and all(s == "running" for s in a["states"].values()) and oks(a["wait"]) and oks(a["ar"]))
        self.save()
        # (b) both ranks in a queue of 1 GiB all-reduces, longer than the lock timeout
        bw = self.results.get("bisect", {}).get("combos", {}).get(self.safe_combo(), {})
        per_gib = (1 << 30) / max(self.bw_at(bw) * 1e9, 1e8)
        n = max(2, min(60, int(8.0 / per_gib) + 1))
        b: dict[str, Any] = {"n": n, "est_s": round(n * per_gib, 2)}
        res["both_in_a_queue"] = b
        b["start"] = p.ask(f"ar_start 1024 {n}")
        time.sleep(0.3)
        b["save"] = self.cli("--action", "save", "--pid", p.pidlist, "--timeout", "3000", "--json", timeout=60)
        b["states"] = self.states(p.pids)
        if b["save"]["rc"] == 0:  # the queue drained within the timeout: a normal save; bring it back
            b["resume"] = self.cli("--action", "resume", "--pid", p.pidlist, "--json")
        b["wait"] = p.ask("ar_wait", timeout=180)
        b["ar"] = p.ask("ar 3")
        b["states_end"] = self.states(p.pids)
        b["ok"] = (all(s == "running" for s in b["states_end"].values()) and oks(b["wait"]) and oks(b["ar"]))
        # and the pair still saves and resumes
        res["save_after"] = self.cli("--action", "save", "--pid", p.pidlist, "--json")
        res["resume_after"] = self.cli("--action", "resume", "--pid", p.pidlist, "--json")
        res["ar_after"] = p.ask("ar 3")

    def pytest(self) -> None:
        res: dict[str, Any] = {}
        self.results["pytest"] = res
        if self.dry:
            res["skipped"] = "--dry"
            return
        cmd = [sys.executable, "-m", "pytest", "tests/gpu/test_two_gpus_gpu.py", "-v", "-p", "no:cacheprovider",
               "--timeout", "200"]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(60, self.left() - 100))
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            so = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, text = -9, f"timed out\n{so}"
        (self.out / "pytest-gpu.log").write_text(str(text))
        res.update(cmd=shlex.join(cmd), rc=rc, s=round(time.monotonic() - t0, 1),
                   summary=[ln for ln in str(text).splitlines() if "passed" in ln or "failed" in ln][-3:])

    def criu(self) -> None:
        """The two smallest capturable sets (the agent's NCCL_SAFE_ENVS), one tree each."""
        self.results["criu"] = {}
        for name, combo, extra, dump in CRIU_VARIANTS:
            res: dict[str, Any] = {}
            self.results["criu"][name] = res
            try:
                self.criu_one(name, combo, extra, dump, res)
            except Exception:
                res["error"] = traceback.format_exc()
                self.say(res["error"])
            self.save()

    def tcp_sockets(self) -> list[str]:
        """Every TCP socket of the machine as "local_port state uid inode" (from /proc/net/tcp{,6}: the
        machine has no ss), to name what holds a port a restore cannot bind."""
        out = []
        for f in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError):
                for ln in Path(f).read_text().splitlines()[1:]:
                    c = ln.split()
                    port, st = int(c[1].split(":")[1], 16), int(c[3], 16)
                    out.append(f"{port} {TCP_STATES.get(st, str(st))} uid={c[7]} inode={c[9]}")
        return sorted(out, key=lambda x: int(x.split()[0]))

    def io_uring(self, pids: list[int]) -> dict[str, int]:
        """io_uring instances each process holds (descriptors and mappings), as CRIU would find them."""
        out = {}
        for pid in pids:
            n = 0
            with contextlib.suppress(OSError):
                n += sum(os.readlink(f) == "anon_inode:[io_uring]" for f in Path(f"/proc/{pid}/fd").iterdir())
                n += Path(f"/proc/{pid}/maps").read_text().count("anon_inode:[io_uring]")
            out[str(pid)] = n
        return out

    def criu_one(self, name: str, combo: str, extra: dict[str, str], dump_it: bool, res: dict[str, Any]) -> None:
        bundle = ROOT / ".device" / "criu"
        if not (bundle / "criu").exists():
            res["skipped"] = "no .device/criu carried"
            return
        res["combo"], res["env"] = combo, {**combo_env(combo), **extra}
        # CRIU's CUDA plugin execs cuda-checkpoint from PATH (an absolute entry: criu changes directory)
        env = {**os.environ, "LD_LIBRARY_PATH": str(bundle / "lib"),
               "PATH": f"{Path(self.bin).resolve().parent}:{os.environ['PATH']}"}
        base = [str(bundle / "criu")]
        plug = ["--libdir", str(bundle / "plugins")]
        # the ranks talk over loopback TCP (NCCL's bootstrap and socket transport, PyTorch's store): every
        # end is in the tree; no iptables/nftables in the machine, and nothing outside can send to it
        opts = ["--tcp-established", "--network-lock", "skip", "--file-locks", "--ext-unix-sk", "-v4"]
        p = self.start(f"criu-{name}", res["env"], (1024, 1024), launch=True)
        assert p.root is not None
        if not p.wait_ready():
            res["error"] = "ranks not ready"
            return
        root = p.root.pid
        res["pids"] = {"root": root, "ranks": p.pids}
        res["io_uring"] = self.io_uring([root, *p.pids])
        res["tcp_before"] = self.tcp_sockets()
        if not dump_it:
            p.kill()
            return
        res["ar_before"] = p.ask("ar 3")
        res["check_before"] = p.ask("check")
        res["smi_before"] = self.smi()
        img = self.work / f"criu-img-{name}"
        img.mkdir()
        dump = [*base, "dump", "-t", str(root), "-D", str(img), *opts, "--ghost-limit", str(1 << 30), "-o", "dump.log",
                *plug]
        t0 = time.monotonic()
        d = subprocess.run(dump, env=env, capture_output=True, text=True, timeout=300)
        res["dump"] = {"cmd": shlex.join(dump), "rc": d.returncode, "s": round(time.monotonic() - t0, 2),
                       "stderr": d.stderr[-2000:]}
        self.say(f"$ {shlex.join(dump)} -> rc={d.returncode} {res['dump']['s']} s")
        if d.returncode == 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.root.wait(timeout=30)  # reap the dumped root: its pid must be free for the restore
            for pid in [root, *p.pids]:
                for _ in range(100):
                    if not Path(f"/proc/{pid}").exists():
                        break
                    time.sleep(0.1)
        res["smi_dumped"] = self.smi()
        res["images"] = {"bytes": sum(f.stat().st_size for f in img.iterdir() if f.is_file()),
                         "core": {str(pid): (img / f"core-{pid}.img").exists() for pid in [root, *p.pids]}}
        if d.returncode == 0:
            restore = [*base, "restore", "-D", str(img), "-d", *opts, "-o", "restore.log", *plug]
            t0 = time.monotonic()
            r = subprocess.run(restore, env=env, capture_output=True, text=True, timeout=300)
            res["restore"] = {"cmd": shlex.join(restore), "rc": r.returncode, "s": round(time.monotonic() - t0, 2),
                              "stderr": r.stderr[-2000:]}
            self.say(f"$ {shlex.join(restore)} -> rc={r.returncode} {res['restore']['s']} s")
            if r.returncode != 0:
                # The run before found a listening port of rank 0 taken at restore, also 5 s later: what
                # holds it (a connection NCCL closed before the dump, left in FIN_WAIT2/TIME_WAIT, lives
                # on in the kernel for 60 s); then once more after those 60 s.
                res["tcp_at_failed_restore"] = self.tcp_sockets()
                (img / "restore.log").rename(img / "restore-first.log")
                time.sleep(65)
                res["tcp_65s_later"] = self.tcp_sockets()
                t0 = time.monotonic()
                r = subprocess.run(restore, env=env, capture_output=True, text=True, timeout=300)
                res["restore_retry_65s"] = {"rc": r.returncode, "s": round(time.monotonic() - t0, 2),
                                            "stderr": r.stderr[-2000:]}
                self.say(f"$ (65 s later, again) -> rc={r.returncode}")
            if r.returncode == 0:
                res["states"] = self.states(p.pids)
                res["smi_restored"] = self.smi()
                res["placement"] = self.placement(p, res["smi_restored"])
                res["ar_after"] = p.ask("ar 3", timeout=120)
                res["check_after"] = p.ask("check", timeout=120)
                res["ok"] = oks(res["ar_after"]) and oks(res["check_after"])
        else:
            res["states_after_failed_dump"] = self.states(p.pids)
        with (self.out / "criu.log").open("a") as f:
            for log in ("dump.log", "restore-first.log", "restore.log"):
                path = img / log
                if path.exists():
                    lines = path.read_text(errors="replace").splitlines()
                    keep = [ln for ln in lines if re.search(r"cuda|error|warn|tcp|Error", ln, re.I)]
                    f.write(f"===== {name} {log}: {len(lines)} lines; cuda/error/warn/tcp lines, then the last 30\n")
                    f.write("\n".join(keep[-300:]) + "\n----- tail\n" + "\n".join(lines[-30:]) + "\n")
        p.kill()

    def cleanup(self) -> None:
        for p in self.pairs:
            p.kill()
        with (self.out / "ranks.log").open("w") as f:
            for p in self.pairs:
                for lg in p.logs:
                    try:
                        lines = [ln for ln in lg.read_text(errors="replace").splitlines() if "NCCL INFO" not in ln]
                    except OSError:
                        continue
                    f.write(f"===== {p.name}/{lg.name}\n" + "\n".join(lines[-60:]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/dynsnap-two-gpu")
    ap.add_argument("--phases", default="bisect,loop,swap,busy,pytest,criu,defaults")
    ap.add_argument("--budget", type=float, default=500)
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args()
    d = Driver(a)
    d.env_facts()
    # rough seconds each needs, so one that cannot finish is not started; the defaults phase (the
    # issue's failing case, last so that it cannot disturb the others) keeps its time in reserve
    need = {"bisect": 120, "bwcmp": 60, "loop": 70, "swap": 30, "busy": 40, "pytest": 100, "criu": 100,
            "defaults": 75}
    phases = {"bisect": d.bisect, "bwcmp": d.bwcmp, "loop": d.loop, "swap": d.swap, "busy": d.busy,
              "pytest": d.pytest, "criu": d.criu, "defaults": d.defaults}
    names = a.phases.split(",")
    reserve = need["defaults"] if "defaults" in names else 0
    try:
        for name in names:
            if name in ("pytest", "criu", "defaults") and d.loop_pair is not None:
                d.stop(d.loop_pair)  # the GPUs empty again for what follows
                d.loop_pair = None
            d.phase(name, need[name] + (0 if name == "defaults" else reserve), phases[name])
    finally:
        d.cleanup()
        d.results["total_s"] = round(time.monotonic() - d.t0, 1)
        d.save()
        d.say(f"done in {d.results['total_s']} s")


if __name__ == "__main__":
    main()
