"""The steps of a capture, and of its rollback: quiesce (the preflight refusals, then the entrypoint to
``suspending``), save (every GPU process locked, then checkpointed, by one helper), the GPU rollback,
the settle to ``suspended``; for tier snapshot the dump (CRIU, into a staging directory that holds its
budget), the seal (the completeness guard, the manifest, the rename) and the settle to ``snapshotted``;
and the cleanup of images the worker no longer needs.

Layer: ``dynsnap.agent``. Each handler takes the executor (its helpers and bounds) and the call, does one
thing, records what it found in ``call.info``, and raises :class:`~dynsnap.agent.steps.StepFailure`.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from dynsnap.agent import engine_steps as G
from dynsnap.agent import netlock
from dynsnap.agent import worker as W
from dynsnap.agent.criu import CriuError, criu_dump, dump_completed, image_pids
from dynsnap.agent.cuda import CudaError
from dynsnap.agent.images import BudgetExceeded, dir_bytes, new_capture_id
from dynsnap.agent.nsexec import ForeignNamespace, TargetChanged
from dynsnap.agent.steps import GPU_FILE, PIDS_FILE, StepCall, StepFailure, pid_records
from dynsnap.models.ids import NsPid
from dynsnap.models.protocol import EntrypointState, Reason, Tier
from dynsnap.runtime import procfs

if TYPE_CHECKING:
    from dynsnap.agent.executor import Executor


async def cleanup(ex: Executor, c: StepCall) -> None:
    removed = ex.images.remove_pod(c.subject.uid)
    c.info["removed"] = [str(p) for p in removed]


async def quiesce(ex: Executor, c: StepCall) -> None:
    w = c.obs.worker
    if w.state == EntrypointState.ACTIVE:  # from suspended (deepening) the worker is out already
        why = await c.gate(w)
        if why:
            raise StepFailure(Reason.WORKER_SERVING, why, changed=False)
    try:  # /proc reads, off the event loop (bounded: procfs)
        unsafe = await asyncio.to_thread(W.unsafe_multi_gpu, w, ex.proc)
        if c.tier == Tier.SNAPSHOT and not unsafe:
            await asyncio.to_thread(snapshot_preflight, ex, w)
    except procfs.ProcBoundExceeded as e:
        raise StepFailure(Reason.PROCESS_TOO_LARGE, str(e), changed=False) from e
    if unsafe:
        raise StepFailure(Reason.UNSAFE_MULTI_GPU, unsafe, changed=False)
    if c.tier == Tier.ENGINE:
        c.info["engine"] = {"routes": await G.probe(ex, c)}
    if c.tier == Tier.SNAPSHOT:
        estimate = sum(procfs.rss_bytes(p.pid, ex.proc) for p in w.procs)
        ok, why = ex.images.room_for(estimate)
        if not ok:
            raise StepFailure(Reason.DISK_BUDGET_EXCEEDED, why, changed=False)
    c.info["pids"] = pid_records(w)
    # Routable: straight to its sleeping state, /health staying 200 (the pod stays Ready), no suspending.
    await ex.request(c.obs, EntrypointState.ROUTABLE if c.routable else EntrypointState.SUSPENDING)


def snapshot_preflight(ex: Executor, w: W.WorkerProcs) -> None:
    """The refusals only a snapshot needs, before anything changes."""
    if not w.info.get("pid_reserved"):
        raise StepFailure(Reason.PID_RESERVATION_MISSING, "the entrypoint could not reserve the pid range "
                          "(pid_reserved is false in its control file): a restore could collide with "
                          "the pod's own pids", changed=False)
    low = W.pids_below_floor(w)
    if low:
        raise StepFailure(Reason.PID_RESERVATION_MISSING, f"worker processes below the reserved floor: "
                          f"in-namespace pids {low}", changed=False)
    if w.info.get("seccomp") != "on":
        raise StepFailure(Reason.SECCOMP_OFF, f"the entrypoint's io_uring filter is {w.info.get('seccomp')!r}: "
                          "CRIU cannot dump io_uring", changed=False)
    rings = W.io_uring_holders(w, ex.proc)
    if rings:
        raise StepFailure(Reason.IO_URING_IN_USE, f"processes holding io_uring (CRIU cannot dump it): {rings}",
                          changed=False)
    beyond = W.capabilities_beyond(w, ex.proc)
    if beyond:
        raise StepFailure(Reason.CAPABILITIES_BEYOND_AGENT, f"capabilities the agent's container does not hold, "
                          f"so CRIU could not give them back at the restore: {beyond}", changed=False)
    outside = W.gpu_outside_tree(w)
    if outside:  # the seal's completeness guard would find them missing only after the dump ended the tree
        raise StepFailure(Reason.GPU_PROCESS_OUTSIDE_TREE, f"GPU processes outside the worker's tree (in-namespace "
                          f"pids): {outside}: CRIU dumps the worker's tree only, so a snapshot would leave them "
                          "out (tier suspend checkpoints every GPU process of the container)", changed=False)


async def save(ex: Executor, c: StepCall) -> None:
    pids = list(c.obs.gpu_states)
    try:
        # The helper reads each GPU's free memory around its own driver calls (no --mem-info
        # helpers before and after: 0.034 s each on the H200).
        records, gpus = await ex.cuda.action_measured("save", pids, marker=f"{c.subject.uid}/save",
                                                      starts=c.obs.worker.gpu_start)
    except CudaError as e:
        reason = Reason.HELPER_TIMEOUT if e.timed_out else Reason.CHECKPOINT_FAILED
        raise StepFailure(reason, str(e)) from e
    c.info["helper"] = records
    c.info["gpus"] = gpus
    c.info["pids"] = pid_records(c.obs.worker)  # also when an earlier agent's quiesce went unrecorded


async def gpu_rollback(ex: Executor, c: StepCall) -> None:
    try:
        after = await ex.cuda.rollback(list(c.obs.gpu_states), marker=f"{c.subject.uid}/rollback",
                                       starts=c.obs.worker.gpu_start)
    except CudaError as e:
        raise StepFailure(Reason.HELPER_TIMEOUT if e.timed_out else Reason.RESTORE_FAILED, str(e)) from e
    stuck = {p: s for p, s in after.items() if s not in ("running", "unknown")}
    if stuck:
        raise StepFailure(Reason.RESTORE_FAILED, f"GPU processes not running after rollback: {stuck}")
    c.info["states"] = {str(p): s for p, s in after.items()}


async def settle_suspended(ex: Executor, c: StepCall) -> None:
    await ex.request(c.obs, EntrypointState.SUSPENDED)


async def dump(ex: Executor, c: StepCall) -> None:
    w, subject = c.obs.worker, c.subject
    root = w.worker_root
    if root is None:
        raise StepFailure(Reason.DUMP_FAILED, "the entrypoint reports no worker pid")
    try:
        rings = await asyncio.to_thread(W.io_uring_holders, w, ex.proc)
    except procfs.ProcBoundExceeded as e:
        raise StepFailure(Reason.PROCESS_TOO_LARGE, str(e)) from e
    if rings:
        raise StepFailure(Reason.IO_URING_IN_USE, f"processes holding io_uring (CRIU cannot dump it): {rings}")
    estimate = sum(procfs.rss_bytes(p.pid, ex.proc) for p in w.procs)
    cut_off = ex.images.stagings(subject.uid)
    if cut_off:  # a dump that did not finish, from before: its network lock may stand (netlock.py)
        c.info["networkLockCleared"] = await netlock.clear(w.target, nsexec=ex.settings.nsexec)
    for old in cut_off:
        ex.images.remove(old)
    try:  # the check and the staging that holds the estimate out of the budget, in one step
        staging = ex.images.reserve(subject.namespace, subject.pod, subject.uid,
                                    c.capture_id or new_capture_id(), estimate)
    except BudgetExceeded as e:
        raise StepFailure(Reason.DISK_BUDGET_EXCEEDED, str(e)) from e
    # Resolve in-namespace pids now: the tree is gone after the dump, and CRIU names images by them.
    pids = pid_records(w)
    root_host = next((p.pid for p in w.procs if p.ns_pid == root), None)
    cmdline = procfs.cmdline(root_host, ex.proc) if root_host is not None else []
    (staging / PIDS_FILE).write_text(json.dumps({"root": root, "rootCmdline": cmdline,
                                                 "started": w.info.get("started"), "pids": pids}))
    c.info["pids"] = pids
    c.info["staging"] = str(staging)
    # What the checkpoint freed per GPU: a snapshot wake checks the GPUs have it again before
    # restoring. Read now from the helper's own records, keyed by host pid (a CRIU restore changes
    # them) and written by the helper itself: right also when the agent that ran the save died
    # before it learnt the outcome, and never a figure left from an earlier capture.
    (staging / GPU_FILE).write_text(json.dumps(ex.cuda.freed(list(c.obs.gpu_states))))
    try:
        res = await criu_dump(w.target, root, staging, opts=ex.criu_opts(subject), timeout=ex.settings.criu_timeout)
    except (ForeignNamespace, TargetChanged) as e:  # nothing ran: the tree runs on
        ex.images.remove(staging)
        reason = Reason.FOREIGN_NAMESPACE if isinstance(e, ForeignNamespace) else Reason.DUMP_FAILED
        raise StepFailure(reason, f"CRIU not started: {e}", changed=False) from e
    except CriuError as e:
        reason = {"no_space": Reason.DISK_FULL, "io_uring": Reason.IO_URING_IN_USE,
                  "timeout": Reason.HELPER_TIMEOUT}.get(e.cause, Reason.DUMP_FAILED)
        if not dump_completed(staging):
            # A CRIU that failed unlocked the network itself; one that was killed did not
            await netlock.clear(w.target, nsexec=ex.settings.nsexec)
            ex.images.remove(staging)  # never reused: CRIU left the tree running
        raise StepFailure(reason, f"CRIU dump failed ({e.cause}): {e.summary[:3000]}") from e
    c.info["criuSeconds"] = res.seconds
    c.info["imageBytes"] = dir_bytes(staging)


async def seal(ex: Executor, c: StepCall) -> None:
    staging = c.obs.staging
    assert staging is not None
    meta = json.loads((staging / PIDS_FILE).read_text())
    gpu_ns = {NsPid(p["ns"]) for p in meta["pids"] if p["gpu"]}
    missing = sorted(gpu_ns - image_pids(staging))
    if missing:  # a partial capture: its size would be the only other symptom
        reason = f"GPU processes missing from the images (in-namespace pids): {missing}"
        ex.images.reject(staging, reason)
        raise StepFailure(Reason.INCOMPLETE_CAPTURE, reason + "; restoring the worker from what was dumped")
    s = c.subject
    manifest = {"captureId": staging.name.removeprefix(".staging-"), "podUID": s.uid,
                "namespace": s.namespace, "pod": s.pod, "tier": c.tier.value,
                "created": datetime.now(UTC).isoformat(), "entrypointStarted": meta.get("started"),
                "rootNsPid": meta["root"], "rootCmdline": meta.get("rootCmdline"), "pids": meta["pids"],
                "bytes": dir_bytes(staging),
                "gpuFreed": json.loads((staging / GPU_FILE).read_text())}
    capture = ex.images.seal(staging, manifest)
    c.info["image"] = {"path": str(capture.path), "format": capture.manifest["format"],
                       "bytes": capture.manifest["bytes"]}


async def settle_snapshotted(ex: Executor, c: StepCall) -> None:
    await ex.request(c.obs, EntrypointState.SNAPSHOTTED)
