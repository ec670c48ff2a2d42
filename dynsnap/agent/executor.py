"""The executor: one step of one capture or wake of one worker, with every external action bounded
and every failure named. Callable without Kubernetes (``dynsnap agent exec``): the GPU machine
runs the same code as a node.

Layer: ``dynsnap.agent``. :meth:`Executor.observe` reads the node (``/proc``, the entrypoint's
control file, the driver's state of each GPU process, running helpers, the images on disk) into
:class:`~dynsnap.agent.plan.Facts`; :func:`~dynsnap.agent.plan.plan` picks the step;
:meth:`Executor.run_step` does it and returns a :class:`StepResult`. A refusal (a guard said no
before anything changed) and a failure (something broke mid-way; the next steps roll back) both
come back as a :class:`StepFailure` with a reason from ``models/protocol.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dynsnap.agent import worker as W
from dynsnap.agent.container import ContainerRefused
from dynsnap.agent.criu import (
    CriuError,
    CriuOptions,
    NamespaceTarget,
    criu_dump,
    criu_restore,
    dump_completed,
    image_pids,
)
from dynsnap.agent.cuda import CudaError, CudaHelper
from dynsnap.agent.entrypoint_control import EntrypointError
from dynsnap.agent.helpers import REGISTRY_DIR, HelperRegistry
from dynsnap.agent.images import BudgetExceeded, Capture, ImageFormatMismatch, ImageStore, dir_bytes, new_capture_id
from dynsnap.agent.plan import Facts, Staging, Step, observed, plan
from dynsnap.agent.settings import AgentSettings
from dynsnap.models.ids import HostPid, NsPid, PodUID
from dynsnap.models.protocol import DesiredState, EntrypointState, ObservedState, Reason, Tier
from dynsnap.runtime import procfs
from dynsnap.runtime.command import CommandError, find_tool, run_command
from dynsnap.runtime.procfs import PROC

log = logging.getLogger(__name__)
PIDS_FILE = "pids.json"  # written into a staging dir before the dump: the tree is gone afterwards
GPU_FILE = "gpu.json"  # GPU bytes the save freed, per GPU UUID

# Asked before a capture starts: None if the worker is out of serving, else why it is not.
ServingGate = Callable[["W.WorkerProcs"], Awaitable[str | None]]


class StepFailure(Exception):
    """A step refused (``changed`` False: nothing was touched) or failed mid-way."""

    def __init__(self, reason: Reason, message: str, *, changed: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.changed = changed


@dataclass(frozen=True)
class Subject:
    """The worker container to act on: its pod's identity (the UID is what finds it)."""

    namespace: str
    pod: str
    uid: PodUID
    container_id: str | None = None
    entrypoint: HostPid | None = None  # found by pod UID in /proc when None


@dataclass
class Observation:
    worker: W.WorkerProcs
    facts: Facts
    gpu_states: dict[HostPid, str]
    capture: Capture | None
    staging: Path | None

    @property
    def state(self) -> ObservedState:
        return observed(self.facts)


@dataclass
class StepResult:
    step: Step
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


async def _no_gate(_: W.WorkerProcs) -> str | None:
    return None


class Executor:
    def __init__(self, settings: AgentSettings, *, proc: Path = PROC) -> None:
        self.settings = settings
        self.proc = proc
        env = {"DYNSNAP_CUDA_STATE_DIR": str(settings.state_dir), **settings.cuda_env}
        # the helpers this agent (or an earlier agent process on this node) started and that still run
        self.helpers = HelperRegistry(settings.state_dir / REGISTRY_DIR, proc=proc)
        self.cuda = CudaHelper(settings.cuda_helper, env=env, lock_timeout_ms=settings.lock_timeout_ms,
                               timeout=settings.helper_timeout, registry=self.helpers)
        self.images = ImageStore(settings.images_root, budget_bytes=settings.images_budget_bytes)

    def _criu_opts(self, subject: Subject, w: W.WorkerProcs) -> CriuOptions:
        # By default CRIU gets no cuda-checkpoint on its PATH: the GPU processes are saved (every lock
        # before any checkpoint, one helper for all) before the dump and resumed after the restore by
        # the agent, so CRIU's CUDA plugin, which handles one pid per exec, has nothing to do.
        dirs = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(os.pathsep)
        if self.settings.criu_cuda_plugin:
            helper_dir = os.path.dirname(os.path.abspath(self.settings.cuda_helper))
            dirs = [helper_dir, *dirs]  # native/build holds cuda-checkpoint -> dynsnap-cuda
        else:
            dirs = [d for d in dirs if not os.path.exists(os.path.join(d, "cuda-checkpoint"))]
        return CriuOptions(binary=self.settings.criu, tcp_established=self.settings.tcp_established,
                           network_lock=self.settings.network_lock or None, path=os.pathsep.join(dirs),
                           libdir=self.settings.criu_libdir or None, workdir=w.control_dir,
                           env=self._criu_env(subject), on_spawn=self.helpers.spawned(f"{subject.uid}/criu"))

    def _criu_env(self, subject: Subject) -> dict[str, str]:
        env: dict[str, str] = {}  # nothing that names the helper: the registry knows it (helpers.py)
        if self.settings.criu_read_threads:  # else CRIU's own default (hack/patches/criu/0002)
            env["DYNSNAP_CRIU_READ_THREADS"] = str(self.settings.criu_read_threads)
        return env

    # -- observing --------------------------------------------------------------------------------

    async def observe(self, subject: Subject) -> Observation:
        w = W.locate(subject.uid, container_id=subject.container_id, entrypoint=subject.entrypoint, proc=self.proc)
        # While the entrypoint says suspended or snapshotted, the planner's next step is a request to
        # the entrypoint whatever the driver says (plan.py; tests/unit/test_agent_plan.py holds it to
        # that), so the driver is not asked: no helper process per GPU process on every look at a
        # sleeping worker (a --get-state took 0.169 s on the H200 while its cuInit was made at load,
        # 0.003 s since; docs/BENCHMARKS.md, "Issue 12 on the H200").
        asleep = w.state in (EntrypointState.SUSPENDED, EntrypointState.SNAPSHOTTED)
        states = await self.cuda.states(list(w.gpu)) if w.gpu and not asleep else {}
        # A GPU process the driver has no context for (it loaded the library, never initialised
        # it) has nothing to checkpoint; only processes with a state count.
        gpu_states = {p: s for p, s in states.items() if s != "unknown"}
        helpers = self.helpers.running(subject.uid)
        try:
            capture = self.images.latest(subject.uid)
        except ImageFormatMismatch:
            capture = None  # never reused; CLEANUP or GIVE_UP removes it
        if capture is not None and capture.manifest.get("entrypointStarted") != w.info.get("started"):
            capture = None  # taken from an earlier container of this pod: never restored into this one
        stagings = self.images.stagings(subject.uid)
        staging = stagings[-1] if stagings else None
        st = None
        if staging is not None:
            st = Staging(complete=dump_completed(staging), rejected=self.images.rejected(staging) is not None)
        ep_state = w.state
        alive = w.worker_alive and self._is_the_dumped_worker(w, capture, staging)
        active = ep_state == EntrypointState.ACTIVE and alive
        try:
            any_images = bool(self.images.captures(subject.uid)) or bool(stagings)
        except ImageFormatMismatch:
            any_images = True
        facts = Facts(ep_state=ep_state, worker_alive=alive, gpu_states=tuple(gpu_states.values()),
                      helper_running=bool(helpers), capture=capture is not None, staging=st,
                      leftovers=active and any_images)
        return Observation(worker=w, facts=facts, gpu_states=gpu_states, capture=capture, staging=staging)

    def _is_the_dumped_worker(self, w: W.WorkerProcs, capture: Capture | None, staging: Path | None) -> bool:
        """Whether the process at the worker's pid is the worker a dump took, when one did. A process
        that entered the pod's namespace while the worker slept can land on its pid and, orphaned,
        be the entrypoint's child too; it does not have the worker's command line. (A worker that
        was never dumped, or whose dump is gone, is taken as it is.)"""
        meta: dict[str, Any] = {}
        if capture is not None:
            meta = capture.manifest
        elif staging is not None:
            try:
                meta = json.loads((staging / PIDS_FILE).read_text())
            except (OSError, ValueError):
                meta = {}
        want = meta.get("rootCmdline")
        root = w.worker_root
        if not want or root is None:
            return True
        host = next((p.pid for p in w.procs if p.ns_pid == root), None)
        return host is not None and procfs.cmdline(host, self.proc) == want

    def next_step(self, obs: Observation, *, want: DesiredState, tier: Tier) -> Step:
        return plan(obs.facts, want=want, tier=tier)

    # -- doing ----------------------------------------------------------------------------------

    async def run_step(self, subject: Subject, obs: Observation, step: Step, *, tier: Tier,
                       gate: ServingGate = _no_gate, capture_id: str | None = None) -> StepResult:
        t0 = time.monotonic()
        info: dict[str, Any] = {}
        handler = getattr(self, "_" + step.value.replace("-", "_"))
        await handler(subject, obs, info=info, tier=tier, gate=gate, capture_id=capture_id)
        return StepResult(step=step, seconds=time.monotonic() - t0, info=info)

    async def _request(self, obs: Observation, state: EntrypointState) -> dict[str, Any]:
        try:
            return await obs.worker.control.request(state, timeout=self.settings.entrypoint_timeout)
        except ContainerRefused as e:  # its control directory or file turned unsafe or unreadable meanwhile
            raise StepFailure(e.reason, str(e)) from e
        except EntrypointError as e:
            raise StepFailure(Reason.ENTRYPOINT_UNRESPONSIVE, str(e)) from e

    async def _none(self, subject: Subject, obs: Observation, **_: Any) -> None:
        return None

    async def _wait_helper(self, subject: Subject, obs: Observation, **_: Any) -> None:
        bound = max(self.settings.criu_timeout, self.settings.helper_timeout)
        for h in self.helpers.running(subject.uid):
            if h.age > bound and self.helpers.kill(h):
                raise StepFailure(Reason.HELPER_TIMEOUT, f"{h.name} (pid {h.pid}, {h.label}) ran {h.age:.0f} s, past "
                                  f"its {bound:.0f} s bound; killed")

    async def _cleanup(self, subject: Subject, obs: Observation, *, info: dict[str, Any], **_: Any) -> None:
        removed = self.images.remove_pod(subject.uid)
        info["removed"] = [str(p) for p in removed]

    # capture

    async def _quiesce(self, subject: Subject, obs: Observation, *, info: dict[str, Any], tier: Tier,
                       gate: ServingGate, **_: Any) -> None:
        w = obs.worker
        if w.state == EntrypointState.ACTIVE:  # from suspended (deepening) the worker is out already
            why = await gate(w)
            if why:
                raise StepFailure(Reason.WORKER_SERVING, why, changed=False)
        unsafe = W.unsafe_multi_gpu(w, self.proc)
        if unsafe:
            raise StepFailure(Reason.UNSAFE_MULTI_GPU, unsafe, changed=False)
        if tier == Tier.SNAPSHOT:
            self._snapshot_preflight(w)
            estimate = sum(procfs.rss_bytes(p.pid, self.proc) for p in w.procs)
            ok, why = self.images.room_for(estimate)
            if not ok:
                raise StepFailure(Reason.DISK_BUDGET_EXCEEDED, why, changed=False)
        info["pids"] = self._pids(w)
        await self._request(obs, EntrypointState.SUSPENDING)

    def _snapshot_preflight(self, w: W.WorkerProcs) -> None:
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
        rings = W.io_uring_holders(w, self.proc)
        if rings:
            raise StepFailure(Reason.IO_URING_IN_USE, f"processes holding io_uring (CRIU cannot dump it): {rings}",
                              changed=False)

    async def _save(self, subject: Subject, obs: Observation, *, info: dict[str, Any], **_: Any) -> None:
        pids = list(obs.gpu_states)
        try:
            # The helper reads each GPU's free memory around its own driver calls (no --mem-info
            # helpers before and after: 0.034 s each on the H200).
            records, gpus = await self.cuda.action_measured("save", pids, marker=f"{subject.uid}/save")
        except CudaError as e:
            reason = Reason.HELPER_TIMEOUT if e.timed_out else Reason.CHECKPOINT_FAILED
            raise StepFailure(reason, str(e)) from e
        info["helper"] = records
        info["gpus"] = gpus
        info["pids"] = self._pids(obs.worker)  # also when an earlier agent's quiesce went unrecorded

    async def _gpu_rollback(self, subject: Subject, obs: Observation, *, info: dict[str, Any], **_: Any) -> None:
        try:
            after = await self.cuda.rollback(list(obs.gpu_states), marker=f"{subject.uid}/rollback")
        except CudaError as e:
            raise StepFailure(Reason.HELPER_TIMEOUT if e.timed_out else Reason.RESTORE_FAILED, str(e)) from e
        stuck = {p: s for p, s in after.items() if s not in ("running", "unknown")}
        if stuck:
            raise StepFailure(Reason.RESTORE_FAILED, f"GPU processes not running after rollback: {stuck}")
        info["states"] = {str(p): s for p, s in after.items()}

    async def _settle_suspended(self, subject: Subject, obs: Observation, **_: Any) -> None:
        await self._request(obs, EntrypointState.SUSPENDED)

    async def _dump(self, subject: Subject, obs: Observation, *, info: dict[str, Any], capture_id: str | None,
                    **_: Any) -> None:
        w = obs.worker
        root = w.worker_root
        if root is None:
            raise StepFailure(Reason.DUMP_FAILED, "the entrypoint reports no worker pid")
        rings = W.io_uring_holders(w, self.proc)
        if rings:
            raise StepFailure(Reason.IO_URING_IN_USE, f"processes holding io_uring (CRIU cannot dump it): {rings}")
        estimate = sum(procfs.rss_bytes(p.pid, self.proc) for p in w.procs)
        for old in self.images.stagings(subject.uid):  # a dump that did not finish, from before
            self.images.remove(old)
        try:  # the check and the staging that holds the estimate out of the budget, in one step
            staging = self.images.reserve(subject.namespace, subject.pod, subject.uid,
                                          capture_id or new_capture_id(), estimate)
        except BudgetExceeded as e:
            raise StepFailure(Reason.DISK_BUDGET_EXCEEDED, str(e)) from e
        # Resolve in-namespace pids now: the tree is gone after the dump, and CRIU names images by them.
        pids = self._pids(w)
        root_host = next((p.pid for p in w.procs if p.ns_pid == root), None)
        cmdline = procfs.cmdline(root_host, self.proc) if root_host is not None else []
        (staging / PIDS_FILE).write_text(json.dumps({"root": root, "rootCmdline": cmdline,
                                                     "started": w.info.get("started"), "pids": pids}))
        info["pids"] = pids
        info["staging"] = str(staging)
        # What the checkpoint freed per GPU: a snapshot wake checks the GPUs have it again before
        # restoring. Read now from the helper's own records, keyed by host pid (a CRIU restore changes
        # them) and written by the helper itself: right also when the agent that ran the save died
        # before it learnt the outcome, and never a figure left from an earlier capture.
        (staging / GPU_FILE).write_text(json.dumps(self.cuda.freed(list(obs.gpu_states))))
        try:
            res = await criu_dump(NamespaceTarget(w.entrypoint), root, staging, opts=self._criu_opts(subject, w),
                                  timeout=self.settings.criu_timeout)
        except CriuError as e:
            reason = {"no_space": Reason.DISK_FULL, "io_uring": Reason.IO_URING_IN_USE,
                      "timeout": Reason.HELPER_TIMEOUT}.get(e.cause, Reason.DUMP_FAILED)
            if not dump_completed(staging):
                self.images.remove(staging)  # never reused: CRIU left the tree running
            raise StepFailure(reason, f"CRIU dump failed ({e.cause}): {e.summary[-3000:]}") from e
        info["criuSeconds"] = res.seconds
        info["imageBytes"] = dir_bytes(staging)

    async def _seal(self, subject: Subject, obs: Observation, *, info: dict[str, Any], tier: Tier,
                    **_: Any) -> None:
        staging = obs.staging
        assert staging is not None
        meta = json.loads((staging / PIDS_FILE).read_text())
        gpu_ns = {NsPid(p["ns"]) for p in meta["pids"] if p["gpu"]}
        missing = sorted(gpu_ns - image_pids(staging))
        if missing:  # a partial capture: its size would be the only other symptom
            reason = f"GPU processes missing from the images (in-namespace pids): {missing}"
            self.images.reject(staging, reason)
            raise StepFailure(Reason.INCOMPLETE_CAPTURE, reason + "; restoring the worker from what was dumped")
        manifest = {"captureId": staging.name.removeprefix(".staging-"), "podUID": subject.uid,
                    "namespace": subject.namespace, "pod": subject.pod, "tier": tier.value,
                    "created": datetime.now(UTC).isoformat(), "entrypointStarted": meta.get("started"),
                    "rootNsPid": meta["root"], "rootCmdline": meta.get("rootCmdline"), "pids": meta["pids"],
                    "bytes": dir_bytes(staging),
                    "gpuFreed": json.loads((staging / GPU_FILE).read_text())}
        capture = self.images.seal(staging, manifest)
        info["image"] = {"path": str(capture.path), "format": capture.manifest["format"],
                         "bytes": capture.manifest["bytes"]}

    async def _settle_snapshotted(self, subject: Subject, obs: Observation, **_: Any) -> None:
        await self._request(obs, EntrypointState.SNAPSHOTTED)

    # wake

    async def _wake(self, subject: Subject, obs: Observation, **_: Any) -> None:
        await self._request(obs, EntrypointState.RESTORING)

    async def _restore(self, subject: Subject, obs: Observation, *, info: dict[str, Any], **_: Any) -> None:
        w = obs.worker
        source = obs.capture.path if obs.capture is not None else obs.staging
        if source is None:
            raise StepFailure(Reason.IMAGE_MISSING, "no capture of this container to restore from")
        meta = obs.capture.manifest if obs.capture is not None else json.loads((source / PIDS_FILE).read_text())
        if meta.get("started", meta.get("entrypointStarted")) != w.info.get("started"):
            raise StepFailure(Reason.IMAGE_MISSING, "the capture was taken from an earlier container of this pod")
        wanted = image_pids(source)
        taken = sorted(wanted & {p.ns_pid for p in w.procs})
        if taken:
            holders = [f"{p.ns_pid}:{p.name}" for p in w.procs if p.ns_pid in taken]
            raise StepFailure(Reason.PIDS_IN_USE, f"the capture's pids are taken in the pod's namespace: {holders}; "
                              "CRIU restores pids exactly", changed=False)
        need = self._gpu_need(meta)
        if need:
            free = {g.uuid: g.free for g in await self.cuda.mem_info() if g.free is not None}
            short = {u: (free[u], b) for u, b in need.items() if u in free and free[u] < b}
            if short:
                raise StepFailure(Reason.NOT_ENOUGH_GPU_MEMORY, "GPU free memory below what the capture freed: " +
                                  ", ".join(f"{u}: {f} < {b} bytes" for u, (f, b) in short.items()), changed=False)
        try:
            res = await criu_restore(NamespaceTarget(w.entrypoint), source, opts=self._criu_opts(subject, w),
                                     timeout=self.settings.criu_timeout)
        except CriuError as e:
            reason = {"pid_taken": Reason.PIDS_IN_USE, "timeout": Reason.HELPER_TIMEOUT}.get(
                e.cause, Reason.CRIU_RESTORE_FAILED)
            raise StepFailure(reason, f"CRIU restore failed ({e.cause}): {e.summary[-3000:]}") from e
        info["criuSeconds"] = res.seconds
        info["source"] = str(source)
        # How CRIU read the pages back: threads (hack/patches/criu/0002) or stock's loop (None)
        info["pagesRead"] = vars(res.pages_read) if res.pages_read else None
        slept = _seconds_since(meta.get("created"))
        limit = self.settings.reset_apiserver_connections_after
        if limit and slept is not None and slept > limit:
            info["apiserverConnectionsReset"] = await self._reset_apiserver_connections(w, NsPid(res.pid))

    async def _reset_apiserver_connections(self, w: W.WorkerProcs, root: NsPid) -> int:
        """Reset the restored worker's TCP connections to the API server (``ss -K`` in the pod's network
        namespace): after a long sleep they are half-open. Its client sees ECONNABORTED and watches again
        at once. Best effort: a failure here leaves the worker serving, and its client's own read timeout
        heals it later."""
        host = procfs.host_pid_of(root, ns_inode=w.pidns, proc=self.proc)
        if host is None:
            return 0
        killed = 0
        for ip, port in W.apiserver_endpoints(host, self.proc):  # IP addresses and ports 1-65535 only
            dst = f"[{ip}]" if ":" in ip else ip  # ss reads a bare IPv6 address as a prefix and fails
            argv = [find_tool("nsenter"), "-t", str(w.entrypoint), "-n", "--", find_tool("ss"), "-K", "-t", "-n",
                    "dst", dst, "dport", "=", str(port)]
            try:
                res = await run_command(argv, timeout=10.0, check=False)
            except CommandError as e:
                log.warning("resetting the worker's API-server connections: %s", e)
                continue
            killed += sum(1 for line in res.stdout.splitlines()[1:] if line.strip())
        log.info("reset %d connection(s) of the woken worker to the API server", killed)
        return killed

    @staticmethod
    def _gpu_need(meta: dict[str, Any]) -> dict[str, int]:
        return {str(u): int(b) for u, b in (meta.get("gpuFreed") or {}).items() if int(b) > 0}

    async def _resume(self, subject: Subject, obs: Observation, *, info: dict[str, Any], **_: Any) -> None:
        pids = [p for p, s in obs.gpu_states.items() if s == "checkpointed"]
        extra: list[str] = []
        if obs.capture is not None:  # after a CRIU restore the pids are new: the helper has no record of them
            need = self._gpu_need(obs.capture.manifest)
            if need:
                extra = ["--need-bytes", str(max(need.values()))]
        try:  # free memory before and after: read by the helper itself (see _save)
            info["helper"], info["gpus"] = await self.cuda.action_measured(
                "resume", pids, marker=f"{subject.uid}/resume", extra=extra)
        except CudaError as e:
            if e.refused_memory:
                raise StepFailure(Reason.NOT_ENOUGH_GPU_MEMORY, str(e), changed=False) from e
            raise StepFailure(Reason.HELPER_TIMEOUT if e.timed_out else Reason.RESTORE_FAILED, str(e)) from e

    async def _unlock(self, subject: Subject, obs: Observation, **_: Any) -> None:
        pids = [p for p, s in obs.gpu_states.items() if s == "locked"]
        try:
            await self.cuda.action("unlock", pids, marker=f"{subject.uid}/unlock")
        except CudaError as e:
            raise StepFailure(Reason.HELPER_TIMEOUT if e.timed_out else Reason.RESTORE_FAILED, str(e)) from e

    async def _settle_active(self, subject: Subject, obs: Observation, **_: Any) -> None:
        await self._request(obs, EntrypointState.ACTIVE)

    async def _give_up(self, subject: Subject, obs: Observation, **_: Any) -> None:
        # The tree is gone and nothing can bring it back in place: `active` with no worker makes
        # the entrypoint exit 75, and kubelet starts the container cold. Said loudly, never hidden.
        with contextlib.suppress(EntrypointError, ContainerRefused):  # it exits instead of acknowledging: the point
            await obs.worker.control.request(EntrypointState.ACTIVE, timeout=self.settings.entrypoint_timeout)
        raise StepFailure(Reason.WORKER_LOST, "the worker tree is gone and no capture can restore it in place: "
                          "the container restarts cold")

    # helpers

    def _pids(self, w: W.WorkerProcs) -> list[dict[str, Any]]:
        gpu = set(w.gpu)
        return [{"host": p.pid, "ns": p.ns_pid, "gpu": p.pid in gpu} for p in w.procs]


def _seconds_since(iso: Any) -> float | None:
    try:
        return (datetime.now(UTC) - datetime.fromisoformat(str(iso))).total_seconds()
    except (TypeError, ValueError):
        return None
