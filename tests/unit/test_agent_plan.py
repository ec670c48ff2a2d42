"""The agent's step planner, by table: from what the node shows, the one next step (pure)."""

from __future__ import annotations

import pytest

from dynsnap.agent.plan import Facts, Staging, Step, observed, plan
from dynsnap.models.protocol import DesiredState, EntrypointState, ObservedState, Tier

E = EntrypointState
SUSP, ACT = DesiredState.SUSPENDED, DesiredState.ACTIVE
SNAP, TIER1, ENG = Tier.SNAPSHOT, Tier.SUSPEND, Tier.ENGINE
DONE = Staging(complete=True, rejected=False)
HALF = Staging(complete=False, rejected=False)
REJECTED = Staging(complete=True, rejected=True)

ROWS = [
    # (entrypoint, alive, gpu states, extra facts, want, tier) -> step
    # capture, tier suspend
    ((E.ACTIVE, True, ("running",), {}, SUSP, TIER1), Step.QUIESCE),
    ((E.SUSPENDING, True, ("running", "running"), {}, SUSP, TIER1), Step.SAVE),
    ((E.SUSPENDING, True, ("checkpointed", "checkpointed"), {}, SUSP, TIER1), Step.SETTLE_SUSPENDED),
    ((E.SUSPENDED, True, ("checkpointed",), {}, SUSP, TIER1), Step.NONE),
    # capture, tier snapshot
    ((E.SUSPENDING, True, ("checkpointed",), {}, SUSP, SNAP), Step.DUMP),
    ((E.SUSPENDING, True, (), {}, SUSP, SNAP), Step.DUMP),  # no GPU process: straight to the dump
    ((E.SUSPENDING, False, (), {"staging": DONE}, SUSP, SNAP), Step.SEAL),
    ((E.SUSPENDING, False, (), {"capture": True}, SUSP, SNAP), Step.SETTLE_SNAPSHOTTED),
    ((E.SNAPSHOTTED, False, (), {"capture": True}, SUSP, SNAP), Step.NONE),
    ((E.SUSPENDED, True, ("checkpointed",), {}, SUSP, SNAP), Step.QUIESCE),  # deepen suspend -> snapshot
    # an interrupted save (agent killed, helper killed) is rolled back, whatever is wanted
    ((E.SUSPENDING, True, ("locked", "running"), {}, SUSP, TIER1), Step.GPU_ROLLBACK),
    ((E.SUSPENDING, True, ("checkpointed", "locked"), {}, SUSP, SNAP), Step.GPU_ROLLBACK),
    ((E.ACTIVE, True, ("locked",), {}, SUSP, TIER1), Step.GPU_ROLLBACK),
    ((E.ACTIVE, True, ("locked",), {}, ACT, TIER1), Step.GPU_ROLLBACK),
    # a GPU process checkpointed under an active entrypoint (by anyone: node/test_stub_engine.py's
    # dynsnap-cuda save from the node, opted in) is put back to running
    ((E.ACTIVE, True, ("checkpointed",), {}, ACT, TIER1), Step.GPU_ROLLBACK),
    # a helper still running (started by an agent that died) is waited for first
    ((E.SUSPENDING, True, ("locked",), {"helper_running": True}, SUSP, TIER1), Step.WAIT_HELPER),
    # the dump guard refused a capture: the tree comes back from what was dumped
    ((E.SUSPENDING, False, (), {"staging": REJECTED}, SUSP, SNAP), Step.WAKE),
    ((E.SUSPENDING, False, (), {"staging": REJECTED}, ACT, SNAP), Step.WAKE),
    ((E.RESTORING, False, (), {"staging": REJECTED}, SUSP, SNAP), Step.RESTORE),
    # the tree died with no usable capture: given up, loudly (cold start)
    ((E.SUSPENDING, False, (), {"staging": HALF}, SUSP, SNAP), Step.GIVE_UP),
    ((E.SUSPENDING, False, (), {}, ACT, SNAP), Step.GIVE_UP),
    ((E.SNAPSHOTTED, False, (), {}, ACT, SNAP), Step.GIVE_UP),
    ((E.RESTORING, False, (), {}, ACT, SNAP), Step.GIVE_UP),
    # wake
    ((E.SUSPENDED, True, ("checkpointed",), {}, ACT, TIER1), Step.WAKE),
    ((E.SNAPSHOTTED, False, (), {"capture": True}, ACT, SNAP), Step.WAKE),
    ((E.RESTORING, False, (), {"capture": True}, ACT, SNAP), Step.RESTORE),
    ((E.RESTORING, True, ("checkpointed",), {"capture": True}, ACT, SNAP), Step.RESUME),
    # a restore cut off (its CRIU killed: by the pod, its bound, the OOM killer) left a remnant at the
    # worker's pid: never taken for the worker, restored again (the step kills what it left first)
    ((E.RESTORING, True, ("checkpointed",), {"capture": True, "restore_cut_off": True}, ACT, SNAP), Step.RESTORE),
    ((E.RESTORING, False, (), {"capture": True, "restore_cut_off": True}, SUSP, SNAP), Step.RESTORE),
    ((E.RESTORING, True, (), {"restore_cut_off": True}, ACT, SNAP), Step.GIVE_UP),
    ((E.RESTORING, True, ("locked",), {}, ACT, TIER1), Step.UNLOCK),
    ((E.RESTORING, True, ("running",), {}, ACT, TIER1), Step.SETTLE_ACTIVE),
    # a wake under way finishes even when the wish flipped back to Suspended
    ((E.RESTORING, True, ("checkpointed",), {}, SUSP, TIER1), Step.RESUME),
    # the capture is given up mid-way when Active is wanted again (worker alive: roll back)
    ((E.SUSPENDING, True, ("running",), {}, ACT, SNAP), Step.SETTLE_ACTIVE),
    ((E.SUSPENDING, True, ("checkpointed",), {}, ACT, SNAP), Step.GPU_ROLLBACK),
    # a sealed capture whose settle was interrupted, now wanted awake: wake from it
    ((E.SUSPENDING, False, (), {"capture": True}, ACT, SNAP), Step.WAKE),
    # awake and settled; images left from before are deleted (they hold the worker's secrets)
    ((E.ACTIVE, True, ("running",), {}, ACT, SNAP), Step.NONE),
    ((E.ACTIVE, True, ("running",), {"leftovers": True}, ACT, SNAP), Step.CLEANUP),
    ((E.ACTIVE, True, ("running",), {"leftovers": True}, SUSP, SNAP), Step.CLEANUP),
    # tier engine: the engine's routes, each with its settle; both idempotent, so asked again after a crash
    ((E.ACTIVE, True, ("running",), {}, SUSP, ENG), Step.QUIESCE),
    ((E.SUSPENDING, True, ("running",), {}, SUSP, ENG), Step.ENGINE_SLEEP),
    ((E.SUSPENDED, True, (), {}, SUSP, ENG), Step.NONE),
    ((E.SUSPENDED, True, (), {}, ACT, ENG), Step.WAKE),
    ((E.RESTORING, True, ("running",), {}, ACT, ENG), Step.ENGINE_WAKE),
    ((E.RESTORING, True, ("running",), {}, SUSP, ENG), Step.ENGINE_WAKE),  # a wake under way finishes
    ((E.SUSPENDING, True, ("running",), {}, ACT, ENG), Step.ENGINE_WAKE),  # a capture called off: wake undoes
    ((E.ACTIVE, True, ("running",), {}, ACT, ENG), Step.NONE),
    ((E.ACTIVE, True, ("locked",), {}, SUSP, ENG), Step.GPU_ROLLBACK),  # a driver tier's leftover first
    ((E.ACTIVE, True, ("running",), {"leftovers": True}, SUSP, ENG), Step.CLEANUP),
    ((E.SUSPENDING, False, (), {}, SUSP, ENG), Step.GIVE_UP),  # the worker died asleep: nothing wakes it
    ((E.SUSPENDED, False, (), {}, ACT, ENG), Step.GIVE_UP),
    ((E.RESTORING, False, (), {}, ACT, ENG), Step.GIVE_UP),
]


@pytest.mark.parametrize(("row", "expected"), ROWS, ids=[f"{r[0].value}-{r[4].value}-{e.value}-{i}"
                                                          for i, (r, e) in enumerate(ROWS)])
def test_plan(row: tuple, expected: Step) -> None:  # type: ignore[type-arg]
    ep, alive, gpu, extra, want, tier = row
    assert plan(Facts(ep_state=ep, worker_alive=alive, gpu_states=gpu, **extra), want=want, tier=tier) == expected


@pytest.mark.parametrize(("facts", "state"), [
    (Facts(ep_state=E.ACTIVE, worker_alive=True), ObservedState.ACTIVE),
    (Facts(ep_state=E.SUSPENDING, worker_alive=True), ObservedState.CAPTURING),
    (Facts(ep_state=E.SUSPENDED, worker_alive=True), ObservedState.SUSPENDED),
    (Facts(ep_state=E.SNAPSHOTTED, worker_alive=False, capture=True), ObservedState.SUSPENDED),
    (Facts(ep_state=E.SNAPSHOTTED, worker_alive=False), ObservedState.LOST),
    (Facts(ep_state=E.RESTORING, worker_alive=False, capture=True), ObservedState.WAKING),
    (Facts(ep_state=E.RESTORING, worker_alive=False), ObservedState.LOST),
])
def test_observed_state(facts: Facts, state: ObservedState) -> None:
    assert observed(facts) == state


def test_every_step_is_planned_by_some_row() -> None:
    """The table covers every step the executor can be asked for (a step no row reaches is dead code)."""
    reached = {expected for _, expected in ROWS}
    assert reached == set(Step)


@pytest.mark.parametrize("ep", [E.SUSPENDED, E.SNAPSHOTTED])
def test_a_sleeping_worker_is_planned_without_the_drivers_answer(ep: EntrypointState) -> None:
    """The executor does not ask the driver while the entrypoint says suspended or snapshotted (no
    helper per GPU process on every look at a sleeping worker): every plan there must be the same
    whatever the GPU processes' states would have been."""
    staging_opts = (None, DONE, HALF, REJECTED)
    for alive in (True, False):
        for capture in (True, False):
            for staging in staging_opts:
                for leftovers in (True, False):
                    for want in (SUSP, ACT):
                        for tier in (SNAP, TIER1, ENG):
                            base = {"ep_state": ep, "worker_alive": alive, "capture": capture,
                                    "staging": staging, "leftovers": leftovers}
                            unasked = plan(Facts(**base, gpu_states=()), want=want, tier=tier)  # type: ignore[arg-type]
                            for states in (("running",), ("locked",), ("checkpointed",), ("failed",),
                                           ("checkpointed", "running")):
                                got = plan(Facts(**base, gpu_states=states), want=want, tier=tier)  # type: ignore[arg-type]
                                assert got == unasked, (base, want, tier, states)


R = E.ROUTABLE
ROUTABLE_ROWS = [
    # (entrypoint, alive, gpu states, want) -> step, for a sleep that keeps the worker in serving
    ((E.ACTIVE, True, ("running",), SUSP), Step.QUIESCE),  # straight to routable (no suspending)
    ((E.ACTIVE, True, ("locked",), SUSP), Step.GPU_ROLLBACK),
    ((R, True, ("running", "running"), SUSP), Step.SAVE),
    ((R, True, ("checkpointed",), SUSP), Step.NONE),
    ((R, True, (), SUSP), Step.NONE),  # no GPU process: nothing to save
    ((R, True, ("locked", "running"), SUSP), Step.GPU_ROLLBACK),  # an interrupted save
    ((R, True, ("checkpointed",), ACT), Step.RESUME),  # the wake, where it sleeps (no restoring)
    ((R, True, ("locked",), ACT), Step.UNLOCK),
    ((R, True, ("running",), ACT), Step.SETTLE_ACTIVE),
    ((R, False, (), ACT), Step.GIVE_UP),
    ((R, False, (), SUSP), Step.GIVE_UP),
]


@pytest.mark.parametrize(("row", "expected"), ROUTABLE_ROWS,
                         ids=[f"{r[0].value}-{r[3].value}-{e.value}-{i}" for i, (r, e) in enumerate(ROUTABLE_ROWS)])
def test_plan_routable(row: tuple, expected: Step) -> None:  # type: ignore[type-arg]
    ep, alive, gpu, want = row
    assert plan(Facts(ep_state=ep, worker_alive=alive, gpu_states=gpu), want=want, tier=TIER1,
                routable=True) == expected


@pytest.mark.parametrize(("gpu", "state"), [
    (("checkpointed",), ObservedState.SUSPENDED), ((), ObservedState.SUSPENDED),
    (("running",), ObservedState.ACTIVE), (("locked", "running"), ObservedState.CAPTURING),
])
def test_a_routable_worker_is_asleep_once_every_gpu_process_is_checkpointed(gpu: tuple[str, ...],
                                                                           state: ObservedState) -> None:
    assert observed(Facts(ep_state=E.ROUTABLE, worker_alive=True, gpu_states=gpu)) == state
