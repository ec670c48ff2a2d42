"""dynsnap-entrypoint's bounds against what comes from outside (issue 18, "Trust boundary and
deadlines"; docs/ENTRYPOINT.md, "Control file bounds" and "Probe server"), run as PID 1 of a fresh
pid namespace (entrypoint_harness.py).

- entrypoint.json is strict JSON in UTF-8 whatever bytes the command line, the paths and a request
  carry: every string field is the value's prefix of at most FIELD_MAX bytes cut on a character
  boundary, decoded as Python's ``bytes.decode("utf-8", "replace")`` decodes it, and the file is
  never larger than CONTROL_MAX.
- Probe clients cannot stall PID 1: clients that send a byte a second or nothing at all, each
  reconnecting when closed, delay neither the agent's state requests nor other probes; the
  entrypoint closes them itself; it holds at most PROBE_MAX_CONNS connections, and a prober still
  gets one when stallers hold them all.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from entrypoint_harness import BUILD, Sandbox, wait_for

from dynsnap.models import protocol

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for unshare --pid and ns_last_pid")

# native/entrypoint/entrypoint.h, documented in docs/ENTRYPOINT.md
FIELD_MAX = 2048
CONTROL_MAX = 65536
PROBE_MAX_CONNS = 16
PROBE_PEER_SHARE = 8  # probe.c: the connections one peer address may hold
PROBE_BACKLOG = 128  # probe.c: the listen backlog
KUBELET_PROBE_TIMEOUT = 1.0  # kubelet's default timeoutSeconds
AGENT_ACK_BOUND = 10.0  # the agent's entrypoint_timeout (dynsnap/agent/settings.py)

# Bytes no JSON writer may pass through as they are: quotes, backslashes, every control byte, DEL,
# and each kind of ill-formed UTF-8 (a stray continuation byte, overlong forms, a surrogate, a code
# point past U+10FFFF, sequences cut short, bytes that never start one), beside valid multibyte
# characters and a text that looks like an escape already. No '/' and no NUL: they go into paths.
NASTY = (b'"\\' + bytes(range(1, 32)) + b"\x7f" + b"\x80" + b"\xc0\xaf" + b"\xe0\x80\xaf" + b"\xed\xa0\x80"
         + b"\xf4\x90\x80\x80" + b"\xf0\x9f\x98" + b"x" + b"\xff\xfe" + b"\xe2\x82" + b'"'
         + "é€😀".encode() + b"\\u0041\\")
assert b"/" not in NASTY and b"\0" not in NASTY


def nasty_dir(base: Path, length: int) -> Path:
    """A directory path of about `length` bytes under base, every component made of NASTY."""
    parts, size = [], len(os.fsencode(base))
    while size < length:
        part = (NASTY * 4)[:min(200, length - size - 1)]
        parts.append(part)
        size += len(part) + 1
    return Path(os.fsdecode(os.path.join(os.fsencode(base), *parts)))


def strict_json(path: Path) -> dict[str, Any]:
    """The control file, parsed the strictest way: UTF-8 without a replaced byte, RFC 8259 JSON
    without raw control characters, no key twice; and within its size bound."""
    raw = path.read_bytes()
    assert len(raw) <= CONTROL_MAX, len(raw)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)

    doc: dict[str, Any] = json.loads(raw.decode("utf-8", errors="strict"), strict=True,
                                     object_pairs_hook=no_duplicates)
    return doc


def field(value: bytes) -> str:
    """What a field carries for value: all of it, FIELD_MAX bytes at most (these tests place the
    cut themselves, on a character boundary), decoded the way the entrypoint replaces ill-formed
    UTF-8."""
    assert len(value) <= FIELD_MAX
    return value.decode("utf-8", errors="replace")


def control_path(sb: Sandbox) -> Path:
    return Path(sb.control, protocol.ENTRYPOINT_CONTROL_FILE)


def request_bytes(sb: Sandbox, line: bytes) -> dict[str, Any]:
    """A request of any bytes, written as the agent writes one (temp file + rename); its ack."""
    sb.seq += 1
    tmp = sb.control / ".state-request.tmp"
    tmp.write_bytes(line)
    tmp.rename(sb.control / protocol.ENTRYPOINT_REQUEST_FILE)
    ack: dict[str, Any] = wait_for(functools.partial(acked, sb, sb.seq), "the ack", timeout=AGENT_ACK_BOUND)
    return ack


def test_the_control_file_is_strict_json_whatever_bytes_its_fields_carry(
        sandbox: Callable[..., Sandbox], tmp_path: Path) -> None:
    control = nasty_dir(tmp_path / "c", 1990)  # the log file inside stays under FIELD_MAX: reported whole
    thp = tmp_path / os.fsdecode(b"lib" + NASTY.replace(b" ", b"_").replace(b":", b"_") + b".so")
    shutil.copy(BUILD / "libdynsnap-thp.so", thp)  # LD_PRELOAD splits at spaces and colons only
    # the worker's command line: the script, its mode, a nasty argument and a 100 KiB one whose
    # 4-byte characters put one across the FIELD_MAX boundary, 2 bytes before it
    script = tmp_path / "sandbox0" / "worker.py"  # where the sandbox puts its worker
    head = b" ".join([os.fsencode(sys.executable), os.fsencode(script), b"serve", NASTY, b"", b""])
    pad = (b'ab"\\\t\x01' * FIELD_MAX)[:FIELD_MAX - 2 - len(head)]
    big = pad + "😀".encode() * 25_000
    command = head + big
    assert command[FIELD_MAX - 2:FIELD_MAX + 2] == "😀".encode() and len(big) > 100_000
    sb = sandbox(["serve", os.fsdecode(NASTY), "", os.fsdecode(big)], control=control,
                 opts=["--thp-preload", str(thp)])
    assert sb.script == script
    sb.wait_up()

    doc = wait_for(lambda: control_path(sb).exists() and strict_json(control_path(sb)), "the control file")
    assert (doc["format"], doc["state"], doc["worker_alive"]) == (protocol.ENTRYPOINT_CONTROL_FORMAT, "active", True)
    assert doc["log_file"] == field(os.fsencode(control) + b"/worker.log")
    assert doc["thp_preload"] == field(os.fsencode(thp))
    assert doc["worker_command"] == field(command[:FIELD_MAX - 2])  # cut before the character across the bound

    # a request the container wrote: its state word carries the nasty bytes (no whitespace: the
    # word ends there), cut by the entrypoint to 40 bytes, whatever they cut through
    word = NASTY.translate(None, b" \t\n\v\f\r")[:63]
    ack = request_bytes(sb, b"1 " + word + b"\n")
    assert (ack["state"], ack["request_seq"]) == ("active", 1)
    assert ack["request_error"] == 'unknown state "' + field(word[:40]) + '"'
    ack = request_bytes(sb, b"2 suspending\n")
    assert (ack["state"], ack["request_error"]) == ("suspending", None)
    assert ack["worker_command"] == doc["worker_command"] and ack["log_file"] == doc["log_file"]


class Stallers(threading.Thread):
    """Clients that hold probe connections for as long as the entrypoint lets them: `trickle` of them
    send a request one byte a second, `silent` ones nothing at all. Each reconnects when the
    entrypoint closes it, as an attacker would (at most `per_client` connections each). One thread,
    bounded by `lifetime` seconds; `ended` records, per kind, the bytes each closed connection had
    sent when the entrypoint closed it."""

    REQUEST = b"GET /live HTTP/1.0\r\nX-Pad: " + b"a" * 64 + b"\r\n\r\n"  # 88 s at a byte a second

    def __init__(self, port: int, *, trickle: int, silent: int, per_client: int = 20, lifetime: float = 90.0):
        super().__init__(daemon=True)
        self.port, self.per_client, self.lifetime = port, per_client, lifetime
        self.kinds = ["trickle"] * trickle + ["silent"] * silent
        self.ended: dict[str, list[int]] = {"trickle": [], "silent": []}
        self.connected = 0
        self.stop_ = threading.Event()
        self.lock = threading.Lock()

    def _connect(self, i: int) -> socket.socket:
        # each client from an address of its own, as stallers in several pods (one pod holds at most
        # PROBE_PEER_SHARE: test_one_peers_flood_holds_its_share_and_kubelet_is_answered)
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30, source_address=(f"127.0.1.{1 + i}", 0))
        s.setblocking(False)
        with self.lock:
            self.connected += 1
        return s

    def run(self) -> None:
        socks = {self._connect(i): [i, 0] for i in range(len(self.kinds))}  # socket: [client, bytes sent]
        made = [1] * len(self.kinds)
        deadline, next_byte = time.monotonic() + self.lifetime, time.monotonic()
        while not self.stop_.is_set() and time.monotonic() < deadline and socks:
            readable, _, _ = select.select(list(socks), [], [], 0.05)
            closed = set(readable)  # the entrypoint never answers these: readable means closed
            if time.monotonic() >= next_byte:
                next_byte += 1.0
                for s, (i, sent) in socks.items():
                    if self.kinds[i] == "trickle" and s not in closed:
                        try:
                            socks[s][1] += s.send(self.REQUEST[sent:sent + 1])
                        except OSError:
                            closed.add(s)
            for s in closed:
                i, sent = socks.pop(s)
                with self.lock:
                    self.ended[self.kinds[i]].append(sent)
                s.close()
                if made[i] < self.per_client:
                    made[i] += 1
                    socks[self._connect(i)] = [i, 0]
        for s in socks:
            s.close()

    def stop(self) -> None:
        self.stop_.set()
        self.join(timeout=10)


def test_slow_probe_clients_delay_neither_state_requests_nor_other_probes(
        sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    stallers = Stallers(sb.probe_port, trickle=10, silent=4)  # fewer than the connection bound
    stallers.start()
    try:
        wait_for(lambda: stallers.connected >= 14, "the stallers to connect")
        # a wake and a capture's worth of requests, twice, each with the agent's own bound; and
        # meanwhile a prober is answered for the state in force
        for state, health in [("suspending", 503), ("suspended", 503), ("restoring", 503), ("active", 200)] * 2:
            seq = ask(sb, state)
            ack = wait_for(functools.partial(acked, sb, seq), f"the ack of {state}", timeout=AGENT_ACK_BOUND)
            assert (ack["state"], ack["request_error"]) == (state, None)
            assert sb.status("/health") == health
            assert sb.status("/live") == 200
        # the entrypoint itself closes the stallers that never sent a whole request
        wait_for(lambda: stallers.ended["trickle"] and stallers.ended["silent"], "the stallers to be closed")
    finally:
        stallers.stop()
    with stallers.lock:
        assert all(0 < sent < len(Stallers.REQUEST) for sent in stallers.ended["trickle"]), stallers.ended
        assert set(stallers.ended["silent"]) == {0}, stallers.ended
    assert sb.running()


def ask(sb: Sandbox, state: str) -> int:
    """A state request, the way the agent makes one (temp file + rename); its sequence number."""
    sb.seq += 1
    tmp = sb.control / ".state-request.tmp"
    tmp.write_text(f"{sb.seq} {state}\n")
    tmp.rename(sb.control / protocol.ENTRYPOINT_REQUEST_FILE)
    return sb.seq


def acked(sb: Sandbox, seq: int) -> dict[str, Any] | None:
    doc = strict_json(control_path(sb))
    return doc if doc["request_seq"] >= seq else None


def socket_fds(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed while we looked
            n += os.readlink(fd).startswith("socket:")
    return n


def test_probe_connections_are_bounded_and_a_prober_still_gets_one(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    held: list[int] = []
    idle: list[socket.socket] = []
    try:
        for i in range(2 * PROBE_MAX_CONNS):  # twice as many silent connections as it may hold, from 4 peers
            idle.append(socket.create_connection(("127.0.0.1", sb.probe_port), timeout=5,
                                                 source_address=(f"127.0.2.{1 + i // PROBE_PEER_SHARE}", 0)))
            held.append(socket_fds(sb.pid1) - 1)  # its sockets but the listening one
        for _ in range(10):  # and while the last ones are taken in
            time.sleep(0.02)
            held.append(socket_fds(sb.pid1) - 1)
        assert max(held) <= PROBE_MAX_CONNS, held
        assert held[-1] == PROBE_MAX_CONNS, held
        # every slot is taken by a connection that sent nothing yet; kubelet's probe is answered in
        # its own time all the same: the oldest of them makes room
        assert sb.status("/live", timeout=KUBELET_PROBE_TIMEOUT) == 200
        idle[0].settimeout(5)
        assert idle[0].recv(16) == b""  # closed by the entrypoint, without an answer
    finally:
        for s in idle:
            s.close()


def test_one_peers_flood_holds_its_share_and_kubelet_is_answered(sandbox: Callable[..., Sandbox]) -> None:
    """One pod floods the probe port (its own address): 3x the bound of silent connections, then whole
    requests on new connections as fast as they are answered. It holds at most PROBE_PEER_SHARE of the
    entrypoint's connections at any look (the rest are closed at once or make room among its own), the
    listen backlog is PROBE_BACKLOG, and every probe of kubelet (another address) is answered in its
    timeout all along."""
    sb = sandbox(["serve"])
    sb.wait_up()
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{sb.probe_port}"], capture_output=True, text=True,
                               check=True).stdout.split()
    assert int(listening[2]) == PROBE_BACKLOG, listening  # Send-Q of a listening socket: its backlog
    flood = "127.0.3.1"
    silent: list[socket.socket] = []
    stop = threading.Event()
    answered: list[int] = []

    def whole_requests() -> None:
        for _ in range(5000):  # bounded: at most 5000 requests, or until stopped
            if stop.is_set():
                return
            try:
                with socket.create_connection(("127.0.0.1", sb.probe_port), timeout=2,
                                              source_address=(flood, 0)) as c:
                    c.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                    answered.append(len(c.recv(4096)))
            except OSError:
                answered.append(-1)
    t = threading.Thread(target=whole_requests, daemon=True)
    try:
        for _ in range(3 * PROBE_MAX_CONNS):
            silent.append(socket.create_connection(("127.0.0.1", sb.probe_port), timeout=5,
                                                   source_address=(flood, 0)))
        t.start()
        for _ in range(10):  # kubelet's probes while the flood goes on, each in kubelet's timeout
            assert sb.status("/live", timeout=KUBELET_PROBE_TIMEOUT) == 200
            assert sb.status("/health", timeout=KUBELET_PROBE_TIMEOUT) == 200
            open_ = [s for s in silent if not select.select([s], [], [], 0)[0]]  # readable: closed by it
            assert len(open_) <= PROBE_PEER_SHARE, len(open_)
            time.sleep(0.1)
        assert len(answered) > 10 and any(n > 0 for n in answered)  # the flood really ran, and was served
    finally:
        stop.set()
        t.join(timeout=10)
        for s in silent:
            s.close()
    assert sb.running()
