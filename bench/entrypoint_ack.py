"""Round-trip latency of one entrypoint state request (issue 12, wake speed): from the agent writing
``state-request`` to it reading the entrypoint's acknowledgement, through the agent's own
``EntrypointControl.request``. A wake is several of these in a row (``wake``, ``settle-active``),
a capture too (``quiesce``, ``settle-suspended``), so their fixed latency is part of every wake.

Starts ``dynsnap-entrypoint`` in a temporary control directory with a trivial worker (``sleep``),
as PID 1 of a fresh pid + mount namespace when run as root (as tests/native/test_entrypoint.py
does; outside one the entrypoint would write the host's ``ns_last_pid``), then times --n requests
cycling restoring -> active -> suspending -> suspended, with a random pause of up to --gap-ms
before each, so that a request lands at any point of the entrypoint's 100 ms tick, as it does in a
wake where other steps run between two requests. Prints the median and p90 (milliseconds), and the
control file's ``request_wakeup`` (absent before the inotify watch existed).

  python bench/entrypoint_ack.py [--entrypoint PATH] [--agent-module FILE] [--n 100] [--gap-ms 100]

--agent-module loads ``EntrypointControl`` from another copy of
dynsnap/agent/entrypoint_control.py (e.g. ``git show HEAD~1:dynsnap/agent/entrypoint_control.py``),
so an older agent's wait can be measured against a newer entrypoint and the other way round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynsnap.models import protocol as P  # noqa: E402

CYCLE = (P.EntrypointState.RESTORING, P.EntrypointState.ACTIVE, P.EntrypointState.SUSPENDING,
         P.EntrypointState.SUSPENDED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def control_class(module_file: str | None) -> Any:
    if not module_file:
        from dynsnap.agent.entrypoint_control import EntrypointControl
        return EntrypointControl
    spec = importlib.util.spec_from_file_location("bench_entrypoint_control", module_file)
    assert spec and spec.loader, module_file
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.EntrypointControl


def wait_control_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the entrypoint exited with {proc.returncode} before writing {path}")
        with contextlib.suppress(OSError, ValueError):
            info: dict[str, Any] = json.loads(path.read_text())
            return info
        time.sleep(0.02)
    raise SystemExit(f"no {path} within {timeout:.0f}s")


async def round_trips(ctl: Any, n: int, gap_ms: float, rng: random.Random) -> list[float]:
    times = []
    for i in range(n):
        await asyncio.sleep(rng.uniform(0, gap_ms) / 1000)
        t0 = time.perf_counter()
        info = await ctl.request(CYCLE[i % len(CYCLE)], timeout=10.0)
        times.append((time.perf_counter() - t0) * 1000)
        assert info["state"] == CYCLE[i % len(CYCLE)].value, info
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entrypoint", default=str(ROOT / "native" / "build" / "dynsnap-entrypoint"))
    ap.add_argument("--agent-module", help="a file defining EntrypointControl (default: this tree's)")
    ap.add_argument("--n", type=int, default=100, help="timed requests (default 100)")
    ap.add_argument("--gap-ms", type=float, default=100.0, help="random pause before each, 0..this (default 100)")
    ap.add_argument("--seed", type=int, default=12)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="dynsnap-ack-") as tmp:
        control = Path(tmp) / "control"
        argv = [args.entrypoint, "--control-dir", str(control), "--probe-port", str(free_port()),
                "--system-port", str(free_port()), "--no-pid-cycle", "--no-thp-preload", "--", "sleep", "3600"]
        if os.geteuid() == 0:
            argv = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--", *argv]
        with open(Path(tmp) / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            first = wait_control_file(control / P.ENTRYPOINT_CONTROL_FILE, proc)
            ctl = control_class(args.agent_module)(control)
            rng = random.Random(args.seed)
            asyncio.run(round_trips(ctl, 4, args.gap_ms, rng))  # warm-up, not counted
            times = asyncio.run(round_trips(ctl, args.n, args.gap_ms, rng))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
    q = statistics.quantiles(times, n=10)
    print(f"entrypoint {args.entrypoint}")
    print(f"agent      {args.agent_module or 'dynsnap.agent.entrypoint_control'}")
    print(f"request_wakeup {first.get('request_wakeup', '(not reported)')}")
    print(f"n={len(times)} gap=0..{args.gap_ms:g} ms  median {statistics.median(times):.2f} ms  "
          f"p90 {q[8]:.2f} ms  min {min(times):.2f}  max {max(times):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
