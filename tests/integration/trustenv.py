"""What the trust-boundary tests need beyond agentenv.py and realnodeenv.py: a worker whose entrypoint's
control directory is an attacker's choice (a symlink to a node directory's path, a path with ``..``,
made inside a real container: node/test_agent_refusals.py), a worker that starts a process carrying the
old helper marker inside its own tree, the same marker on a process of the node, files compared byte for
byte; an entrypoint report replaced as its worker could, and the refusal it earns; a CRIU configuration
and a cuda-checkpoint planted in a worker's container for the agent's CRIU to find.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from dynsnap.k8s.client import Obj

MARKER = "DYNSNAP_OP"  # what agents before issue 18 took for proof that a process was their helper


# A worker launcher (``sh -c FORGE_IN_TREE launcher WORKER...``): a ``sleep`` carrying the old helper marker
# with the pod's UID (POD_UID: the downward API's, as the examples set it) started in the worker's own tree
# without the stub CUDA driver (no GPU process), then the worker exec'd in the launcher's place.
FORGE_IN_TREE = f'env -u LD_PRELOAD {MARKER}="$POD_UID/criu" sleep infinity & exec "$@"'


def hostile_control_dir(main: Obj, control_dir: str, node_dir: Path, *, symlink: bool) -> Obj:
    """A real container's ``main`` (examples/dgd's) whose entrypoint is started with ``--control-dir
    control_dir`` by a launcher that first makes ``node_dir`` inside the container's own file system (the
    same absolute path as a directory of the node: the one a naive agent would reach) and, with
    ``symlink``, ``control_dir`` a symlink to it (as whoever controls the container's image or start
    could). ``sh`` execs the entrypoint: it stays the container's PID 1, as the agent requires."""
    cmd = list(main["command"])
    at = cmd.index("--control-dir")
    cmd[at + 1] = control_dir
    prep = f"mkdir -p {shlex.quote(str(node_dir))}"
    if symlink:
        prep += f" && ln -s {shlex.quote(str(node_dir))} {shlex.quote(control_dir)}"
    main["command"] = ["/bin/sh", "-c", prep + ' && exec "$@"', "sh", *cmd]
    return main


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every entry under ``root``: a file's bytes, a symlink's target (prefixed ``-> ``), a directory
    as ``<dir>``. Two equal results: nothing under ``root`` was written, created or removed."""
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = b"-> " + os.readlink(p).encode()
            elif p.is_dir():
                out[rel] = b"<dir>"
            else:
                out[rel] = p.read_bytes()
    return out


def start_forged_on_node(workdir: Path, uid: str) -> subprocess.Popen[bytes]:
    """A process of the node that is no helper of anyone's: ``sleep`` copied to an executable named
    criu, with ``DYNSNAP_OP=<uid>/criu`` in its environment, in a session of its own."""
    criu = workdir / "forged" / "criu"
    criu.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/sleep", criu)
    return subprocess.Popen([str(criu), "100000"], env={**os.environ, MARKER: f"{uid}/criu"},
                            start_new_session=True, stdin=subprocess.DEVNULL)


def start_ticks(pid: int) -> int | None:
    """The process's start time (``/proc/<pid>/stat`` field 22); None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def marked_in(ns: int, uid: str) -> list[int]:
    """Host pids of the processes of pid namespace ``ns`` that carry the marker with ``uid``."""
    want = f"{MARKER}={uid}/".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino != ns:
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(want) for e in env) and start_ticks(int(pid)) is not None:
            out.append(int(pid))
    return out


def refused(reason: str, says: str) -> Callable[[Obj | None], bool]:
    """The WorkerSnapshot says ``Accepted=False`` for ``reason``, its message saying ``says``."""
    def check(ws: Obj | None) -> bool:
        c = next((c for c in ((ws or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Accepted"),
                 None)
        return bool(c and c["status"] == "False" and c["reason"] == reason and says in c["message"])
    return check


def replace_report(report: Path, content: bytes | Path) -> None:
    """The entrypoint's ``report`` replaced in one step, as the worker could: by ``content``'s bytes, or
    (a Path) by a symlink to that file of the node."""
    tmp = report.parent / ".replacing"
    if isinstance(content, Path):
        tmp.symlink_to(content)
    else:
        tmp.write_bytes(content)
    tmp.rename(report)


# What a pod's author could ship in the worker's image to steer the agent's CRIU (the node's root, in the
# worker's mount namespace), each an executable that, were it run, leaves its line in a file of the
# container: a CRIU configuration at the paths CRIU reads by default (/etc/criu/default.conf, and
# $HOME/.criu/default.conf for HOME=/root) naming an action script (PLANTED_RAN), and a cuda-checkpoint
# for CRIU's CUDA plugin to find on its PATH (PLANTED_CUDA_RAN).
PLANTED_CONFIGS = ("/etc/criu/default.conf", "/root/.criu/default.conf")
PLANTED_SCRIPT = "/tmp/dynsnap-planted-action"
PLANTED_RAN = "/tmp/dynsnap-planted-ran"
PLANTED_CUDA_RAN = "/tmp/dynsnap-planted-cuda-checkpoint-ran"


def _recording(entrypoint: int, scripts: list[str], line: str, ran: str) -> Path:
    """Executable ``scripts`` (absolute paths) written in the container of ``entrypoint`` (its PID 1), each
    appending ``line`` (shell words) to ``ran`` when run; the node's path of ``ran``, absent."""
    root = Path(f"/proc/{entrypoint}/root")
    for script in scripts:
        at = root / script.lstrip("/")
        at.parent.mkdir(parents=True, exist_ok=True)
        at.write_text(f'#!/bin/sh\necho "{line} uid=$(id -u)" >> {ran}\n')
        at.chmod(0o755)
    out = root / ran.lstrip("/")
    out.unlink(missing_ok=True)
    return out


def plant_criu_config(entrypoint: int) -> Path:
    """PLANTED_CONFIGS and PLANTED_SCRIPT written in the container of ``entrypoint`` (its PID 1), as its
    image would hold them; the node's path of PLANTED_RAN in that container, absent."""
    root = Path(f"/proc/{entrypoint}/root")
    for conf in PLANTED_CONFIGS:
        path = root / conf.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"action-script {PLANTED_SCRIPT}\n")
    return _recording(entrypoint, [PLANTED_SCRIPT], "$CRTOOLS_SCRIPT_ACTION", PLANTED_RAN)


def plant_cuda_checkpoint(entrypoint: int, dirs: list[str]) -> Path:
    """An executable ``cuda-checkpoint`` in each of ``dirs`` of the container of ``entrypoint``, as its image
    could hold one; the node's path of PLANTED_CUDA_RAN in that container, absent."""
    return _recording(entrypoint, [f"{d}/cuda-checkpoint" for d in dirs], "$*", PLANTED_CUDA_RAN)
