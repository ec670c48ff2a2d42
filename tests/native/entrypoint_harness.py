"""dynsnap-entrypoint as PID 1 of a fresh pid + mount namespace: the sandbox the entrypoint's tests
run it in (test_entrypoint.py, test_entrypoint_bounds.py), the small Python worker it starts, and
their fixtures (re-exported by conftest.py).

Each sandbox is `unshare --pid --fork --mount-proc --mount -- dynsnap-entrypoint ... -- WORKER`
(root needed), the way a container runtime would start it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dynsnap.models import protocol

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))

# One script, several workers (argv[1]); WORKER_CTL is a directory whose files set the status
# its /health and /live answer, so a test can change what the worker reports.
WORKER = textwrap.dedent(r'''
    import ctypes, http.server, os, signal, sys, time

    def log(msg):
        print(f"worker[{os.getpid()}]: {msg}", flush=True)

    mode = sys.argv[1]
    log(f"started mode={mode} pid={os.getpid()} pgid={os.getpgid(0)} sid={os.getsid(0)} "
        f"stdin={os.readlink('/proc/self/fd/0')}")
    if mode == "crash":
        sys.exit(int(sys.argv[2]))
    if mode == "chatty":
        while not os.path.exists(os.path.join(os.environ["WORKER_CTL"], "go")):
            time.sleep(0.02)
        for burst in range(20):
            for i in range(20):
                print(f"line {burst}-{i} " + "x" * 90)
            sys.stdout.flush()
            time.sleep(0.15)
        log("chatty done")
        sys.exit(0)
    if mode == "iouring":
        libc = ctypes.CDLL(None, use_errno=True)
        params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
        fd = libc.syscall(425, 4, params)          # io_uring_setup: 425 on every arch
        log(f"io_uring_setup fd={fd} errno={ctypes.get_errno()}")
        for _ in range(1000):  # until the test has seen the sandbox start (else it may be gone by then)
            if os.path.exists(os.path.join(os.environ["WORKER_CTL"], "go")):
                break
            time.sleep(0.02)
        sys.exit(0)

    # mode == "serve": the worker's system server, plus a helper in the same process group;
    # like Dynamo's runtime it tries io_uring first and keeps the ring when it gets one
    libc = ctypes.CDLL(None, use_errno=True)
    ring = libc.syscall(425, 4, ctypes.create_string_buffer(120))
    log(f"io_uring_setup fd={ring} errno={ctypes.get_errno()}")
    ctl = os.environ["WORKER_CTL"]
    helper = os.fork()
    if helper == 0:
        def helper_term(sig, frm):
            log("helper got SIGTERM")
            os._exit(0)
        signal.signal(signal.SIGTERM, helper_term)
        log("helper running")
        while True:
            time.sleep(1)

    def term(sig, frm):
        log("got SIGTERM")
        os.waitpid(helper, 0)
        sys.exit(int(os.environ.get("WORKER_TERM_EXIT", "0")))
    signal.signal(signal.SIGTERM, term)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.strip("/")
            path = os.path.join(ctl, name)
            code = int(open(path).read()) if os.path.exists(path) else 200
            body = f'{{"worker":"{name}","code":{code},"pid":{os.getpid()}}}'.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, fmt, *args):
            log("served " + fmt % args)

    http.server.HTTPServer(("127.0.0.1", int(os.environ["DYN_SYSTEM_PORT"])), Handler).serve_forever()
''')

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def ns_pid(host_pid: int) -> int:
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid for {host_pid}")


class Sandbox:
    """One entrypoint as PID 1 of its own pid and mount namespaces."""

    def __init__(self, binary: Path, tmp: Path, worker_args: list[str], *, opts: list[str] | None = None,
                 env: dict[str, str] | None = None, inotify_instances: int | None = None,
                 control: Path | None = None) -> None:
        self.tmp = tmp
        self.control = control or tmp / "control"
        self.worker_ctl = tmp / "worker-ctl"
        self.worker_ctl.mkdir()
        self.probe_port = free_port()
        self.system_port = free_port()
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        self.stdout = tmp / "stdout.txt"
        self.stderr = tmp / "stderr.txt"
        self.seq = 0
        self.env = {**os.environ, "DYN_SYSTEM_PORT": str(self.system_port),
                    "WORKER_CTL": str(self.worker_ctl), "PYTHONUNBUFFERED": "1", **(env or {})}
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--", str(binary),
                "--control-dir", str(self.control), "--probe-port", str(self.probe_port), *(opts or []),
                "--", sys.executable, str(self.script), *worker_args]
        if inotify_instances is not None:
            # a node whose inotify instances are used up, in miniature: the entrypoint's own user
            # namespace (root mapped to root) gets that per-user limit (user.max_inotify_instances,
            # which the kernel checks beside fs.inotify.max_user_instances), set before it starts
            limit = f"echo {inotify_instances} > /proc/sys/user/max_inotify_instances && exec \"$@\""
            argv = ["unshare", "--user", "--map-root-user", *argv[1:argv.index("--") + 1],
                    "sh", "-c", limit, "sh", *argv[argv.index("--") + 1:]]
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            # stdin a pipe, as from a container runtime: the worker must get /dev/null instead
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.PIPE,
                                         env=self.env, start_new_session=True)
        self.pid1 = wait_for(self._started, "the entrypoint to start", timeout=30.0)

    def _started(self) -> int:
        """The entrypoint's host pid once unshare has forked it; an unshare that already exited (its
        child gone with it) is reported with its status and output rather than waited out."""
        pid = (children(self.proc.pid) or [0])[0]
        if not pid and self.proc.poll() is not None:
            raise AssertionError(f"unshare exited {self.proc.returncode} before its child was seen; "
                                 f"stderr: {self.err()[-2000:]!r}; stdout: {self.out()[-2000:]!r}")
        return pid

    # -- what a pod would see --
    def out(self) -> str:
        return self.stdout.read_text(errors="replace")

    def err(self) -> str:
        return self.stderr.read_text(errors="replace")

    def get(self, path: str, *, timeout: float = 5.0) -> tuple[int, str, dict[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.probe_port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(), {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def status(self, path: str, *, timeout: float = 5.0) -> int:
        return self.get(path, timeout=timeout)[0]

    def control_file(self) -> dict[str, Any]:
        path = self.control / protocol.ENTRYPOINT_CONTROL_FILE
        return wait_for(lambda: path.exists() and json.loads(path.read_text()), "the control file")

    def wait_up(self) -> None:
        wait_for(lambda: self._probe_ok(), "the worker to serve through the entrypoint")

    def _probe_ok(self) -> bool:
        try:
            return self.status("/health") == 200
        except OSError:
            return False

    # -- what the agent does --
    def request(self, state: str) -> dict[str, Any]:
        """Sets a state the way the agent does (temp file + rename) and waits for the ack."""
        self.control_file()  # the entrypoint creates the control dir at start: wait for it, as the agent does
        self.seq += 1
        tmp = self.control / ".state-request.tmp"
        tmp.write_text(f"{self.seq} {state}\n")
        tmp.rename(self.control / protocol.ENTRYPOINT_REQUEST_FILE)
        seq = self.seq
        return wait_for(lambda: (c := self.control_file())["request_seq"] >= seq and c, f"ack of {state}")

    def set_worker(self, endpoint: str, code: int) -> None:
        (self.worker_ctl / endpoint).write_text(str(code))

    def worker_host_pid(self) -> int:
        w = self.control_file()["worker_pid"]
        return wait_for(lambda: next((c for c in children(self.pid1) if ns_pid(c) == w), 0), "the worker")

    def nsenter(self, *argv: str) -> str:
        return subprocess.run(["nsenter", "-t", str(self.pid1), "-p", "-m", "--", *argv], check=True,
                              capture_output=True, text=True, timeout=30, env=self.env).stdout

    def wait(self, timeout: float = 15) -> int:
        return self.proc.wait(timeout=timeout)

    def running(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1, signal.SIGKILL)  # PID 1 gone: the kernel kills the namespace
            self.proc.wait(timeout=15)
        if self.proc.stdin:
            self.proc.stdin.close()


@pytest.fixture(scope="session")
def entrypoint_bin() -> Path:
    # only this program and the huge-page library it preloads by default (found next to it): the
    # other native/ targets need toolchains these tests do not
    subprocess.run(["make", "-s", "-C", str(ROOT / "native"), f"BUILD={BUILD}", "entrypoint", "thp"], check=True)
    return BUILD / "dynsnap-entrypoint"


@pytest.fixture
def sandbox(entrypoint_bin: Path, tmp_path: Path) -> Iterator[Callable[..., Sandbox]]:
    made: list[Sandbox] = []

    def make(worker_args: list[str], **kw: Any) -> Sandbox:
        where = tmp_path / f"sandbox{len(made)}"
        where.mkdir(exist_ok=True)
        sb = Sandbox(entrypoint_bin, where, worker_args, **kw)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()


