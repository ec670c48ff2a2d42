"""Finding a worker on this node from its pod UID, the way a node agent with hostPID can:
the pod's processes carry its UID in their cgroup path; the container's PID 1 is
dynsnap-entrypoint (its in-namespace pid is 1 and its executable says so); its control
directory is reached through ``/proc/<entrypoint>/root`` (no volume for the agent); the worker
tree is every other process of that pid namespace; GPU processes are those that map the CUDA
driver or hold an NVIDIA device open.

Layer: ``dynsnap.agent``. Everything here only reads ``/proc`` and the control file. What comes
from inside the container (the control directory's path, its files, a process's environment, a
kubeconfig it names) is read through :mod:`dynsnap.agent.container`, the trust boundary.

    WorkerNotFound         no process of the pod runs here (pod elsewhere, or gone)
    NotUnderEntrypoint     the pod runs here, but not under dynsnap-entrypoint (refused)
    ContainerRefused       (dynsnap.agent.container) the control directory's path or its control
                           file is unsafe or unusable: refused with the reason it carries
      ForeignNamespace     (dynsnap.agent.nsexec) the entrypoint's namespaces are not the ones its
                           runtime made (a user namespace of its own): never entered
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from dynsnap.agent import container as C
from dynsnap.agent.entrypoint_control import EntrypointControl, EntrypointError
from dynsnap.agent.nsexec import ForeignNamespace, Target, foreign_namespaces
from dynsnap.models import protocol as P
from dynsnap.models.ids import HostPid, NsPid, PodUID
from dynsnap.models.workerenv import NCCL_SWITCHES
from dynsnap.runtime import caps, procfs
from dynsnap.runtime.procfs import PROC, ProcStatus

log = logging.getLogger(__name__)

ENTRYPOINT_EXE = "dynsnap-entrypoint"
_NVIDIA_DEV = ("/dev/nvidia",)
# The smallest NCCL settings under which two ranks were checkpointed *and* restored on the H200 pair
# (issue 11; docs/BENCHMARKS.md, "Two GPUs (issue 11)", bisected over NCCL_P2P_DISABLE, NCCL_SHM_DISABLE,
# NCCL_CUMEM_ENABLE): peer-to-peer off, and then either cuMem off (NCCL moves data through SHM in
# legacy host memory: 27 GB/s busbw at 256 MiB against 288 over NVLink) or SHM off too (sockets,
# 3 GB/s). Every other combination was checkpointed and then refused by the restore
# (CUDA_ERROR_NOT_SUPPORTED with P2P over cuMem or SHM over cuMem host memory, CUDA_ERROR_INVALID_VALUE
# with P2P over legacy IPC), leaving both ranks checkpointed. NCCL_SAFE_ENV is the set the reason
# recommends (the faster); a rank matching any set of NCCL_SAFE_ENVS passes.
NCCL_SAFE_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}
NCCL_SAFE_ENVS = (NCCL_SAFE_ENV, {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
# A kubeconfig a worker names is read up to this: the most a Secret or ConfigMap volume holds (1 MiB).
KUBECONFIG_BOUND = 1 << 20


class WorkerNotFound(LookupError):
    """No process of this pod runs on this node."""


class ProcessTooLarge(C.ContainerRefused):
    """A process of the container has more mappings or descriptors than the agent reads (procfs bounds)."""

    reason = P.Reason.PROCESS_TOO_LARGE


class NotUnderEntrypoint(LookupError):
    """The pod's container does not run dynsnap-entrypoint as its PID 1."""


@dataclass(frozen=True)
class WorkerProcs:
    """One worker container, as the node sees it right now."""

    pod_uid: PodUID
    entrypoint: HostPid  # the container's PID 1
    pidns: int  # inode of the container's pid namespace
    control_dir: str  # the entrypoint's control directory, a path inside the container (checked)
    info: dict[str, Any]  # the entrypoint's control file (entrypoint.json), validated
    procs: tuple[ProcStatus, ...]  # every process of the pid namespace but PID 1
    gpu: tuple[HostPid, ...]  # those that map the CUDA driver or hold an NVIDIA device
    root: Path = Path("/")  # the container's file system as the node reaches it (/proc/<entrypoint>/root)
    entrypoint_start: int | None = None  # its start time (clock ticks after boot): pins it from the look to the act
    gpu_start: Mapping[HostPid, int] = field(default_factory=dict)  # the GPU processes' start times, likewise
    proc: Path = PROC  # the /proc it was found in

    @property
    def target(self) -> Target:
        """The container's PID 1 as the programs the agent starts in its namespaces are given it."""
        return Target(self.entrypoint, self.entrypoint_start)

    @property
    def control(self) -> EntrypointControl:
        pinned = (self.entrypoint, self.entrypoint_start) if self.entrypoint_start is not None else None
        return EntrypointControl(self.control_dir, root=self.root, pinned=pinned, proc=self.proc)

    @property
    def state(self) -> P.EntrypointState:
        return P.EntrypointState(self.info["state"])

    @property
    def worker_alive(self) -> bool:
        """The worker's root process runs in the namespace, as /proc shows it now. (The control
        file's ``worker_alive`` lags: a tree CRIU restored is only adopted by the entrypoint when it
        is asked for ``active``, and a dumped tree is only noticed when reaped.) The process at the
        worker's pid must be the entrypoint's child: anything else there (entered into the pod's
        namespace while the worker slept) is a squatter on its pid, not the worker."""
        root = self.worker_root
        return root is not None and any(p.ns_pid == root and p.ppid == self.entrypoint for p in self.procs)

    @property
    def worker_root(self) -> NsPid | None:
        wp = self.info.get("worker_pid")
        return NsPid(int(wp)) if wp else None

    def ns_pid(self, host: HostPid) -> NsPid | None:
        return next((p.ns_pid for p in self.procs if p.pid == host), None)


def find_entrypoint(uid: PodUID, *, container_id: str | None = None, proc: Path = PROC) -> HostPid:
    """The host pid of the pod container's dynsnap-entrypoint (its pid namespace's PID 1).

    ``container_id`` (from the pod's containerStatuses) narrows the search to that container's
    cgroup when the runtime reports one. Raises WorkerNotFound or NotUnderEntrypoint.
    """
    members = procfs.pod_pids(uid, proc)
    if not members:
        raise WorkerNotFound(f"no process of pod {uid} runs on this node")
    inits = [p for p in members if (st := procfs.status(p, proc)) is not None and st.ns_pid == 1
             and len(st.nspid) > 1]
    if container_id:
        inits = _in_container(inits, container_id, proc)
    ours = [p for p in inits if procfs.exe_name(p, proc) == ENTRYPOINT_EXE]
    if len(ours) == 1:
        return ours[0]
    if not ours:
        names = sorted({procfs.exe_name(p, proc) or "?" for p in inits})
        raise NotUnderEntrypoint(f"pod {uid}: no container runs {ENTRYPOINT_EXE} as its PID 1 "
                                 f"(container init processes here: {', '.join(names) or 'none'})")
    raise NotUnderEntrypoint(f"pod {uid}: {len(ours)} containers run {ENTRYPOINT_EXE}; name the container")


def _in_container(inits: list[HostPid], container_id: str, proc: Path) -> list[HostPid]:
    """The init processes in the container the runtime reports (``containerd://<id>``, ``cri-o://<id>``,
    ``docker://<id>``), matched by the id their cgroup path names, whole (procfs.parse_pod_cgroup).
    Where no init's cgroup names a container at all (a layout neither driver makes), all of them stay:
    the entrypoint's own check decides then."""
    cid = container_id.split("://", 1)[-1]
    named = {p: procfs.container_ids(p, proc) for p in inits}
    if not any(named.values()):
        return inits
    found = [p for p in inits if cid in named[p]]
    if not found:
        raise WorkerNotFound(f"no process runs in container {cid[:12]} (the pod's status names it; "
                             f"its cgroups name {', '.join(sorted(c[:12] for ids in named.values() for c in ids))})")
    return found


def control_dir_of(entrypoint: HostPid, proc: Path = PROC) -> str:
    """The ``--control-dir`` the entrypoint was started with (its default otherwise), as it stands
    in its argv: not checked (:func:`dynsnap.agent.container.components` does that)."""
    try:
        argv = C.cmdline(entrypoint, proc=proc)
    except C.ContainerFileTooLarge as e:
        raise C.UnsafeContainerPath(f"the entrypoint's command line: {e}; its --control-dir is not read") from e
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == "--control-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--control-dir="):
            return a.split("=", 1)[1]
    return P.ENTRYPOINT_CONTROL_DIR


def is_gpu_process(pid: int, proc: Path = PROC) -> bool:
    """Maps the CUDA driver library, or maps/holds an NVIDIA device file."""
    for path in procfs.maps_paths(pid, proc):
        base = os.path.basename(path)
        if base.startswith("libcuda.so") or path.startswith(_NVIDIA_DEV):
            return True
    return any(t.startswith(_NVIDIA_DEV) for t in procfs.fd_targets(pid, proc))


def uses_nccl(pid: int, proc: Path = PROC) -> bool:
    return any(os.path.basename(p).startswith("libnccl") for p in procfs.maps_paths(pid, proc))


def locate(uid: PodUID, *, container_id: str | None = None, entrypoint: HostPid | None = None,
           proc: Path = PROC) -> WorkerProcs:
    """Everything the agent needs to know about the worker container of pod ``uid`` (or, given
    ``entrypoint``, of the container whose PID 1 that is: ``dynsnap agent exec --entrypoint-pid``)."""
    if entrypoint is not None:
        st = procfs.status(entrypoint, proc)
        if st is None:
            raise WorkerNotFound(f"no process {entrypoint}")
        if st.ns_pid != 1 or procfs.exe_name(entrypoint, proc) != ENTRYPOINT_EXE:
            raise NotUnderEntrypoint(f"process {entrypoint} is not {ENTRYPOINT_EXE} as PID 1 of its pid namespace")
        ep = entrypoint
    else:
        ep = find_entrypoint(uid, container_id=container_id, proc=proc)
    started = procfs.start_time(ep, proc)
    ns = procfs.pid_ns(ep, proc)
    if ns is None or started is None:
        raise WorkerNotFound(f"pod {uid}: its entrypoint {ep} exited while being looked at")
    try:  # only the namespaces the runtime made are ever entered (nsexec.py): refused before anything runs
        foreign = foreign_namespaces(ep, proc)
    except OSError as e:
        raise WorkerNotFound(f"pod {uid}: its entrypoint {ep} exited while being looked at ({e})") from e
    if foreign:
        raise ForeignNamespace(f"pod {uid}: {foreign}")
    control_dir = control_dir_of(ep, proc)
    C.components(control_dir)  # refused before anything is opened: a relative path, '..', a NUL
    root = proc / str(ep) / "root"
    try:
        info = EntrypointControl(control_dir, root=root, pinned=(ep, started), proc=proc).read()
    except EntrypointError as e:
        raise NotUnderEntrypoint(f"pod {uid}: {e}") from e
    except C.ContainerRefused as e:
        raise type(e)(f"pod {uid}: {e}") from e
    procs = tuple(st for st in procfs.in_pid_ns(ns, proc) if st.pid != ep and st.state not in ("Z", "X"))
    try:
        gpu = tuple(st.pid for st in procs if is_gpu_process(st.pid, proc))
    except procfs.ProcBoundExceeded as e:
        raise ProcessTooLarge(f"pod {uid}: {e}") from e
    gpu_start = {p: t for p in gpu if (t := procfs.start_time(p, proc)) is not None}
    return WorkerProcs(pod_uid=uid, entrypoint=ep, pidns=ns, control_dir=control_dir, info=info, procs=procs,
                       gpu=gpu, root=root, entrypoint_start=started, gpu_start=gpu_start, proc=proc)


def unsafe_multi_gpu(w: WorkerProcs, proc: Path = PROC) -> str | None:
    """Why the driver could not undo a checkpoint of these GPU processes, or None.

    Several GPU processes that use NCCL under any settings but those of NCCL_SAFE_ENVS were
    checkpointed and then could not be restored on the H200 pair, leaving the worker lost. Such a
    capture is refused before any lock. The reason names each rank's switches and the sets.
    """
    if len(w.gpu) < 2:
        return None
    problems = []
    for pid in w.gpu:
        if not uses_nccl(pid, proc):
            continue
        try:
            env = C.worker_env(pid, proc=proc)
        except C.ContainerFileTooLarge as e:  # its switches cannot be told: as good as unsafe
            problems.append(f"pid {pid}: {e}")
            continue
        if not any(all(env.nccl.get(k) == v for k, v in safe.items()) for safe in NCCL_SAFE_ENVS):
            have = " ".join(f"{k}={_switch(env.nccl, env.invalid, k)}" for k in NCCL_SWITCHES)
            problems.append(f"pid {pid}: {have}")
    if not problems:
        return None
    want, *others = (" ".join(f"{k}={v}" for k, v in safe.items()) for safe in NCCL_SAFE_ENVS)
    return (f"{len(w.gpu)} GPU processes use NCCL with settings the CUDA driver cannot restore after a "
            f"checkpoint ({'; '.join(problems)}); run the worker with {want}"
            + "".join(f" (or {o}, slower)" for o in others))


def _switch(nccl: dict[str, str], invalid: tuple[str, ...], key: str) -> str:
    return "(invalid)" if key in invalid else nccl.get(key, "(unset)")


def io_uring_holders(w: WorkerProcs, proc: Path = PROC) -> list[HostPid]:
    return [st.pid for st in w.procs if any("io_uring" in t for t in procfs.fd_targets(st.pid, proc))]


def gpu_outside_tree(w: WorkerProcs) -> list[NsPid]:
    """In-namespace pids of the container's GPU processes that are not in the worker's tree (the worker's
    root, the entrypoint's child at ``worker_pid``, and its descendants): what a CRIU dump of that tree
    would leave out, e.g. a daemon a launcher started before exec'ing the engine (reparented to the
    entrypoint). Empty while the entrypoint names no live worker (the dump step reports that)."""
    root = next((p for p in w.procs if p.ns_pid == w.worker_root and p.ppid == w.entrypoint), None)
    if root is None:
        return []
    tree = {root.pid}
    for _ in range(len(w.procs)):  # one generation per round: bounded by the number of processes
        more = {p.pid for p in w.procs if p.ppid in tree} - tree
        if not more:
            break
        tree |= more
    return sorted(p.ns_pid for p in w.procs if p.pid in w.gpu and p.pid not in tree)


def capabilities_beyond(w: WorkerProcs, proc: Path = PROC) -> dict[str, list[str]]:
    """Per process of the container (in-namespace pid), the capabilities any of its sets holds that this
    agent cannot give back: CRIU, started by the agent, holds the agent's permitted set at most. A set that
    cannot be read counts as holding every capability (refused, not guessed)."""
    own_sets = caps.sets("self", proc) or {}
    own = own_sets.get("CapPrm", 0) & own_sets.get("CapBnd", 0)
    beyond: dict[str, list[str]] = {}
    for st in w.procs:
        found = caps.sets(st.pid, proc)
        if found is None:
            if procfs.status(st.pid, proc) is None:  # gone since the look: nothing left to restore
                continue
            missing = ~own & ((1 << len(caps.NAMES)) - 1)
        else:
            missing = caps.union(found) & ~own
        if missing:
            beyond[str(st.ns_pid)] = caps.names(missing)
    return beyond


def pids_below_floor(w: WorkerProcs) -> list[NsPid]:
    return sorted(st.ns_pid for st in w.procs if st.ns_pid < P.PID_FLOOR)


def apiserver_endpoints(pid: int, proc: Path = PROC) -> list[tuple[str, int]]:
    """The API server addresses a worker process talks to, as its sockets see them: the in-cluster
    service (``KUBERNETES_SERVICE_HOST``/``_PORT``) and the server of a ``KUBECONFIG`` it uses (read
    through the container's root, at most KUBECONFIG_BOUND bytes). Every one is an IP address and a
    port 1-65535 (they become ``ss -K`` arguments): hostnames and anything else are skipped, a
    socket's peer is an address. Best effort: what cannot be read safely is left out and logged."""
    try:
        env = C.worker_env(pid, proc=proc)
    except C.ContainerFileTooLarge as e:
        log.warning("the API server endpoints of process %d: %s", pid, e)
        return []
    out: list[tuple[str, int]] = []
    if env.service_host is not None and env.service_port is not None:
        out.append((str(env.service_host), env.service_port))
    if env.kubeconfig:
        try:
            with C.ContainerRoot.of(pid, proc=proc) as root:
                raw = root.read(env.kubeconfig, limit=KUBECONFIG_BOUND, symlinks=True)
            cfg = yaml.safe_load(raw)
            for c in (cfg or {}).get("clusters") or []:
                out += _server_address(str((c.get("cluster") or {}).get("server", "")))
        except (OSError, ValueError, AttributeError, RecursionError, yaml.YAMLError, C.ContainerRefused) as e:
            log.warning("the kubeconfig of process %d: %s", pid, e)
    return sorted(set(out))


def _server_address(server: str) -> list[tuple[str, int]]:
    """A kubeconfig server URL's (IP address, port 1-65535), none for a hostname or a bad port."""
    try:
        u = urlsplit(server)
        port = u.port if u.port is not None else 443
        ip = ipaddress.ip_address(u.hostname or "")
    except ValueError:
        return []
    return [(str(ip), port)] if 1 <= port <= 65535 else []
