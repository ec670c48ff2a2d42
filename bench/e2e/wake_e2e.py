"""End to end, from the wake request to the first pinned answer: a Dynamo frontend and one Dynamo
worker (bench/e2e/engine.py, a PyTorch model of ``--gib`` GiB on ``--device``) on this machine, the
worker put to sleep by ``dynsnap agent exec ... capture`` (tier suspend) and woken by ``dynsnap agent
exec ... wake``; the clock runs from the wake request until a chat request pinned to that worker
(``x-dynamo-worker-instance-id``) is answered 200 by it. Beside it, the cold start of the same worker
(the same command started fresh, weights from local disk) until its first pinned answer.

The worker runs the way a worker container does and the way bench/gpu/agent_h200.sh and
tests/native/test_agent_exec.py run theirs: dynsnap-entrypoint as PID 1 of its own pid + mount
namespace, its control directory on a tmpfs only that namespace sees, only stdio open. Discovery is
Dynamo's file backend (``DYN_DISCOVERY_BACKEND=file``, ``DYN_FILE_KV``): no etcd, no Kubernetes, on
the GPU machine as here. Its registrations are leases the worker's runtime keeps renewing; a
suspended worker's process keeps running (only its CUDA calls would block), so it stays registered:
``--asleep-s 60`` shows it (a CRIU-frozen one lost its lease in ~10 s, shared/TESTENV.md).

The pinned requests start when ``exec wake`` has returned with the worker Active, not before: in the
product the frontend is sent to the worker only once the agent reports it serving (the readiness
gate), and against the stub driver the CPU engine never blocks, so a request sent during the wake
would be answered before it and measure nothing. The clock still covers all of it: the wake
request (the exec's start, its own Python start-up included) to the answer. Each cycle's line also
gives the exec's own figure (``wake_agent_s``: the executor's steps, without the exec process's
start-up) and the answer alone (``answer_after_exec_s``), and ``awake_answer_s``: the same pinned
request while the worker was awake, so the wake's overhead reads as the difference.

``--on-request`` measures the wake on request of issue 20 instead: once the worker sleeps, one
chat request pinned to it is sent and held by the sleeping worker (its CUDA calls block); the
worker's own in-flight gauge on its system port is read every 50 ms, as the agent's edge does
(dynsnap/agent/edge.py, ``routable_poll_interval``), and the moment it shows the request the wake
is run; the clock runs from the request's send to its answer (``first_answer_s``), beside the
detection (``seen_s``), the wake (``wake_exec_s``) and the same request answered while awake.

Locally the CUDA driver is the project's stub (tests/native/stub_libcuda; the worker maps it through
LD_PRELOAD, so the agent sees a GPU process and dynsnap-cuda's save/resume run against it);
``--real-driver`` on the GPU machine skips it. Every wait is bounded by count and time.

Output: one JSON line per cycle (``kind: wake``), one for the cold start (``kind: cold``) and a
``kind: summary`` line, to ``--out`` and stdout. Exit 0 when every wake and the cold start ended with
the worker answering pinned requests, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "bench" / "e2e" / "engine.py"
NATIVE = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
HEADER = "x-dynamo-worker-instance-id"  # decimal: dynsnap.models.protocol.HEADER_WORKER_INSTANCE_ID
MODEL = "tiny"
PROMPT = "Wake up and answer."
CLOSE_FDS = "import os, sys; os.closerange(3, 65536); os.execvp(sys.argv[1], sys.argv[1:])"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A port free now, below 32768: Dynamo reads DYN_SYSTEM_PORT as an i16, and the kernel's own
    picks (port 0) come from the ephemeral range above it."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000 after 200 tries")


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"({path}: {e})"


@dataclass
class Answer:
    status: int  # 0: no HTTP answer (refused, reset, timed out)
    worker_id: int | None
    text: str
    seconds: float
    error: str = ""


def chat(base: str, worker_id: int | None, *, max_tokens: int, timeout: float) -> Answer:
    """One chat completion through the frontend, pinned to ``worker_id`` when given."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "stream": False, "nvext": {"extra_fields": ["worker_id"]}}
    headers = {"Content-Type": "application/json"}
    if worker_id is not None:
        headers[HEADER] = str(worker_id)
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        return Answer(e.code, None, "", time.monotonic() - t, e.read()[:300].decode(errors="replace"))
    except (OSError, urllib.error.URLError) as e:
        return Answer(0, None, "", time.monotonic() - t, str(e)[:300])
    seconds = time.monotonic() - t
    try:
        data = json.loads(raw)
        wid = data.get("nvext", {}).get("worker_id")
        wid = wid.get("decode_worker_id", wid.get("worker_id")) if isinstance(wid, dict) else wid
        text = data["choices"][0]["message"]["content"] or ""
        return Answer(status, int(wid) if wid is not None else None, text, seconds)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        return Answer(status, None, "", seconds, f"unreadable answer ({e}): {raw[:300]!r}")


@dataclass
class Pinned:
    answer: Answer | None  # the first 200 from the worker, or None
    attempts: int
    seconds: float  # from ``since`` to that answer (or to giving up)
    last: Answer | None  # the last failed attempt, for the record


def first_pinned_answer(base: str, worker_id: int, *, since: float, max_tokens: int, limit_s: float,
                        max_attempts: int = 2000, request_timeout: float = 60.0) -> Pinned:
    """Pinned requests, one after another, until one is answered 200 by ``worker_id``; bounded by
    ``max_attempts`` and by ``limit_s`` after ``since``."""
    last: Answer | None = None
    for attempt in range(1, max_attempts + 1):
        left = since + limit_s - time.monotonic()
        if left <= 0:
            return Pinned(None, attempt - 1, time.monotonic() - since, last)
        a = chat(base, worker_id, max_tokens=max_tokens, timeout=min(left, request_timeout))
        if a.status == 200 and a.worker_id == worker_id:
            return Pinned(a, attempt, time.monotonic() - since, last)
        last = a
        time.sleep(0.05)  # a refused or 404 answer comes back at once: do not spin the frontend
    return Pinned(None, max_attempts, time.monotonic() - since, last)


def wait_for(what: str, probe: Any, *, limit_s: float, every: float = 0.1) -> Any:
    """``probe()`` until it returns something truthy; bounded by ``limit_s`` (and so by count)."""
    for _ in range(int(limit_s / every) + 1):
        v = probe()
        if v:
            return v
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {limit_s:.0f} s")


class Frontend:
    """``python -m dynamo.frontend`` on 127.0.0.1, file discovery."""

    def __init__(self, work: Path, python: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = work / "frontend.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(self.port)],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=work)

    def up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the frontend exited ({self.proc.returncode}):\n{tail(self.log)}")
        try:
            with urllib.request.urlopen(f"{self.base}/v1/models", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def model_listed(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/v1/models", timeout=5) as r:
                return any(m.get("id") == MODEL for m in json.loads(r.read()).get("data", []))
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the group is ours
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Container:
    """The worker under dynsnap-entrypoint as PID 1 of its own pid + mount namespace, its control
    directory on a tmpfs (an emptyDir) only that namespace sees, only stdio open (as a runtime starts
    a container), as bench/gpu/agent_h200.sh and tests/native/test_agent_exec.py do."""

    def __init__(self, work: Path, name: str, engine_argv: list[str], env: dict[str, str], preload: str | None) -> None:
        self.uid = str(uuid.uuid4())
        self.id_file = work / f"{name}.id.json"
        self.id_file.unlink(missing_ok=True)
        self.log = work / f"{name}.container.log"
        self.saved_log = work / f"{name}.worker.log"
        self.probe_port, system_port = free_port(), free_port()
        self.system_url = f"http://127.0.0.1:{system_port}"  # tier engine's routes (the worker's system port)
        env = {**env, "DYN_SYSTEM_PORT": str(system_port)}  # the worker's /live and /health, behind the entrypoint
        pre = f"LD_PRELOAD={shlex.quote(preload)} " if preload else ""
        worker = shlex.join([*engine_argv, "--id-file", str(self.id_file)])
        inner = (f"mkdir -p /run/dynsnap && mount -t tmpfs emptydir /run/dynsnap && "
                 f"{pre}exec {shlex.quote(sys.executable)} -c {shlex.quote(CLOSE_FDS)} "
                 f"{shlex.quote(str(NATIVE / 'dynsnap-entrypoint'))} --control-dir /run/dynsnap "
                 f"--system-port {system_port} --probe-port {self.probe_port} -- {worker}")
        self.t_start = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--propagation", "private",
                 "--", "sh", "-c", inner],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                close_fds=True)
        self.entrypoint = int(wait_for("the entrypoint", self._entrypoint, limit_s=30))

    def _entrypoint(self) -> int | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the container exited ({self.proc.returncode}):\n{tail(self.log)}")
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        if kids and Path(f"/proc/{kids[0]}/root/run/dynsnap/entrypoint.json").exists():
            return int(kids[0])
        return None

    def control(self) -> dict[str, Any]:
        try:
            info: dict[str, Any] = json.loads(Path(f"/proc/{self.entrypoint}/root/run/dynsnap/entrypoint.json")
                                              .read_text())
            return info
        except (OSError, ValueError):
            return {}

    def worker_log(self) -> str:
        return tail(Path(f"/proc/{self.entrypoint}/root/run/dynsnap/worker.log"), 40)

    def instance(self, limit_s: float) -> dict[str, Any]:
        """The worker's id file once it registered: instance_id, its host pid, its weights' load time."""
        def read() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the container exited ({self.proc.returncode}):\n{tail(self.log)}\n"
                                   f"{self.worker_log()}")
            try:
                d: dict[str, Any] = json.loads(self.id_file.read_text())
                return d
            except (OSError, ValueError):
                return None
        got: dict[str, Any] = wait_for("the worker's registration", read, limit_s=limit_s, every=0.05)
        return got

    def stop(self) -> None:
        # The worker's log is on the namespace's tmpfs: keep a copy before it goes.
        with contextlib.suppress(OSError):
            self.saved_log.write_bytes(Path(f"/proc/{self.entrypoint}/root/run/dynsnap/worker.log").read_bytes())
        # unshare --kill-child: the entrypoint (PID 1 of the namespace) and with it every process in it go
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class Gpu:
    """What says the worker is asleep: the stub driver's per-process state here, NVML's memory on the GPU."""

    def __init__(self, stub: Any | None) -> None:
        self.stub = stub

    def snapshot(self) -> dict[str, Any]:
        if self.stub is not None:
            return {"stub_states": sorted(set(self.stub.states().values()))}
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        used = [int(x) for x in r.stdout.split()] if r.returncode == 0 else []
        return {"used_mib": used}

    def asleep(self, before: dict[str, Any], now: dict[str, Any], gib: float) -> bool:
        if self.stub is not None:
            return 2 in now["stub_states"]  # checkpointed
        if not before.get("used_mib") or not now.get("used_mib"):
            return False
        # the checkpoint gave the worker's memory back: at least 90 % of its weights
        return bool(before["used_mib"][0] - now["used_mib"][0] >= 0.9 * gib * 1024)

    def running(self, now: dict[str, Any], before: dict[str, Any], gib: float) -> bool:
        if self.stub is not None:
            return bool(now["stub_states"]) and set(now["stub_states"]) == {0}
        return bool(now.get("used_mib")) and now["used_mib"][0] >= before["used_mib"][0] - 0.1 * gib * 1024


@dataclass
class Agent:
    work: Path
    python: str
    env: dict[str, str]
    cuda_env: dict[str, str]
    criu: str | None
    tier: str = "suspend"
    # bench/e2e/resident_agent.py, started once (a node agent's process): None runs `agent exec` per action
    resident: subprocess.Popen[str] | None = None

    def settings(self) -> dict[str, Any]:
        """The agent's settings, the same for `agent exec` (as flags) and the resident agent (as JSON)."""
        return {"images_root": str(self.work / "images"), "state_dir": str(self.work / "state"),
                "cuda_helper": str(NATIVE / "dynsnap-cuda"), "nsexec": str(NATIVE / "dynsnap-nsexec"),
                "tcp_established": False, "network_lock": "",
                "cuda_env": self.cuda_env, **({"criu": self.criu} if self.criu else {})}

    def start_resident(self) -> None:
        with open(self.work / "agent.log", "a") as log_file:  # the child keeps its own descriptor
            self.resident = subprocess.Popen(
                [self.python, str(ROOT / "bench" / "e2e" / "resident_agent.py"), json.dumps(self.settings())],
                env=self.env, cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file)

    def stop_resident(self) -> None:
        if self.resident is not None:
            with contextlib.suppress(OSError):
                self.resident.stdin.close()  # type: ignore[union-attr]
            try:
                self.resident.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.resident.kill()
                self.resident.wait(timeout=30)
            self.resident = None

    def _resident_exec(self, action: str, c: Container) -> tuple[int, list[dict[str, Any]], float]:
        assert self.resident is not None and self.resident.stdin and self.resident.stdout
        t = time.monotonic()
        self.resident.stdin.write(json.dumps({"action": action, "uid": c.uid, "entrypoint": c.entrypoint,
                                              "tier": self.tier, "system_url": c.system_url}) + "\n")
        self.resident.stdin.flush()
        lines: list[dict[str, Any]] = []
        done = None
        for _ in range(1000):  # an action is a few dozen lines; EOF ends it too
            raw = self.resident.stdout.readline()
            if not raw:
                break
            if raw.startswith("{"):
                rec = json.loads(raw)
                if "resident_done" in rec:
                    done = rec["resident_done"]
                    break
                lines.append(rec)
        seconds = time.monotonic() - t
        with open(self.work / "agent.log", "a") as f:
            f.write(f"== resident {action} ok={done} {seconds:.3f}s\n" + "".join(json.dumps(x) + "\n" for x in lines))
        return (0 if done else 1), lines, seconds

    def exec(self, action: str, c: Container) -> tuple[int, list[dict[str, Any]], float]:
        if self.resident is not None:
            return self._resident_exec(action, c)
        argv = [self.python, "-m", "dynsnap", "agent"]
        for name, value in self.settings().items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, dict):
                argv += [a for k, v in value.items() for a in (flag, f"{k}={v}")]
            else:
                argv += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
        argv += ["exec", action, "--pod-uid", c.uid, "--entrypoint-pid", str(c.entrypoint), "--tier", self.tier,
                 "--system-url", c.system_url]
        if action == "capture":
            argv.append("--quiesced")
        t = time.monotonic()
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        seconds = time.monotonic() - t
        lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        with open(self.work / "agent.log", "a") as f:
            f.write(f"== {action} rc={r.returncode} {seconds:.3f}s\n{r.stdout}{r.stderr[-4000:]}\n")
        return r.returncode, lines, seconds


def anon_huge_kib(entrypoint: int | None) -> int | None:
    """AnonHugePages of the processes under the entrypoint: while a worker is suspended, the driver's host
    copy of its GPU memory, on huge pages when libdynsnap-thp got them (a restore from 4 KiB pages is slower)."""
    if entrypoint is None:
        return None
    total = 0
    try:
        kids = Path(f"/proc/{entrypoint}/task/{entrypoint}/children").read_text().split()
        for pid in kids[:64]:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("AnonHugePages:"):
                    total += int(line.split()[1])
    except (OSError, ValueError):
        return None
    return total


def host_memory(entrypoint: int | None) -> dict[str, int | None]:
    """Host memory the worker holds (VmRSS of every process under the entrypoint: the driver's host copy of
    its GPU memory while suspended, the engine's pinned copy of its weights while the engine sleeps) and
    the machine's MemAvailable, bytes."""
    rss: int | None = None
    if entrypoint is not None:
        rss = 0
        try:
            for pid in Path(f"/proc/{entrypoint}/task/{entrypoint}/children").read_text().split()[:64]:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            rss = None
    avail = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        avail = next(int(x.split()[1]) * 1024 for x in Path("/proc/meminfo").read_text().splitlines()
                     if x.startswith("MemAvailable:"))
    return {"worker_rss_bytes": rss, "mem_available_bytes": avail}


def lease_age(work: Path, instance_id: int) -> float | None:
    """Seconds since the worker's runtime last renewed its registration: the file backend keeps one
    file per instance (``kv/v1/instances/<namespace>%2F<component>%2F<endpoint>%2F<id hex>``) and
    rewrites it every few seconds; a reader drops an instance whose file went stale (a SIGSTOPped
    worker here was gone from the frontend within 10 s and answered 404 ever after). None: no file."""
    for f in (work / "kv" / "v1" / "instances").glob(f"*%2F{instance_id:x}"):
        with contextlib.suppress(OSError):
            return round(time.time() - f.stat().st_mtime, 2)
    return None


EDGE_POLL_S = 0.05  # the agent's routable_poll_interval (dynsnap/agent/settings.py)


def inflight(system_url: str) -> int | None:
    """The worker's in-flight gauge on its system port, read as the agent's edge reads it (main()
    imports the agent's parser before the first cycle: its import is no part of a detection)."""
    from dynsnap.agent.idle import MetricsUnavailable, parse_metrics  # the agent's own parsing

    try:
        with urllib.request.urlopen(f"{system_url}/metrics", timeout=2.0) as r:
            return parse_metrics(r.read().decode(errors="replace")).inflight
    except (OSError, urllib.error.URLError, MetricsUnavailable):
        return None


def wake_on_request(base: str, c: Container, agent: Agent, wid: int, *, max_tokens: int, limit_s: float
                    ) -> dict[str, Any]:
    """One request pinned to the sleeping worker; the wake run the moment its gauge shows it (polled
    every EDGE_POLL_S, as the edge does); the request's own time to its answer."""
    got: dict[str, Any] = {}
    t0 = time.monotonic()

    def send() -> None:
        got["answer"] = chat(base, wid, max_tokens=max_tokens, timeout=limit_s)
        got["at"] = time.monotonic()
    th = threading.Thread(target=send, daemon=True)
    th.start()
    seen = None
    polls = 0
    while time.monotonic() - t0 < limit_s and polls < int(limit_s / EDGE_POLL_S) + 1 and "answer" not in got:
        polls += 1
        if (inflight(c.system_url) or 0) > 0:
            seen = time.monotonic() - t0
            break
        time.sleep(EDGE_POLL_S)
    wrc, wlines, wake_exec_s = agent.exec("wake", c) if seen is not None else (None, [], 0.0)
    th.join(timeout=max(limit_s - (time.monotonic() - t0), 1.0))
    a: Answer | None = got.get("answer")
    return {"seen_s": round(seen, 4) if seen is not None else None, "polls": polls, "wake_rc": wrc,
            "wake_lines": wlines, "wake_exec_s": round(wake_exec_s, 4), "answer": a,
            "first_answer_s": round(got["at"] - t0, 4) if "at" in got else None,
            "answered_before_wake": seen is None and a is not None}


def emit(out: TextIO, rec: dict[str, Any]) -> None:
    line = json.dumps(rec)
    out.write(line + "\n")
    out.flush()
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="the engine's torch device: cuda (default) or cpu")
    p.add_argument("--gib", type=float, default=1.0, help="the engine's weights, GiB (default 1)")
    p.add_argument("--kv-gib", type=float, default=0.0,
                   help="the engine's KV pool, GiB, allocated and never written (default 0: none)")
    p.add_argument("--stub-engine", action="store_true",
                   help="the stand-in engine (dynsnap.testenv.stub_engine, no torch) instead of engine.py: a local "
                        "dry run of the protocol on the stub driver, no figure")
    p.add_argument("--tier", choices=["suspend", "engine"], default="suspend",
                   help="suspend: the driver's checkpoint; engine: the engine's own sleep routes (default suspend)")
    p.add_argument("--cycles", type=int, default=3, help="capture + wake cycles (default 3)")
    p.add_argument("--asleep-s", default="0",
                   help="seconds each cycle stays asleep before the wake: one value for every cycle, or a comma "
                   "list, one per cycle, the last repeated (default 0; 60 shows the file discovery lease "
                   "survives a suspend)")
    p.add_argument("--out", type=Path, default=Path("wake_e2e.jsonl"), help="JSON lines (default ./wake_e2e.jsonl)")
    p.add_argument("--work", type=Path, default=Path("/tmp/dynsnap-e2e"), help="scratch (default /tmp/dynsnap-e2e)")
    p.add_argument("--real-driver", action="store_true", help="the machine's CUDA driver (GPU machine), no stub")
    p.add_argument("--dynamo-python", default=os.environ.get("DYNSNAP_DYNAMO_PYTHON", "python3"),
                   help="python with Dynamo for the frontend and the worker (default $DYNSNAP_DYNAMO_PYTHON)")
    p.add_argument("--dynamo-pythonpath", default=os.environ.get("DYNSNAP_E2E_DYNAMO_PYTHONPATH", ""),
                   help="PYTHONPATH for the frontend and the worker (the GPU machine's Dynamo install)")
    p.add_argument("--torch-pythonpath", default=os.environ.get("DYNSNAP_E2E_TORCH", ""),
                   help="PYTHONPATH entry with torch, for the worker only (here: the CPU torch's target "
                   "directory, bench/e2e/README.md)")
    p.add_argument("--model-dir", default=os.environ.get("DYNSNAP_MODEL_DIR", ""),
                   help="model directory with the tokenizer (default $DYNSNAP_MODEL_DIR)")
    p.add_argument("--criu", help="CRIU for the agent (not used by tier suspend)")
    p.add_argument("--resident-agent", action="store_true",
                   help="one agent process for every action (bench/e2e/resident_agent.py, as a node agent runs) "
                   "instead of a `dynsnap agent exec` per action, whose Python start-up is then not in the clock")
    p.add_argument("--on-request", action="store_true",
                   help="wake on request (issue 20): the sleeping worker woken when its gauge shows a request; "
                        "the clock from that request's send to its answer")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per pinned answer (default 8)")
    p.add_argument("--threads", type=int, default=0, help="the engine's torch CPU threads (0: torch's default)")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before the first cold start (its weights then come from the disk)")
    p.add_argument("--cold-reps", type=int, default=1,
                   help="cold starts after the cycles (default 1; the later ones from a warm page cache)")
    p.add_argument("--answer-limit-s", type=float, default=180.0,
                   help="bound on the wait for a pinned answer after a wake or a cold start (default 180)")
    p.add_argument("--start-limit-s", type=float, default=600.0,
                   help="bound on a worker's start until it registered (default 600)")
    args = p.parse_args(argv)
    try:
        asleep_plan = [float(x) for x in str(args.asleep_s).split(",")]
    except ValueError:
        p.error(f"--asleep-s {args.asleep_s!r}: seconds, or a comma list of them")
    if not args.model_dir:
        p.error("--model-dir (or $DYNSNAP_MODEL_DIR) is required")
    for tool in ("dynsnap-entrypoint", "dynsnap-cuda"):
        if not (NATIVE / tool).exists():
            p.error(f"{NATIVE / tool} is missing: make -C native")

    work: Path = args.work
    subprocess.run(["rm", "-rf", str(work / "kv"), str(work / "images"), str(work / "state")], check=True)
    (work / "kv").mkdir(parents=True)
    (work / "agent.log").unlink(missing_ok=True)

    stub = None
    cuda_env: dict[str, str] = {}
    preload = None
    if not args.real_driver:
        # Imported only here: the GPU machine's python3 runs this file without the dev venv.
        from dynsnap.testenv.dynsnap_parts import build_stub_driver

        subprocess.run(["rm", "-rf", str(work / "stub")], check=True)
        stub = build_stub_driver(work / "stub")
        cuda_env = stub.env()
        preload = str(stub.libcuda)
    gpu = Gpu(stub)

    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    dyn_env = {**base_env, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(work / "kv"),
               "PYTHONUNBUFFERED": "1"}
    if args.dynamo_pythonpath:
        dyn_env["PYTHONPATH"] = args.dynamo_pythonpath
    worker_env = dict(dyn_env)
    # Dynamo's packages ahead of torch's, as on the GPU machine (PYTHONPATH ahead of its site-packages)
    worker_env["PYTHONPATH"] = ":".join(x for x in (args.dynamo_pythonpath, args.torch_pythonpath) if x)
    if stub is not None:
        worker_env.update(cuda_env)
    agent_env = {**os.environ, "PYTHONPATH": ":".join(x for x in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if x)}
    agent = Agent(work, sys.executable, agent_env, cuda_env, args.criu, tier=args.tier)
    agent_mode = "resident" if args.resident_agent else "exec"
    if args.resident_agent:
        agent.start_resident()

    weights = work / f"weights-{args.gib:g}gib-{args.device}.pt"
    engine = [args.dynamo_python, str(ENGINE), "--gib", f"{args.gib:g}", "--device", args.device,
              "--model-path", args.model_dir, "--max-tokens", str(args.max_tokens), "--weights", str(weights),
              *(["--kv-gib", f"{args.kv_gib:g}"] if args.kv_gib else [])]
    if args.threads:
        engine += ["--threads", str(args.threads)]
    if args.stub_engine:  # the stand-in engine (dynsnap/testenv/stub_engine.py): the protocol, without torch
        engine = [args.dynamo_python, "-m", "dynsnap.testenv.stub_engine", "--discovery-backend", "file",
                  "--model-path", args.model_dir, "--max-tokens", str(args.max_tokens), "--gib", f"{args.gib:g}",
                  "--kv-gib", f"{args.kv_gib:g}"]
        worker_env["PYTHONPATH"] = ":".join(x for x in (args.dynamo_pythonpath, str(ROOT)) if x)
    elif not weights.exists():
        log(f"writing the weights ({args.gib:g} GiB) to {weights}")
        subprocess.run([*engine[:2], "--gib", f"{args.gib:g}", "--device", args.device, "--write-weights",
                        str(weights)], env=worker_env, check=True, timeout=1800)

    if args.on_request:
        import dynsnap.agent.idle  # noqa: F401  (warm: on 2026-12-01 the first detection carried its ~0.2 s)
    ok = True
    fe: Frontend | None = None
    c: Container | None = None
    wakes: list[float] = []
    texts: set[str] = set()
    with open(args.out, "w") as out:
        try:
            fe = Frontend(work, args.dynamo_python, dyn_env)
            wait_for("the frontend", fe.up, limit_s=120, every=0.2)
            log(f"frontend at {fe.base}")
            c = Container(work, "worker", engine, worker_env, preload)
            ident = c.instance(args.start_limit_s)
            wid = int(ident["instance_id"])
            first = first_pinned_answer(fe.base, wid, since=c.t_start, max_tokens=args.max_tokens,
                                        limit_s=args.start_limit_s)
            if first.answer is None:
                raise RuntimeError(f"worker {wid} never answered a pinned request: {first.last}\n{c.worker_log()}")
            log(f"worker {wid} (entrypoint {c.entrypoint}) answered {first.answer.text!r}, "
                f"{first.seconds:.2f} s after its start")
            reference = first.answer.text
            for cycle in range(1, args.cycles + 1):
                awake = chat(fe.base, wid, max_tokens=args.max_tokens, timeout=60)
                before = gpu.snapshot()
                mem_awake = host_memory(c.entrypoint)
                crc, clines, capture_s = agent.exec("capture", c)
                state = c.control().get("state")
                asleep_gpu = gpu.snapshot()
                huge_asleep = anon_huge_kib(c.entrypoint)
                mem_asleep = host_memory(c.entrypoint)
                # tier engine: the engine freed its memory, no process is checkpointed (the stub says running)
                # (the stub checkpoints nothing for tier engine: its memory check is the GPU's, on the H200)
                asleep = crc == 0 and state == "suspended" and (
                    gpu.asleep(before, asleep_gpu, args.gib) if args.tier == "suspend" or gpu.stub is None else True)
                if not asleep:
                    ok = False
                    emit(out, {"kind": "wake", "cycle": cycle, "error": "not asleep after capture", "capture_rc": crc,
                               "state": state, "gpu": asleep_gpu, "capture": clines[-3:]})
                    break
                slept = asleep_plan[min(cycle, len(asleep_plan)) - 1]
                if slept > 0:
                    time.sleep(slept)
                listed = fe.model_listed()  # still registered: the model is listed through this worker only
                lease = lease_age(work, wid)
                if args.on_request:
                    r = wake_on_request(fe.base, c, agent, wid, max_tokens=args.max_tokens,
                                        limit_s=args.answer_limit_s)
                    a = r["answer"]
                    answered = r["wake_rc"] == 0 and a is not None and a.status == 200 and a.worker_id == wid
                    ok = ok and answered
                    if answered:
                        wakes.append(r["first_answer_s"])
                        texts.add(a.text)
                    final = r["wake_lines"][-1] if r["wake_lines"] else {}
                    emit(out, {
                        "kind": "wake", "mode": "on-request", "cycle": cycle, "tier": args.tier, "gib": args.gib,
                        "kv_gib": args.kv_gib, "agent": agent_mode, "driver": "real" if args.real_driver else "stub",
                        "asleep_s": slept, "capture_s": round(capture_s, 4), "listed_while_asleep": listed,
                        "lease_age_s_while_asleep": lease, "seen_s": r["seen_s"], "polls": r["polls"],
                        "wake_rc": r["wake_rc"], "wake_exec_s": r["wake_exec_s"], "wake_agent_s": final.get("seconds"),
                        "wake_steps": {x["step"]: x.get("seconds") for x in r["wake_lines"] if "step" in x},
                        "first_answer_s": r["first_answer_s"], "answered_before_wake": r["answered_before_wake"],
                        "status": a.status if a else None, "worker_id": a.worker_id if a else None,
                        "expected_worker_id": wid, "text": a.text if a else None,
                        "text_same": (a.text == reference) if a else False,
                        "awake_answer_s": round(awake.seconds, 4) if awake.status == 200 else None,
                        "gpu_awake": before, "gpu_asleep": asleep_gpu, "gpu_after": gpu.snapshot()})
                    if not answered:
                        log(f"cycle {cycle}: the request was not answered by the woken worker: {r}\n{c.worker_log()}")
                        break
                    continue
                t0 = time.monotonic()
                wrc, wlines, wake_exec_s = agent.exec("wake", c)
                pinned = first_pinned_answer(fe.base, wid, since=t0, max_tokens=args.max_tokens,
                                             limit_s=args.answer_limit_s)
                after = gpu.snapshot()
                a = pinned.answer
                answered = wrc == 0 and a is not None
                ok = ok and answered
                if a is not None:
                    wakes.append(pinned.seconds)
                    texts.add(a.text)
                final = wlines[-1] if wlines else {}
                emit(out, {
                    "kind": "wake", "cycle": cycle, "tier": args.tier, "gib": args.gib, "kv_gib": args.kv_gib,
                    "device": args.device, "host_memory_awake": mem_awake, "host_memory_asleep": mem_asleep,
                    "agent": agent_mode,
                    "driver": "real" if args.real_driver else "stub", "asleep_s": slept,
                    "capture_s": round(capture_s, 4), "capture_agent_s": clines[-1].get("seconds") if clines else None,
                    "state_asleep": state, "gpu_awake": before, "gpu_asleep": asleep_gpu,
                    "listed_while_asleep": listed, "lease_age_s_while_asleep": lease,
                    "anon_huge_kib_asleep": huge_asleep,
                    "wake_rc": wrc, "wake_exec_s": round(wake_exec_s, 4), "wake_agent_s": final.get("seconds"),
                    "wake_steps": {s["step"]: s.get("seconds") for s in wlines if "step" in s},
                    "first_answer_s": round(pinned.seconds, 4),
                    "answer_after_exec_s": round(pinned.seconds - wake_exec_s, 4),
                    "attempts": pinned.attempts, "answer_s": round(a.seconds, 4) if a else None,
                    "awake_answer_s": round(awake.seconds, 4) if awake.status == 200 else None,
                    "worker_id": a.worker_id if a else None, "expected_worker_id": wid,
                    "text": a.text if a else None, "text_same": (a.text == reference) if a else False,
                    "state_after": c.control().get("state"), "gpu_running_after": gpu.running(after, before, args.gib),
                    "gpu_after": after, "last_failure": vars(pinned.last) if pinned.last and not a else None})
                if not answered:
                    log(f"cycle {cycle}: no pinned answer after the wake\n{c.worker_log()}")
                    break
            # Cold start of the same worker: the same command, fresh, weights from local disk.
            colds: list[float] = []
            for rep in range(1, args.cold_reps + 1):
                c.stop()
                c = None
                dropped = False
                if args.drop_caches and rep == 1:
                    subprocess.run(["sync"], check=False)
                    try:
                        Path("/proc/sys/vm/drop_caches").write_text("3\n")
                        dropped = True
                    except OSError as e:
                        log(f"cannot drop the page cache: {e}")
                c = Container(work, f"cold{rep}", engine, worker_env, preload)
                t0 = c.t_start
                ident = c.instance(args.start_limit_s)
                cold_id = int(ident["instance_id"])
                registered_s = time.monotonic() - t0
                pinned = first_pinned_answer(fe.base, cold_id, since=t0, max_tokens=args.max_tokens,
                                             limit_s=args.start_limit_s)
                a = pinned.answer
                ok = ok and a is not None
                if a is not None:
                    colds.append(pinned.seconds)
                    texts.add(a.text)
                emit(out, {"kind": "cold", "rep": rep, "gib": args.gib, "device": args.device,
                           "cache_dropped": dropped, "first_answer_s": round(pinned.seconds, 4),
                           "registered_s": round(registered_s, 4),
                           "weights_load_s": round(float(ident.get("loaded_s", 0.0)), 4),
                           "attempts": pinned.attempts, "worker_id": a.worker_id if a else None,
                           "expected_worker_id": cold_id, "text": a.text if a else None,
                           "text_same": (a.text == reference) if a else False,
                           "last_failure": vars(pinned.last) if pinned.last and not a else None})
            cold = colds[0] if colds else None
            med = statistics.median(wakes) if wakes else None
            emit(out, {"kind": "summary", "mode": "on-request" if args.on_request else "wake",
                       "gib": args.gib, "kv_gib": args.kv_gib, "tier": args.tier,
                       "device": args.device,
                       "driver": "real" if args.real_driver else "stub", "cycles": args.cycles,
                       "agent": agent_mode,
                       "answered": len(wakes), "wake_first_answer_s": [round(w, 4) for w in wakes],
                       "wake_median_s": round(med, 4) if med is not None else None,
                       "cold_first_answer_s": [round(x, 4) for x in colds],
                       "cold_over_wake": round(cold / med, 2) if cold and med else None,
                       "same_text_everywhere": texts <= {reference}, "ok": ok})
        except (RuntimeError, TimeoutError, subprocess.SubprocessError, OSError) as e:
            ok = False
            log(f"failed: {e}")
            if c is not None:
                log(f"worker log:\n{c.worker_log()}\ncontainer log:\n{tail(c.log)}")
            if fe is not None:
                log(f"frontend log:\n{tail(fe.log)}")
            emit(out, {"kind": "error", "error": str(e)[-2000:]})
        finally:
            agent.stop_resident()
            if c is not None:
                c.stop()
            if fe is not None:
                fe.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
