"""Finding a worker on this node from its pod UID, the way a node agent with hostPID can:
the pod's processes carry its UID in their cgroup path; the container's PID 1 is
dynsnap-entrypoint (its in-namespace pid is 1 and its executable says so); its control
directory is reached through ``/proc/<entrypoint>/root`` (no volume for the agent); the worker
tree is every other process of that pid namespace; GPU processes are those that map the CUDA
driver or hold an NVIDIA device open.

Layer: ``dynsnap.agent``. Everything here only reads ``/proc`` and the control file.

    WorkerNotFound       no process of the pod runs here (pod elsewhere, or gone)
    NotUnderEntrypoint   the pod runs here, but not under dynsnap-entrypoint (refused)
"""

from __future__ import annotations

import ipaddress
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from dynsnap.agent.entrypoint_control import EntrypointControl, EntrypointError
from dynsnap.models import protocol as P
from dynsnap.models.ids import HostPid, NsPid, PodUID
from dynsnap.runtime import procfs
from dynsnap.runtime.procfs import PROC, ProcStatus

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
NCCL_SWITCHES = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_CUMEM_ENABLE")


class WorkerNotFound(LookupError):
    """No process of this pod runs on this node."""


class NotUnderEntrypoint(LookupError):
    """The pod's container does not run dynsnap-entrypoint as its PID 1."""


@dataclass(frozen=True)
class WorkerProcs:
    """One worker container, as the node sees it right now."""

    pod_uid: PodUID
    entrypoint: HostPid  # the container's PID 1
    pidns: int  # inode of the container's pid namespace
    control_dir: Path  # the entrypoint's control directory, reached from the node
    info: dict[str, Any]  # the entrypoint's control file (entrypoint.json)
    procs: tuple[ProcStatus, ...]  # every process of the pid namespace but PID 1
    gpu: tuple[HostPid, ...]  # those that map the CUDA driver or hold an NVIDIA device

    @property
    def control(self) -> EntrypointControl:
        return EntrypointControl(self.control_dir)

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
        cid = container_id.split("://", 1)[-1]
        narrowed = [p for p in inits if any(cid in c for c in procfs.cgroup_paths(p, proc))]
        inits = narrowed or inits
    ours = [p for p in inits if procfs.exe_name(p, proc) == ENTRYPOINT_EXE]
    if len(ours) == 1:
        return ours[0]
    if not ours:
        names = sorted({procfs.exe_name(p, proc) or "?" for p in inits})
        raise NotUnderEntrypoint(f"pod {uid}: no container runs {ENTRYPOINT_EXE} as its PID 1 "
                                 f"(container init processes here: {', '.join(names) or 'none'})")
    raise NotUnderEntrypoint(f"pod {uid}: {len(ours)} containers run {ENTRYPOINT_EXE}; name the container")


def control_dir_of(entrypoint: HostPid, proc: Path = PROC) -> str:
    """The ``--control-dir`` the entrypoint was started with (its default otherwise)."""
    argv = procfs.cmdline(entrypoint, proc)
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
    ns = procfs.pid_ns(ep, proc)
    if ns is None:
        raise WorkerNotFound(f"pod {uid}: its entrypoint {ep} exited while being looked at")
    control_dir = procfs.root_path(ep, control_dir_of(ep, proc), proc)
    try:
        info = EntrypointControl(control_dir).read()
    except EntrypointError as e:
        raise NotUnderEntrypoint(f"pod {uid}: {e}") from e
    procs = tuple(st for st in procfs.in_pid_ns(ns, proc) if st.pid != ep and st.state not in ("Z", "X"))
    gpu = tuple(st.pid for st in procs if is_gpu_process(st.pid, proc))
    return WorkerProcs(pod_uid=uid, entrypoint=ep, pidns=ns, control_dir=control_dir, info=info, procs=procs,
                       gpu=gpu)


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
        env = procfs.environ(pid, proc)
        if not any(all(env.get(k) == v for k, v in safe.items()) for safe in NCCL_SAFE_ENVS):
            have = " ".join(f"{k}={env.get(k, '(unset)')}" for k in NCCL_SWITCHES)
            problems.append(f"pid {pid}: {have}")
    if not problems:
        return None
    want, *others = (" ".join(f"{k}={v}" for k, v in safe.items()) for safe in NCCL_SAFE_ENVS)
    return (f"{len(w.gpu)} GPU processes use NCCL with settings the CUDA driver cannot restore after a "
            f"checkpoint ({'; '.join(problems)}); run the worker with {want}"
            + "".join(f" (or {o}, slower)" for o in others))


def io_uring_holders(w: WorkerProcs, proc: Path = PROC) -> list[HostPid]:
    return [st.pid for st in w.procs if any("io_uring" in t for t in procfs.fd_targets(st.pid, proc))]


def pids_below_floor(w: WorkerProcs) -> list[NsPid]:
    return sorted(st.ns_pid for st in w.procs if st.ns_pid < P.PID_FLOOR)


@dataclass(frozen=True)
class RunningHelper:
    pid: HostPid
    name: str
    marker: str
    age: float  # seconds since it started


def running_helpers(uid: PodUID, proc: Path = PROC) -> list[RunningHelper]:
    """CRIU or dynsnap-cuda processes an agent started for this pod that still run (found by
    the ``DYNSNAP_OP=<pod uid>/...`` marker in their environment), e.g. after the agent died."""
    out = []
    boot = _boot_time(proc)
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in procfs.pids(proc):
        marker = procfs.environ(pid, proc).get("DYNSNAP_OP", "")
        if not marker.startswith(f"{uid}/"):
            continue
        st = procfs.status(pid, proc)
        if st is None or st.state in ("Z", "X"):
            continue
        started = _start_ticks(pid, proc)
        age = time.time() - (boot + started / ticks) if started is not None and boot else 0.0
        out.append(RunningHelper(pid=pid, name=st.name, marker=marker, age=max(age, 0.0)))
    return out


def _boot_time(proc: Path) -> float:
    try:
        for line in (proc / "stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def _start_ticks(pid: int, proc: Path) -> int | None:
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])  # field 22 (starttime), counted after the ")" of comm
    except (IndexError, ValueError):
        return None


def apiserver_endpoints(pid: int, proc: Path = PROC) -> list[tuple[str, int]]:
    """The API server addresses a worker process talks to, as its sockets see them: the in-cluster
    service (``KUBERNETES_SERVICE_HOST``/``_PORT``) and the server of a ``KUBECONFIG`` it uses (read
    through its root). Hostnames are skipped: a socket's peer is an address."""
    env = procfs.environ(pid, proc)
    out: list[tuple[str, int]] = []
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if host and port and port.isdigit():
        out.append((host.strip("[]"), int(port)))
    if env.get("KUBECONFIG"):
        try:
            cfg = yaml.safe_load(procfs.root_path(pid, env["KUBECONFIG"].split(":")[0], proc).read_text())
            for c in (cfg or {}).get("clusters") or []:
                u = urlsplit(str((c.get("cluster") or {}).get("server", "")))
                if u.hostname and _is_address(u.hostname):
                    out.append((u.hostname, u.port or 443))
        except (OSError, ValueError, yaml.YAMLError):
            pass
    return sorted(set(out))


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
