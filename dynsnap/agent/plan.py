"""The agent's step planner: from what the node shows about one worker right now, the one step
that brings it closer to the wanted state. A pure function, tested by tables
(tests/unit/test_agent_plan.py).

Everything the planner reads is observable after a restart of the agent: the entrypoint's state
(its control file), whether the worker tree is alive, the CUDA driver's state of each GPU
process, whether a helper (CRIU, dynsnap-cuda) is still running for the pod, and the images on
disk. So a new agent resumes wherever an old one died: a capture whose dump finished is sealed;
anything half-done with the worker alive is rolled back; a wake under way is finished whatever
is wanted now.

Layer: ``dynsnap.agent`` (pure; no I/O).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from dynsnap.models.protocol import DesiredState, EntrypointState, ObservedState, Tier

E = EntrypointState


class Step(StrEnum):
    NONE = "none"  # at the wanted state
    WAIT_HELPER = "wait-helper"  # a CRIU or dynsnap-cuda started earlier still runs for this pod
    CLEANUP = "cleanup"  # delete images the worker no longer needs (woken from, or a failed dump's)
    QUIESCE = "quiesce"  # entrypoint -> suspending (its /health answers 503 from the ack on)
    SAVE = "save"  # dynsnap-cuda save: lock every GPU process, then checkpoint every one
    GPU_ROLLBACK = "gpu-rollback"  # every GPU process back to running (an interrupted or failed save)
    SETTLE_SUSPENDED = "settle-suspended"  # entrypoint -> suspended (tier suspend: done)
    DUMP = "dump"  # CRIU dumps the worker tree into a staging directory; the tree exits
    SEAL = "seal"  # completeness guard, manifest, rename: the capture is usable
    SETTLE_SNAPSHOTTED = "settle-snapshotted"  # entrypoint -> snapshotted (tier snapshot: done)
    WAKE = "wake"  # entrypoint -> restoring
    RESTORE = "restore"  # CRIU restores the tree into the same pod, same pids
    RESUME = "resume"  # dynsnap-cuda resume (free-memory check, restore, unlock)
    UNLOCK = "unlock"  # dynsnap-cuda unlock of processes left locked
    SETTLE_ACTIVE = "settle-active"  # entrypoint -> active: serving again
    GIVE_UP = "give-up"  # the worker cannot come back in place: entrypoint -> active makes it exit
    # (75) and kubelet starts the container cold
    # tier engine: the engine's own routes (engine_routes.py), each followed by its entrypoint settle
    ENGINE_SLEEP = "engine-sleep"  # the engine's sleep route, then entrypoint -> suspended
    ENGINE_WAKE = "engine-wake"  # the engine's wake route, then entrypoint -> active


CAPTURE_STEPS = frozenset({Step.QUIESCE, Step.SAVE, Step.SETTLE_SUSPENDED, Step.DUMP, Step.SEAL,
                           Step.SETTLE_SNAPSHOTTED, Step.ENGINE_SLEEP})
WAKE_STEPS = frozenset({Step.WAKE, Step.RESTORE, Step.RESUME, Step.UNLOCK, Step.SETTLE_ACTIVE, Step.ENGINE_WAKE})


@dataclass(frozen=True)
class Staging:
    complete: bool  # CRIU's log says the dump finished
    rejected: bool  # the completeness guard refused it (the tree must be restored from it)


@dataclass(frozen=True)
class Facts:
    ep_state: EntrypointState
    worker_alive: bool
    gpu_states: tuple[str, ...] = ()  # driver state of each GPU process of the worker
    helper_running: bool = False
    capture: bool = False  # a complete (sealed) capture of this container exists
    staging: Staging | None = None  # the newest staging directory, if any
    leftovers: bool = False  # images or staging dirs exist that the current state does not need
    restore_cut_off: bool = False  # a restore began (its marker stands) and no CRIU runs: it was cut off


def _all(states: Sequence[str], value: str) -> bool:
    return all(s == value for s in states)


def plan(f: Facts, *, want: DesiredState, tier: Tier, routable: bool = False) -> Step:
    """The next step for a worker whose node shows ``f``, towards ``want`` (at ``tier``: the tier of
    the capture under way or asleep, never ``auto``; ``routable``: a sleep that keeps it in serving)."""
    if f.helper_running:
        return Step.WAIT_HELPER
    if f.ep_state == E.ROUTABLE or (routable and tier == Tier.SUSPEND and want == DesiredState.SUSPENDED
                                    and f.ep_state == E.ACTIVE):
        return _routable(f, want)
    if tier == Tier.ENGINE and f.ep_state != E.SNAPSHOTTED:
        return _engine(f, want)
    if f.ep_state == E.RESTORING:
        return _finish_wake(f)  # whatever is wanted now, a wake under way ends first
    if want == DesiredState.SUSPENDED:
        return _towards_sleep(f, tier)
    return _towards_active(f)


def _restorable(f: Facts) -> bool:
    return f.capture or (f.staging is not None and f.staging.rejected)


def _finish_wake(f: Facts) -> Step:
    if f.restore_cut_off:  # what runs is a remnant of it, never the worker: restore again (the step clears it)
        return Step.RESTORE if _restorable(f) else Step.GIVE_UP
    if not f.worker_alive:
        return Step.RESTORE if _restorable(f) else Step.GIVE_UP
    if "checkpointed" in f.gpu_states:
        return Step.RESUME
    if "locked" in f.gpu_states:
        return Step.UNLOCK
    return Step.SETTLE_ACTIVE


def _dead_after_dump(f: Facts) -> Step:
    """The entrypoint is suspending and the tree is gone: a dump ran (or the worker crashed)."""
    if f.staging is not None and f.staging.rejected:
        return Step.WAKE  # the guard refused the capture: bring the tree back from it
    if f.staging is not None and f.staging.complete:
        return Step.SEAL
    if f.capture:
        return Step.SETTLE_SNAPSHOTTED
    return Step.GIVE_UP


def _towards_sleep(f: Facts, tier: Tier) -> Step:
    st = f.ep_state
    if st == E.ACTIVE:
        if not _all(f.gpu_states, "running"):
            return Step.GPU_ROLLBACK
        if f.leftovers:
            return Step.CLEANUP
        return Step.QUIESCE
    if st == E.SUSPENDING:
        if not f.worker_alive:
            return _dead_after_dump(f)
        if f.gpu_states and _all(f.gpu_states, "running"):
            return Step.SAVE
        if _all(f.gpu_states, "checkpointed"):  # also: no GPU process at all
            return Step.SETTLE_SUSPENDED if tier == Tier.SUSPEND else Step.DUMP
        return Step.GPU_ROLLBACK  # locked, mixed or failed: an interrupted save; start over
    if st == E.SUSPENDED:
        return Step.QUIESCE if tier == Tier.SNAPSHOT else Step.NONE  # deepen: suspending, then dump
    if st == E.SNAPSHOTTED:
        if f.capture:
            return Step.NONE
        return _dead_after_dump(f) if f.staging is not None else Step.GIVE_UP
    return Step.NONE


def _towards_active(f: Facts) -> Step:
    st = f.ep_state
    if st == E.ACTIVE:
        if not _all(f.gpu_states, "running"):
            return Step.GPU_ROLLBACK
        return Step.CLEANUP if f.leftovers else Step.NONE
    if st == E.SUSPENDING:
        if f.worker_alive:
            return Step.SETTLE_ACTIVE if _all(f.gpu_states, "running") else Step.GPU_ROLLBACK
        step = _dead_after_dump(f)
        return Step.WAKE if step == Step.SETTLE_SNAPSHOTTED else step  # sealed: wake from it
    if st in (E.SUSPENDED, E.SNAPSHOTTED):
        if st == E.SNAPSHOTTED and not _restorable(f) and not (f.staging and f.staging.complete):
            return Step.GIVE_UP
        if st == E.SNAPSHOTTED and not _restorable(f):
            return Step.SEAL
        return Step.WAKE
    return Step.NONE


def _routable(f: Facts, want: DesiredState) -> Step:
    """A sleep that keeps the worker in serving (wake on request): the entrypoint goes straight from
    active to routable (its /health stays 200, so the pod stays Ready: no suspending, no restoring),
    the GPU processes are saved and resumed in that state, and the wake ends with active. A request
    that reaches the worker meanwhile waits in its own CUDA calls."""
    st, gpu = f.ep_state, f.gpu_states
    if st == E.ACTIVE:  # asked to sleep routable
        if not _all(gpu, "running"):
            return Step.GPU_ROLLBACK
        return Step.CLEANUP if f.leftovers else Step.QUIESCE
    if not f.worker_alive:
        return Step.GIVE_UP  # its tree died asleep: nothing wakes it in place
    if want == DesiredState.SUSPENDED:
        if gpu and _all(gpu, "running"):
            return Step.SAVE
        if _all(gpu, "checkpointed"):  # also: no GPU process at all
            return Step.NONE
        return Step.GPU_ROLLBACK  # an interrupted save: back to running, then saved again
    if "checkpointed" in gpu:
        return Step.RESUME
    if "locked" in gpu:
        return Step.UNLOCK
    return Step.SETTLE_ACTIVE


def _engine(f: Facts, want: DesiredState) -> Step:
    """Tier engine: the engine sleeps and wakes itself; the worker's processes stay as they are. Both
    routes are idempotent, so after an agent died mid-way the step is simply asked again: a sleep of a
    sleeping engine is "already sleeping", a wake of an awake one "already awake". A worker whose tree
    is gone cannot be woken in place."""
    st = f.ep_state
    if st != E.ACTIVE and not f.worker_alive:
        return Step.GIVE_UP
    if st == E.RESTORING:
        return Step.ENGINE_WAKE
    if st == E.ACTIVE:
        if not _all(f.gpu_states, "running"):
            return Step.GPU_ROLLBACK  # left checkpointed or locked by a driver tier before: never slept on
        if f.leftovers:
            return Step.CLEANUP
        return Step.QUIESCE if want == DesiredState.SUSPENDED else Step.NONE
    if st == E.SUSPENDING:  # the sleep under way (or its rollback: the wake route undoes a half sleep)
        return Step.ENGINE_SLEEP if want == DesiredState.SUSPENDED else Step.ENGINE_WAKE
    return Step.NONE if want == DesiredState.SUSPENDED else Step.WAKE  # suspended


def observed(f: Facts) -> ObservedState:
    """The state a WorkerSnapshot's status reports for these facts."""
    st = f.ep_state
    if st == E.ACTIVE:
        return ObservedState.ACTIVE if f.worker_alive else ObservedState.LOST
    if st == E.SUSPENDED:
        return ObservedState.SUSPENDED
    if st == E.SNAPSHOTTED:
        return ObservedState.SUSPENDED if _restorable(f) or (f.staging and f.staging.complete) else ObservedState.LOST
    if st == E.RESTORING:
        return ObservedState.WAKING if f.worker_alive or _restorable(f) else ObservedState.LOST
    if st == E.ROUTABLE:  # asleep once every GPU process is checkpointed; serving while they all run
        if not f.worker_alive:
            return ObservedState.LOST
        if _all(f.gpu_states, "checkpointed"):
            return ObservedState.SUSPENDED
        return ObservedState.ACTIVE if _all(f.gpu_states, "running") else ObservedState.CAPTURING
    return ObservedState.CAPTURING
