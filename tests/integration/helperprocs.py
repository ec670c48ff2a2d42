"""The helpers an agent runs for a pod (dynsnap-cuda, CRIU under dynsnap-nsexec), found in /proc the way a
person on the node would find them: by what each process is and what it acts on. Not the way the
agent finds them (its registry, dynsnap/agent/helpers.py), so a test's "no helper left running" does
not rest on the code it checks, and not by anything a process can say about itself.

- dynsnap-cuda: a process whose executable is dynsnap-cuda, running an ``--action`` (its op: save,
  resume, unlock, ...) for a ``--pid`` of the pod's pid namespace;
- CRIU: a dynsnap-nsexec that runs a CRIU ``dump`` or ``restore`` whose child is in the pod's pid
  namespace (the launcher itself stays outside it), with every process below it (CRIU, or the tests'
  wrapper scripts), op ``criu``.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from dynsnap.runtime import procfs


@dataclass(frozen=True)
class Helper:
    pid: int
    ns_pid: int  # its pid in the innermost pid namespace it runs in (CRIU runs in the pod's)
    name: str
    op: str  # dynsnap-cuda's --action, or "criu"


def _pid_values(argv: list[str]) -> list[int]:
    """The pids of ``--pid`` values (``PID`` or ``PID@START``, the agent pinning each to the process it saw)."""
    out = []
    for i, a in enumerate(argv[:-1]):
        if a == "--pid":
            out += [int(p.split("@", 1)[0]) for p in argv[i + 1].split(",") if p.split("@", 1)[0].isdigit()]
    return out


def _in_namespace(pid: int, inode: int | None) -> bool:
    try:
        return inode is not None and os.stat(f"/proc/{pid}/ns/pid").st_ino == inode
    except OSError:
        return False


def _helper(pid: int, op: str) -> Helper | None:
    st = procfs.status(pid)
    if st is None or st.state in ("Z", "X"):
        return None
    return Helper(pid, st.ns_pid, st.name, op)


def helpers_for(inode: int | None, pid1: int) -> list[Helper]:
    """The dynsnap-cuda and CRIU processes that run for the pod whose pid namespace is ``inode`` and whose
    PID 1 is host pid ``pid1`` (a real container's entrypoint)."""
    out: list[Helper] = []
    for pid in procfs.pids():
        exe = procfs.exe_name(pid)
        if exe not in ("dynsnap-cuda", "dynsnap-nsexec"):
            continue
        argv = procfs.cmdline(pid)
        if exe == "dynsnap-cuda":
            # an --action call (save, resume, unlock...); the agent's short --get-state looks are no helpers
            if "--action" in argv[:-1] and any(_in_namespace(p, inode) for p in _pid_values(argv)):
                h = _helper(pid, argv[argv.index("--action") + 1])
                out += [h] if h is not None else []
            continue
        at = argv.index("--") if "--" in argv else len(argv)
        below = procfs.tree(pid)
        if {"dump", "restore"} & set(argv[at:]) and any(_in_namespace(p, inode) for p in below if p != pid):
            for p in below:
                with contextlib.suppress(OSError):
                    h = _helper(p, "criu")
                    out += [h] if h is not None else []
    return out
