"""Taking a real node off the host: the processes of its containerd (shims included) and of its
pods' cgroups, every mount under its directory (container root file systems, kubelet's volumes,
the pods' network namespaces), its cgroup tree, its pods' veths on the run's bridge and CNI's
cache files of its network; and :func:`leftovers`, which names whatever of it is still there.

Layer: ``dynsnap.testenv`` (test harness only; ``node.py`` calls it when the node stops, and when
it starts, for what a crashed earlier run of the same names left behind). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path

from dynsnap.runtime import procfs
from dynsnap.runtime.command import find_tool, run_command

CGROUP_FS = Path("/sys/fs/cgroup")
CNI_CACHE = Path("/var/lib/cni")  # libcni's cache; containerd 1.6 does not let it be moved
SHIM_SOCKETS = Path("/run/containerd/s")  # the runc shims' sockets (named by a hash of containerd's address)
_ESCAPE = re.compile(r"\\([0-7]{3})")


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root`` in this process's mount namespace (the host's)."""
    prefix = str(root).rstrip("/")
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), line.split(" ")[4])
        if mp == prefix or mp.startswith(prefix + "/"):
            out.append(mp)
    return out


async def unmount_all(root: Path, *, timeout: float = 10.0) -> None:
    """Unmount everything at or below ``root``, deepest first; lazily where a mount is busy."""
    umount = find_tool("umount")
    for _ in range(3):
        points = sorted(set(mounts_under(root)), key=lambda p: p.count("/"), reverse=True)
        if not points:
            return
        for mp in points:
            if (await run_command([umount, mp], timeout=timeout, check=False)).returncode != 0:
                await run_command([umount, "-l", mp], timeout=timeout, check=False)


def cgroup_dirs(cgroup_root: str) -> list[Path]:
    """The node's cgroup root in every mounted hierarchy that has it (v1 ones and the unified one)."""
    rel = cgroup_root.strip("/")
    if not rel:
        raise ValueError("the node's cgroup root must not be the root cgroup")
    out = []
    with contextlib.suppress(FileNotFoundError):
        for h in sorted(CGROUP_FS.iterdir()):
            if (h / rel).is_dir():
                out.append(h / rel)
    return out


def cgroup_pids(cgroup_root: str) -> set[int]:
    """Every process in the node's cgroup tree, in any hierarchy."""
    pids: set[int] = set()
    for top in cgroup_dirs(cgroup_root):
        for d, _, _ in os.walk(top):
            with contextlib.suppress(OSError):
                pids.update(int(x) for x in (Path(d) / "cgroup.procs").read_text().split())
    return pids


def pids_mentioning(text: str) -> set[int]:
    """Processes whose command line holds ``text`` (the node's directory: its containerd, kubelet
    and every shim, which carries containerd's socket path in ``-address``)."""
    me = os.getpid()
    return {int(p) for p in procfs.pids() if int(p) != me and text in " ".join(procfs.cmdline(p))}


async def kill_and_wait(pids: set[int], *, timeout: float = 10.0) -> set[int]:
    """SIGKILL ``pids``; return those still there after ``timeout`` (zombies count as gone)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    left = set(pids)
    while left and time.monotonic() < deadline:
        left = {p for p in left if (st := procfs.status(p)) is not None and st.state != "Z"}
        if left:
            await asyncio.sleep(0.1)
    return left


async def remove_cgroup_tree(cgroup_root: str, *, timeout: float = 10.0) -> list[str]:
    """rmdir the node's cgroup tree bottom-up in every hierarchy (retried: a cgroup whose last task
    just exited may stay busy for a moment); returns the directories that would not go."""
    deadline = time.monotonic() + timeout
    while True:
        stuck: list[str] = []
        for top in cgroup_dirs(cgroup_root):
            for d, _, _ in os.walk(top, topdown=False):
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    stuck.append(f"{d}: {e.strerror}")
        if not stuck or time.monotonic() >= deadline:
            return stuck
        await asyncio.sleep(0.2)


async def bridge_veths(bridge: str) -> list[str]:
    """The CNI bridge plugin's veths (``veth…``) on ``bridge``; the sandboxes' are ``dsv…``."""
    res = await run_command([find_tool("ip"), "-o", "link", "show", "master", bridge], timeout=10, check=False)
    names = [line.split(":")[1].strip().split("@", 1)[0] for line in res.stdout.splitlines() if line.count(":") > 1]
    return [n for n in names if n.startswith("veth")]


async def remove_veths(bridge: str) -> None:
    ip = find_tool("ip")
    for dev in await bridge_veths(bridge):
        await run_command([ip, "link", "del", "dev", dev], timeout=10, check=False)


def cni_cache_files(network: str) -> list[Path]:
    results = CNI_CACHE / "results"
    return sorted(results.glob(f"{network}-*")) if results.is_dir() else []


def remove_cni_cache(network: str) -> None:
    """CNI's cached results of the node's network, then libcni's directories if nobody else's
    files are left in them."""
    for f in cni_cache_files(network):
        f.unlink(missing_ok=True)
    for d in (CNI_CACHE / "results", CNI_CACHE):
        with contextlib.suppress(OSError):  # not empty: another node's, or not there
            d.rmdir()


def remove_shim_socket_dir() -> None:
    """The shims' socket directory and its parent, if no shim's socket is left there (every shim
    removes its own on exit; another session's node may still have some)."""
    for d in (SHIM_SOCKETS, SHIM_SOCKETS.parent):
        with contextlib.suppress(OSError):
            d.rmdir()


async def leftovers(*, root: Path, cgroup_root: str, network: str, bridge: str) -> list[str]:
    """What of the node is still on the host (empty once it is stopped)."""
    out = [f"process {p}: {' '.join(procfs.cmdline(p))[:160]}" for p in sorted(pids_mentioning(f"{root}/"))]
    out += [f"process {p} in the node's cgroups: {' '.join(procfs.cmdline(p))[:160]}"
            for p in sorted(cgroup_pids(cgroup_root))]
    out += [f"mount {m}" for m in mounts_under(root)]
    out += [f"cgroup {d}" for d in cgroup_dirs(cgroup_root)]
    out += [f"veth {v} on {bridge}" for v in await bridge_veths(bridge)]
    out += [f"CNI cache file {f}" for f in cni_cache_files(network)]
    return out
