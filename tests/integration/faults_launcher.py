"""The worker command of the fault tests' workers: sets up one fault in the worker's tree, then execs
the real worker (the Dynamo mocker). It runs inside the pod, as the entrypoint's worker.

    python faults_launcher.py [--fd-holder NAME] -- COMMAND [ARG...]

(A GPU process outside the worker's tree is node/test_agent_faults.py's GPU_DAEMON launcher.)

``--fd-holder NAME``
    Starts a child that takes descriptors from other processes: the way a process of the worker can
    come to hold an io_uring ring although the entrypoint's seccomp filter refuses it one (the ring
    is made by a process outside the filter and copied in with pidfd_getfd(2), which the filter
    allows; the kernel refuses to pass an io_uring descriptor over a unix socket). The child is not a
    GPU process (``LD_PRELOAD`` removed) and listens on the abstract unix socket ``NAME`` in the pod's
    network namespace (SOCK_SEQPACKET; one command per connection, answered with a JSON line):
    ``hold PID FD`` (copy descriptor FD of in-namespace process PID and keep it open), ``map`` (map
    each held ring and close its descriptor, as liburing's io_uring_close_ring_fd lets an
    application do: the ring then shows only in /proc/<pid>/maps), ``release`` (unmap and close
    everything).

``python faults_launcher.py --send NAME COMMAND`` is the other side (run by the test through
``nsenter -t <pod pid> -p -n``, so in the pod's pid namespace but outside its seccomp filter): for
``hold`` it makes an io_uring ring and asks the holder to copy it; it prints the holder's answer.

The holder mode itself (``--hold-fds NAME``) is what the launcher execs for the child.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import time

IO_URING_SETUP = 425  # the same numbers on every architecture
PIDFD_OPEN = 434
PIDFD_GETFD = 438
PAGE = 4096
PROT_RW = 0x1 | 0x2
MAP_SHARED = 0x01


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def hold_fds(name: str) -> None:
    libc = _libc()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind("\0" + name)
    srv.listen(4)
    held: list[int] = []
    mapped: list[int] = []
    print(f"fd-holder {os.getpid()} listening on @{name}", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            cmd, *args = conn.recv(256).decode().split()
            error = None
            if cmd == "hold":
                pidfd = libc.syscall(PIDFD_OPEN, int(args[0]), 0)
                fd = libc.syscall(PIDFD_GETFD, pidfd, int(args[1]), 0) if pidfd >= 0 else -1
                if fd < 0:
                    error = f"pidfd_getfd of {args}: errno {ctypes.get_errno()}"
                else:
                    held.append(fd)
                if pidfd >= 0:
                    os.close(pidfd)
            elif cmd == "map":
                for fd in held:
                    addr = libc.mmap(None, PAGE, PROT_RW, MAP_SHARED, fd, 0)
                    if addr in (None, ctypes.c_void_p(-1).value):
                        error = f"mmap of fd {fd}: errno {ctypes.get_errno()}"
                        break
                    mapped.append(addr)
                    os.close(fd)
                else:
                    held = []
            elif cmd == "release":
                for addr in mapped:
                    libc.munmap(addr, PAGE)
                for fd in held:
                    os.close(fd)
                held, mapped = [], []
            else:
                error = f"unknown command {cmd!r}"
            conn.send(json.dumps({"pid": os.getpid(), "held": held, "mapped": len(mapped), "error": error}).encode())
            print(f"fd-holder: {cmd}: held {held}, mapped {len(mapped)}, error {error}", flush=True)


def send(name: str, cmd: str) -> None:
    if cmd == "hold":
        params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
        ring = ctypes.CDLL(None, use_errno=True).syscall(IO_URING_SETUP, 4, params)
        if ring < 0:
            sys.exit(f"io_uring_setup: errno {ctypes.get_errno()}")
        cmd = f"hold {os.getpid()} {ring}"  # the holder copies it while this process lives
    for _ in range(100):  # the holder may still be starting
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect("\0" + name)
            break
        except OSError:
            s.close()
            time.sleep(0.1)
    else:
        sys.exit(f"no fd-holder listening on @{name}")
    with s:
        s.send(cmd.encode())
        print(s.recv(4096).decode(), flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--hold-fds"]:
        hold_fds(argv[1])
        return
    if argv[:1] == ["--send"]:
        send(argv[1], argv[2])
        return
    sep = argv.index("--")
    opts, command = argv[:sep], argv[sep + 1:]
    i = 0
    while i < len(opts):
        if opts[i] == "--fd-holder":
            i += 1
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            if os.fork() == 0:
                os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), "--hold-fds", opts[i]], env)
        else:
            sys.exit(f"faults_launcher: unknown option {opts[i]!r}")
        i += 1
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
