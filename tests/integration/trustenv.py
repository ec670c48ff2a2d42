"""What the trust-boundary tests (test_agent_trust.py) need beyond agentenv.py: mocker workers whose
entrypoint's control directory is an attacker's choice (a symlink to a node directory, a path with
``..``), a worker that starts a process carrying the old helper marker inside its own tree, the same
marker on a process of the node, the control directory of a pod as the node reaches it, files
compared byte for byte; and, for the real node's suites too, an entrypoint report replaced as its worker
could, and the refusal it earns.

The pod sandboxes share the node's file system (dynsnap/testenv/sandbox.py), so a node directory a
symlink or a ``..`` points at is one the entrypoint itself can write: it keeps its control file
there, and everything works for the worker, exactly as it would in a container whose control
directory resolved there. What the agent must never do is follow it.

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
from dynsnap.models import protocol as P
from dynsnap.testenv.cluster import RunningPod

# The entrypoint's log stays on the pod's own emptyDir whatever its control directory is: the node
# directories below must hold only what the entrypoint and the agent write as control files.
LOG_FILE = f"{P.ENTRYPOINT_CONTROL_DIR}/worker.log"
MARKER = "DYNSNAP_OP"  # what agents before issue 18 took for proof that a process was their helper


def _main(comp: Obj) -> Obj:
    main: Obj = comp["extraPodSpec"]["mainContainer"]
    return main


def with_control_dir(comp: Obj, control_dir: str, *, symlink_to: Path | None = None) -> Obj:
    """The component's entrypoint started with ``--control-dir control_dir``; with ``symlink_to``,
    ``control_dir`` is first made, inside the pod's own file system, a symlink to that node directory
    (as whoever controls the container image or its start could make it)."""
    main = _main(comp)
    cmd = list(main["command"])
    at = cmd.index("--control-dir")
    cmd[at + 1:at + 2] = [control_dir, "--log-file", LOG_FILE]
    if symlink_to is not None:
        # sh execs the entrypoint: it is the container's PID 1, as the agent requires
        cmd = ["/bin/sh", "-c", f"ln -s {shlex.quote(str(symlink_to))} {shlex.quote(control_dir)} && exec \"$@\"",
               "sh", *cmd]
    main["command"] = cmd
    return comp


def with_forged_helper(comp: Obj) -> Obj:
    """The worker started by a launcher that first starts, inside the worker's own tree, a ``sleep``
    carrying ``DYNSNAP_OP=<its pod UID>/criu`` (what the worker itself could set), without the stub
    CUDA driver (it is no GPU process), then execs the mocker in its own place."""
    main = _main(comp)
    cmd = list(main["command"])
    at = cmd.index("--") + 1
    forge = f'env -u LD_PRELOAD {MARKER}="$POD_UID/criu" sleep infinity & exec "$@"'
    main["command"] = [*cmd[:at], "/bin/sh", "-c", forge, "launcher", *cmd[at:]]
    return comp


def control_dir(pod: RunningPod, path: str = P.ENTRYPOINT_CONTROL_DIR) -> Path:
    """A directory of the pod's container as the node reaches it (no symlink in ``path``)."""
    return Path(f"/proc/{pod.sandbox.pid}/root") / path.lstrip("/")


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


def marked_in_pod(pod: RunningPod) -> list[int]:
    """Host pids of the pod's processes that carry the marker with the pod's UID."""
    ns = pod.sandbox.pid_namespace
    want = f"{MARKER}={pod.uid}/".encode()
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
