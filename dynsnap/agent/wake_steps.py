"""The steps of a wake: the entrypoint to ``restoring``; for tier snapshot the restore (CRIU puts the
tree back into the same pod, at the same pids, after the pid and free-GPU-memory checks; every restored
process must then be in the container's cgroups, or the tree is killed; after a long sleep the worker's
API-server connections are reset); the resume (restore + unlock of every GPU process
by one helper) or the unlock of processes left locked; the settle to ``active``; and, when nothing can
bring the worker back in place, the give-up.

Layer: ``dynsnap.agent``. Each handler takes the executor (its helpers and bounds) and the call, does one
thing, records what it found in ``call.info``, and raises :class:`~dynsnap.agent.steps.StepFailure`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynsnap.agent import cgroup_check as CG
from dynsnap.agent import worker as W
from dynsnap.agent.container import ContainerRefused
from dynsnap.agent.criu import CriuError, criu_restore, image_pids
from dynsnap.agent.cuda import CudaError
from dynsnap.agent.entrypoint_control import EntrypointError
from dynsnap.agent.nsexec import ForeignNamespace, TargetChanged, run_in
from dynsnap.agent.steps import PIDS_FILE, RESTORE_MARKER, StepCall, StepFailure
from dynsnap.models.ids import HostPid, NsPid
from dynsnap.models.protocol import EntrypointState, Reason
from dynsnap.runtime import procfs
from dynsnap.runtime.command import CommandError, find_tool

if TYPE_CHECKING:
    from dynsnap.agent.executor import Executor

log = logging.getLogger(__name__)

# A tree restored outside its container: killed in at most this many rounds (each lists it again),
# and this many of its misplaced hierarchies named in the failure.
KILL_ROUNDS = 3
MISPLACED_SHOWN = 8


async def wake(ex: Executor, c: StepCall) -> None:
    await ex.request(c.obs, EntrypointState.RESTORING)


def gpu_need(meta: dict[str, Any]) -> dict[str, int]:
    """The GPU bytes a capture freed, per GPU UUID: what a wake needs free again."""
    return {str(u): int(b) for u, b in (meta.get("gpuFreed") or {}).items() if int(b) > 0}


async def restore(ex: Executor, c: StepCall) -> None:
    w, obs = c.obs.worker, c.obs
    source = obs.capture.path if obs.capture is not None else obs.staging
    if source is None:
        raise StepFailure(Reason.IMAGE_MISSING, "no capture of this container to restore from")
    meta = obs.capture.manifest if obs.capture is not None else json.loads((source / PIDS_FILE).read_text())
    if meta.get("started", meta.get("entrypointStarted")) != w.info.get("started"):
        raise StepFailure(Reason.IMAGE_MISSING, "the capture was taken from an earlier container of this pod")
    wanted = image_pids(source)
    gone = await clear_cut_off_restore(ex, c, w, source)
    taken = sorted(wanted & {p.ns_pid for p in w.procs if p.pid not in gone})
    if taken:
        holders = [f"{p.ns_pid}:{p.name}" for p in w.procs if p.ns_pid in taken]
        raise StepFailure(Reason.PIDS_IN_USE, f"the capture's pids are taken in the pod's namespace: {holders}; "
                          "CRIU restores pids exactly", changed=False)
    need = gpu_need(meta)
    if need:
        free = {g.uuid: g.free for g in await ex.cuda.mem_info() if g.free is not None}
        short = {u: (free[u], b) for u, b in need.items() if u in free and free[u] < b}
        if short:
            raise StepFailure(Reason.NOT_ENOUGH_GPU_MEMORY, "GPU free memory below what the capture freed: " +
                              ", ".join(f"{u}: {f} < {b} bytes" for u, (f, b) in short.items()), changed=False)
    marker = source / RESTORE_MARKER
    marker.write_text(str(procfs.uptime_ticks(ex.proc)))
    try:
        res = await criu_restore(w.target, source, opts=ex.criu_opts(c.subject), timeout=ex.settings.criu_timeout)
    except (ForeignNamespace, TargetChanged) as e:  # nothing ran: the capture stays to restore from
        marker.unlink(missing_ok=True)
        reason = Reason.FOREIGN_NAMESPACE if isinstance(e, ForeignNamespace) else Reason.CRIU_RESTORE_FAILED
        raise StepFailure(reason, f"CRIU not started: {e}", changed=False) from e
    except CriuError as e:
        reason = {"pid_taken": Reason.PIDS_IN_USE, "timeout": Reason.HELPER_TIMEOUT}.get(
            e.cause, Reason.CRIU_RESTORE_FAILED)
        raise StepFailure(reason, f"CRIU restore failed ({e.cause}): {e.summary[:3000]}") from e
    marker.unlink(missing_ok=True)  # the tree is whole: from here on it is the worker
    c.info["criuSeconds"] = res.seconds
    c.info["source"] = str(source)
    # How CRIU read the pages back: threads (hack/patches/criu/0002) or stock's loop (None)
    c.info["pagesRead"] = vars(res.pages_read) if res.pages_read else None
    await in_container_or_killed(ex, c, w, NsPid(res.pid))
    slept = _seconds_since(meta.get("created"))
    limit = ex.settings.reset_apiserver_connections_after
    if limit and slept is not None and slept > limit:
        c.info["apiserverConnectionsReset"] = await reset_apiserver_connections(ex, w, NsPid(res.pid))


async def clear_cut_off_restore(ex: Executor, c: StepCall, w: W.WorkerProcs, source: Path) -> set[HostPid]:
    """What a cut-off restore left (:data:`~dynsnap.agent.steps.RESTORE_MARKER` standing), killed: every
    process of the pod's pid namespace started since that restore began. A CRIU killed mid-restore (by the
    pod, which sees it in its namespace, by its bound, by the OOM killer) leaves tasks it had made, stopped
    in its restorer or gone, holding the capture's pids: without this every restore after it is refused
    ``PidsInUse``. Anything older is no part of it and is left (the pid check refuses it by name). The host
    pids killed (``call.info["remnantsKilled"]``); the marker goes once they are."""
    marker = source / RESTORE_MARKER
    try:
        began = int(marker.read_text().strip())
    except FileNotFoundError:
        return set()
    except (OSError, ValueError):  # unreadable (the agent's own file): nothing told apart, nothing killed
        marker.unlink(missing_ok=True)
        return set()
    remnants = [p for p in w.procs if (procfs.start_time(p.pid, ex.proc) or 0) >= began]
    killed = await ex.kill_tree(w, remnants) if remnants else []
    c.info["remnantsKilled"] = [{"pid": p.ns_pid, "name": p.name} for p in remnants if p.pid in killed]
    if killed:
        log.warning("%s/%s: killed what a cut-off restore left (in-namespace pids %s)", c.subject.namespace,
                    c.subject.pod, sorted(p.ns_pid for p in remnants if p.pid in killed))
    marker.unlink(missing_ok=True)
    return set(killed)


async def in_container_or_killed(ex: Executor, c: StepCall, w: W.WorkerProcs, root: NsPid) -> None:
    """Every process of the tree just restored (its root at ``root`` in the pod's pid namespace, and
    every process the restore added there) in the container's cgroups (:mod:`dynsnap.agent.cgroup_check`),
    or the tree is killed and the step fails (``RestoredOutsideContainer``): a worker that escaped its
    container's memory and pids limits is never woken. The capture is kept, so the worker stays
    restorable (the entrypoint stays ``restoring``, the tree gone: the planner's next step is this
    restore again, after the failure backoff). ``cgroupsChecked``: how many processes were compared
    (none when the restored tree has exited already: the next look sees it gone)."""
    tree = CG.restored(w, root, ex.proc)
    wrong = CG.check(w.entrypoint, [p.pid for p in tree], ex.proc) if tree else []
    c.info["cgroupsChecked"] = len(tree)
    if not wrong:
        return
    killed: list[HostPid] = []
    for _ in range(KILL_ROUNDS):  # a child forked before its parent died is orphaned, not killed with it
        if not tree:
            break
        killed += await ex.kill_tree(w, tree)
        tree = CG.restored(w, root, ex.proc)
    shown = "; ".join(wrong[:MISPLACED_SHOWN]) + (f"; and {len(wrong) - MISPLACED_SHOWN} more"
                                                 if len(wrong) > MISPLACED_SHOWN else "")
    left = f"; {len(tree)} still running ({', '.join(str(p.pid) for p in tree)})" if tree else ""
    raise StepFailure(Reason.RESTORED_OUTSIDE_CONTAINER,
                      f"the restored tree (root {root} in the pod's pid namespace) runs outside its container's "
                      f"cgroups (those of the container's PID 1, host pid {w.entrypoint}): {shown}. Killed "
                      f"(SIGKILL): host pids {sorted(set(killed))}{left}; the capture is kept to restore from")


async def reset_apiserver_connections(ex: Executor, w: W.WorkerProcs, root: NsPid) -> int:
    """Reset the restored worker's TCP connections to the API server (``ss -K`` in the pod's network
    namespace): after a long sleep they are half-open. Its client sees ECONNABORTED and watches again
    at once. Best effort: a failure here leaves the worker serving, and its client's own read timeout
    heals it later."""
    host = procfs.host_pid_of(root, ns_inode=w.pidns, proc=ex.proc)
    if host is None:
        return 0
    killed = 0
    for ip, port in W.apiserver_endpoints(host, ex.proc):  # IP addresses and ports 1-65535 only
        dst = f"[{ip}]" if ":" in ip else ip  # ss reads a bare IPv6 address as a prefix and fails
        # ss is the agent's, run in the pod's network namespace alone (dynsnap-nsexec: never its mount namespace)
        argv = [find_tool("ss"), "-K", "-t", "-n", "dst", dst, "dport", "=", str(port)]
        try:
            res = await run_in(w.target, argv, timeout=10.0, namespaces=("net",), nsexec=ex.settings.nsexec)
        except (CommandError, ForeignNamespace, TargetChanged, OSError) as e:
            log.warning("resetting the worker's API-server connections: %s", e)
            continue
        killed += sum(1 for line in res.stdout.splitlines()[1:] if line.strip())
    log.info("reset %d connection(s) of the woken worker to the API server", killed)
    return killed


async def resume(ex: Executor, c: StepCall) -> None:
    obs = c.obs
    pids = [p for p, s in obs.gpu_states.items() if s == "checkpointed"]
    extra: list[str] = []
    if obs.capture is not None:  # after a CRIU restore the pids are new: the helper has no record of them
        need = gpu_need(obs.capture.manifest)
        if need:
            extra = ["--need-bytes", str(max(need.values()))]
    try:  # free memory before and after: read by the helper itself (see capture_steps.save)
        c.info["helper"], c.info["gpus"] = await ex.cuda.action_measured(
            "resume", pids, marker=f"{c.subject.uid}/resume", extra=extra, starts=obs.worker.gpu_start)
    except CudaError as e:
        if e.refused_memory:
            raise StepFailure(Reason.NOT_ENOUGH_GPU_MEMORY, str(e), changed=False) from e
        raise StepFailure(Reason.HELPER_TIMEOUT if e.timed_out else Reason.RESTORE_FAILED, str(e)) from e


async def unlock(ex: Executor, c: StepCall) -> None:
    pids = [p for p, s in c.obs.gpu_states.items() if s == "locked"]
    try:
        await ex.cuda.action("unlock", pids, marker=f"{c.subject.uid}/unlock", starts=c.obs.worker.gpu_start)
    except CudaError as e:
        raise StepFailure(Reason.HELPER_TIMEOUT if e.timed_out else Reason.RESTORE_FAILED, str(e)) from e


async def settle_active(ex: Executor, c: StepCall) -> None:
    await ex.request(c.obs, EntrypointState.ACTIVE)


async def give_up(ex: Executor, c: StepCall) -> None:
    # The tree is gone and nothing can bring it back in place: `active` with no worker makes
    # the entrypoint exit 75, and kubelet starts the container cold. Said loudly, never hidden.
    with contextlib.suppress(EntrypointError, ContainerRefused):  # it exits instead of acknowledging: the point
        await c.obs.worker.control.request(EntrypointState.ACTIVE, timeout=ex.settings.entrypoint_timeout)
    raise StepFailure(Reason.WORKER_LOST, "the worker tree is gone and no capture can restore it in place: "
                      "the container restarts cold")


def _seconds_since(iso: Any) -> float | None:
    try:
        return (datetime.now(UTC) - datetime.fromisoformat(str(iso))).total_seconds()
    except (TypeError, ValueError):
        return None
