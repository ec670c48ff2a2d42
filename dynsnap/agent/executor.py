"""The executor: one step of one capture or wake of one worker, with every external action bounded
and every failure named. Callable without Kubernetes (``dynsnap agent exec``): the GPU machine
runs the same code as a node.

Layer: ``dynsnap.agent``. :meth:`Executor.observe` reads the node (``/proc``, the entrypoint's
control file, the driver's state of each GPU process, running helpers, the images on disk) into
:class:`~dynsnap.agent.plan.Facts`; :func:`~dynsnap.agent.plan.plan` picks the step;
:meth:`Executor.run_step` runs that step's handler from :data:`HANDLERS` (capture_steps.py,
wake_steps.py: one typed table, every :class:`~dynsnap.agent.plan.Step` in it) and returns a
:class:`StepResult`. A refusal (a guard said no before anything changed) and a failure (something
broke mid-way; the next steps roll back) both come back as a :class:`StepFailure` with a reason from
``models/protocol.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from dynsnap.agent import capture_steps as C
from dynsnap.agent import engine_steps as G
from dynsnap.agent import wake_steps as K
from dynsnap.agent import worker as W
from dynsnap.agent.container import ContainerRefused
from dynsnap.agent.criu import CriuOptions, dump_completed, restore_completed
from dynsnap.agent.cuda import CudaHelper
from dynsnap.agent.engine_routes import EngineRouteError, EngineRoutes, EngineRoutesMissing, EngineRouteTimeout
from dynsnap.agent.entrypoint_control import EntrypointError
from dynsnap.agent.helpers import REGISTRY_DIR, HelperRegistry
from dynsnap.agent.images import Capture, ImageFormatMismatch, ImageStore
from dynsnap.agent.plan import Facts, Staging, Step, plan
from dynsnap.agent.settings import AgentSettings
from dynsnap.agent.steps import (
    GPU_FILE,
    PIDS_FILE,
    RESTORE_MARKER,
    Observation,
    ServingGate,
    StepCall,
    StepFailure,
    StepResult,
    Subject,
    no_gate,
)
from dynsnap.models.ids import HostPid
from dynsnap.models.protocol import DesiredState, EntrypointState, Reason, Tier
from dynsnap.runtime import procfs
from dynsnap.runtime.procfs import PROC

__all__ = ["GPU_FILE", "HANDLERS", "PIDS_FILE", "Executor", "Observation", "ServingGate", "StepFailure",
           "StepResult", "Subject"]

log = logging.getLogger(__name__)

StepHandler = Callable[["Executor", StepCall], Awaitable[None]]
# How long a killed tree is waited for (SIGKILL ends a process at once unless it is stuck in the kernel).
KILL_WAIT = 10.0


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

    def criu_opts(self, subject: Subject) -> CriuOptions:
        # By default CRIU's PATH is empty (criu.py): the GPU processes are saved (every lock before any
        # checkpoint, one helper for all) before the dump and resumed after the restore by the agent, so CRIU's
        # CUDA plugin, which handles one pid per exec, finds no cuda-checkpoint and stands aside. With the plugin
        # on, CRIU's PATH is the helper's directory (native/build holds cuda-checkpoint -> dynsnap-cuda): the
        # agent's files, where CRIU runs (never the worker's).
        path = None
        if self.settings.criu_cuda_plugin:
            helper = shutil.which(self.settings.cuda_helper) or self.settings.cuda_helper
            path = os.path.dirname(os.path.abspath(helper))
        return CriuOptions(binary=self.settings.criu, tcp_established=self.settings.tcp_established,
                           network_lock=self.settings.network_lock or None, path=path,
                           libdir=self.settings.criu_libdir or None,
                           nsexec=self.settings.nsexec, env=self._criu_env(subject),
                           on_spawn=self.helpers.spawned(f"{subject.uid}/criu"))

    def _criu_env(self, subject: Subject) -> dict[str, str]:
        env: dict[str, str] = {}  # nothing that names the helper: the registry knows it (helpers.py)
        if self.settings.criu_read_threads:  # else CRIU's own default (hack/patches/criu/0002)
            env["DYNSNAP_CRIU_READ_THREADS"] = str(self.settings.criu_read_threads)
        return env

    # -- observing --------------------------------------------------------------------------------

    async def observe(self, subject: Subject) -> Observation:
        # /proc reads (every process of the node, each of the container's maps and descriptors: bounded by
        # procfs), off the event loop that also answers the agent's health checks and other pods' reconciles.
        w = await asyncio.to_thread(W.locate, subject.uid, container_id=subject.container_id,
                                    entrypoint=subject.entrypoint, proc=self.proc)
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
        source = capture.path if capture is not None else staging if st is not None and st.rejected else None
        # (a restore whose CRIU finished while no agent watched left its marker too: its tree is whole)
        cut_off = source is not None and (source / RESTORE_MARKER).exists() and not helpers \
            and not restore_completed(source)
        facts = Facts(ep_state=ep_state, worker_alive=alive, gpu_states=tuple(gpu_states.values()),
                      helper_running=bool(helpers), capture=capture is not None, staging=st,
                      leftovers=active and any_images, restore_cut_off=cut_off)
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

    def next_step(self, obs: Observation, *, want: DesiredState, tier: Tier, routable: bool = False) -> Step:
        return plan(obs.facts, want=want, tier=tier, routable=routable)

    # -- doing ----------------------------------------------------------------------------------

    async def run_step(self, subject: Subject, obs: Observation, step: Step, *, tier: Tier,
                       gate: ServingGate = no_gate, capture_id: str | None = None,
                       engine_sleep_level: int = 1, routable: bool = False) -> StepResult:
        t0 = time.monotonic()
        call = StepCall(subject=subject, obs=obs, tier=tier, gate=gate, capture_id=capture_id,
                        engine_sleep_level=engine_sleep_level, routable=routable)
        await HANDLERS[step](self, call)
        return StepResult(step=step, seconds=time.monotonic() - t0, info=call.info)

    async def auto_tier(self, subject: Subject) -> Tier:
        """Tier ``auto`` for an active worker: ``engine`` where its engine has sleep routes (found by a
        wake of the awake engine, which changes nothing), else ``suspend``, which any CUDA worker can do
        (also where the probe could not tell: logged, never a guess at the routes)."""
        if not subject.system_url:
            return Tier.SUSPEND
        try:
            await EngineRoutes(subject.system_url, timeout=min(self.settings.engine_route_timeout, 10.0)).wake()
        except EngineRoutesMissing:
            return Tier.SUSPEND
        except (EngineRouteError, EngineRouteTimeout) as e:
            log.warning("%s/%s: tier auto: the engine routes could not be probed (%s); suspend", subject.namespace,
                        subject.pod, e)
            return Tier.SUSPEND
        return Tier.ENGINE

    async def stop_worker(self, obs: Observation) -> str:
        """SIGKILL the worker's root process (through a pidfd opened and checked first: the entrypoint's
        child at the worker's pid, in the pod's pid namespace), so that its container ends and the
        connections it holds close: the fallback of a wake on request that failed, whose requests
        would otherwise wait in its CUDA calls for ever. What was done, in words."""
        w = obs.worker
        root = w.worker_root
        host = next((p.pid for p in w.procs if p.ns_pid == root and p.ppid == w.entrypoint), None)
        if host is None:
            return "no worker process to stop"

        def still_the_worker() -> bool:
            st = procfs.status(host, self.proc)
            return st is not None and st.ppid == w.entrypoint and procfs.pid_ns(host, self.proc) == w.pidns
        try:
            fd = sigkill_pinned(host, still_the_worker)
        except OSError as e:
            return f"worker pid {host} not stopped: {e.strerror}"
        if fd is None:
            return f"worker pid {host} not stopped: it is no longer the worker"
        os.close(fd)
        return f"worker pid {host} stopped (SIGKILL): its container restarts it cold"

    async def kill_tree(self, w: W.WorkerProcs, procs: Sequence[procfs.ProcStatus], *,
                        timeout: float = KILL_WAIT) -> list[HostPid]:
        """SIGKILL each of ``procs`` (a restored tree, as :func:`dynsnap.agent.cgroup_check.restored`
        listed it), each through a pidfd opened and checked first as :meth:`stop_worker` does: still
        the process listed (the same pids in every namespace) and never the container's PID 1. Then
        wait, within ``timeout`` seconds, for every one signalled to have exited, so that the next look
        at the node sees the tree gone (its zombies are the entrypoint's, its subreaper, to reap). The
        host pids signalled."""
        fds: dict[HostPid, int] = {}
        try:
            for listed in procs:
                if listed.pid == w.entrypoint:
                    continue

                def same(listed: procfs.ProcStatus = listed) -> bool:
                    st = procfs.status(listed.pid, self.proc)
                    return st is not None and st.nspid == listed.nspid and st.state not in ("Z", "X")
                with contextlib.suppress(OSError):  # gone since it was listed: nothing to kill
                    fd = sigkill_pinned(listed.pid, same)
                    if fd is not None:
                        fds[listed.pid] = fd
            left = await _wait_exited(fds, timeout)
            if left:
                log.warning("restored processes %s still run %.0f s after SIGKILL", left, timeout)
            return sorted(fds)
        finally:
            for fd in fds.values():
                os.close(fd)

    async def request(self, obs: Observation, state: EntrypointState) -> dict[str, Any]:
        """Ask the worker's entrypoint for ``state``; its control file once it acknowledged it."""
        try:
            return await obs.worker.control.request(state, timeout=self.settings.entrypoint_timeout)
        except ContainerRefused as e:  # its control directory or file turned unsafe or unreadable meanwhile
            raise StepFailure(e.reason, str(e)) from e
        except EntrypointError as e:
            raise StepFailure(Reason.ENTRYPOINT_UNRESPONSIVE, str(e)) from e


def sigkill_pinned(pid: int, ours: Callable[[], bool]) -> int | None:
    """SIGKILL ``pid`` through a pidfd, once ``ours()`` said it is still the process meant, asked with
    the process pinned by that pidfd (a pid reused meanwhile fails the check and gets no signal). The
    pidfd, still open (the caller closes it; it turns readable once the process has exited), or None
    (closed) when ``ours()`` said no. An OSError when no pidfd can be opened (the process is gone)."""
    fd = os.pidfd_open(pid)
    try:
        if not ours():
            os.close(fd)
            return None
        with contextlib.suppress(ProcessLookupError):  # it exited since the check: as good as killed
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def _wait_exited(fds: Mapping[HostPid, int], timeout: float) -> list[HostPid]:
    """Wait until each pidfd of ``fds`` is readable (its process exited), within ``timeout`` seconds;
    the pids still running then."""
    poller = select.poll()
    for fd in fds.values():
        poller.register(fd, select.POLLIN)
    left = dict(fds)
    deadline = time.monotonic() + timeout
    while left:
        done = {fd for fd, _ in poller.poll(0)}
        for pid, fd in list(left.items()):
            if fd in done:
                poller.unregister(fd)
                del left[pid]
        if not left or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.02)
    return sorted(left)


async def _none(ex: Executor, c: StepCall) -> None:
    return None


async def _wait_helper(ex: Executor, c: StepCall) -> None:
    bound = max(ex.settings.criu_timeout, ex.settings.helper_timeout)
    for h in ex.helpers.running(c.subject.uid):
        if h.age > bound and ex.helpers.kill(h):
            raise StepFailure(Reason.HELPER_TIMEOUT, f"{h.name} (pid {h.pid}, {h.label}) ran {h.age:.0f} s, past "
                              f"its {bound:.0f} s bound; killed")


# Every step the planner can pick, and what runs it (tests/unit/test_agent_steps.py: none missing).
HANDLERS: Final[Mapping[Step, StepHandler]] = {
    Step.NONE: _none,
    Step.WAIT_HELPER: _wait_helper,
    Step.CLEANUP: C.cleanup,
    Step.QUIESCE: C.quiesce,
    Step.SAVE: C.save,
    Step.GPU_ROLLBACK: C.gpu_rollback,
    Step.SETTLE_SUSPENDED: C.settle_suspended,
    Step.DUMP: C.dump,
    Step.SEAL: C.seal,
    Step.SETTLE_SNAPSHOTTED: C.settle_snapshotted,
    Step.WAKE: K.wake,
    Step.RESTORE: K.restore,
    Step.RESUME: K.resume,
    Step.UNLOCK: K.unlock,
    Step.SETTLE_ACTIVE: K.settle_active,
    Step.GIVE_UP: K.give_up,
    Step.ENGINE_SLEEP: G.engine_sleep,
    Step.ENGINE_WAKE: G.engine_wake,
}
