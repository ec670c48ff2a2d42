"""The planner: the observed workers of one component + its policy + the frontend's demand ->
what each worker should be (awake or asleep) and why. A pure function, tested by tables.

Deterministic, so two reconciles of two workers of one component agree on who stays awake:

- The component needs ``need = max(min-active, ceil(demand / wake-at-inflight))`` workers awake
  (demand is the frontend's in-flight requests for the graph, its queued ones among them; unknown
  demand never lets a worker go to sleep, and wakes nothing).
- Awake workers are ranked to stay awake: manual override ``active`` first, then those not idle
  long enough, then the most recently active, then by name. A worker may go to sleep only when
  it is idle past ``idle-after`` and the awake, *ready* workers left without it are still at
  least ``need``. Its idleness counts from the later of the agent's ``idleSince`` and its last
  proven return to serving (a verified wake or recall): the agent's facts come back from a sleep
  as they were before it, so without that a worker woken for load would be idle at once, and
  quiesced again before the load had reached it. A worker still waking or verifying is not
  ready, so the component never drops below ``min-active`` serving workers, not even for a
  moment; nor does a worker back in serving less than ``SETTLE_S`` ago count among those left
  (kubelet may still take it out of its EndpointSlice for a moment, see ``SETTLE_S``).
- When fewer than ``need`` are awake (or on their way), a capture still quiescing is called off
  first (cheapest), then sleeping workers are woken, most recently captured first.
- The manual override wins over idleness and demand, except that ``suspended`` is refused with
  ``MinActive`` when it would leave fewer than ``min-active`` awake.
- Lost workers (the pod must start them cold), workers the agent refused and workers whose wake
  failed are left alone, and counted as neither awake nor asleep: a failed wake's deficit is made
  up by waking another worker.
- A worker whose capture the agent refused for good (``sleep_refused``: a permanent refusal, still
  standing for this pod, spec and policy) serves and is never chosen to sleep, not even by the
  manual override (refused, with the refusal's reason).

Layer: ``dynsnap.controller`` (pure: no I/O).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from dynsnap.models.policy import Policy
from dynsnap.models.protocol import DesiredState, Reason


class Phase(StrEnum):
    """Where a worker is, as the controller sees it (from pod, WorkerSnapshot and its own record)."""

    NEW = "New"  # no WorkerSnapshot yet, or not yet accepted by the agent
    SERVING = "Serving"  # awake, serving gate True, pod Ready
    STARTING = "Starting"  # awake but not (yet) ready: starting, gate being set, verifying
    QUIESCING = "Quiescing"  # the controller took it out of serving; desiredState still Active
    CAPTURING = "Capturing"  # desiredState Suspended, capture under way
    ASLEEP = "Asleep"  # desiredState Suspended and captured
    WAKING = "Waking"  # desiredState Active, the agent is waking it
    BROKEN = "Broken"  # lost, refused, or its wake failed: left alone by the planner, counted nowhere


# How long a worker back in serving (a verified wake, or a quiesce called off) must have served before
# it counts among the serving workers that let another of its component go to sleep. kubelet computes
# a pod's Ready from its own copy of the pod's readiness gates, which can lag the API: after the serving
# gate went False and True again within a second or two (a quiesce called off; a wake), kubelet may
# still apply the False seconds later, and the pod leaves its EndpointSlice for about a second. Seen on
# the real node (tests/integration/node/test_controller.py, tier snapshot): a quiesce called off while
# kubelet still had the pod Ready, the other worker quiesced at once as the one idle longer, then
# kubelet's late Ready=False of the first, and no worker of the model in the EndpointSlice: the
# frontend answered a request 404. The worker serves meanwhile; it only is no floor yet.
SETTLE_S = 10.0

AWAKE_PHASES = frozenset({Phase.NEW, Phase.SERVING, Phase.STARTING, Phase.WAKING})
ASLEEP_PHASES = frozenset({Phase.CAPTURING, Phase.ASLEEP})


class Want(StrEnum):
    AWAKE = "Awake"
    ASLEEP = "Asleep"
    LEAVE = "Leave"  # not the planner's to move (broken, or a decision is refused)


@dataclass(frozen=True)
class WorkerView:
    name: str
    phase: Phase
    idle_since: datetime | None = None  # from the agent's idle facts; None while busy or unknown
    last_activity: datetime | None = None
    last_capture: datetime | None = None
    override: str | None = None  # DesiredState value from dynsnap.io/desired-state
    serving_since: datetime | None = None  # its last verified return to serving (a wake or a recall)
    sleep_refused: str | None = None  # why it is never asked to sleep: its capture was refused for good
    routable: bool = False  # asleep (or going to sleep) routable: still in serving, woken by a request


@dataclass(frozen=True)
class Decision:
    want: Want
    why: str
    refused: bool = False  # the override asked for something that is not allowed
    reason: Reason = Reason.MIN_ACTIVE  # the Warning Event's reason when ``refused``
    again_after: float | None = None  # look again then (an idle threshold still to cross)
    routable: bool = False  # sleep routable (wake on request): the component's last worker, kept in serving


@dataclass(frozen=True)
class Demand:
    """A frontend's requests: in flight, and of those the ones not yet at their first token (queued).
    Dynamo 1.6.1 counts a request in its queue gauge from its arrival to its first token and in its
    in-flight gauge from its arrival to its end: the queue is a part of in-flight, not beside it
    (tests/integration/node/test_dynamo.py). Summed, one request before its first token was a demand
    of 2, enough at ``wake-at-inflight: 1`` to call off a quiesce for a single request."""

    inflight: float
    queued: float = 0.0

    @property
    def total(self) -> float:
        return max(self.inflight, self.queued)  # the queue alone where a page carries only that gauge


def needed(policy: Policy, demand: Demand | None) -> int:
    if demand is None:
        return policy.min_active
    return max(policy.min_active, math.ceil(demand.total / policy.wake_at_inflight))


def _idle_for(w: WorkerView, now: datetime) -> float | None:
    if w.idle_since is None:
        return None
    since = w.idle_since if w.serving_since is None else max(w.idle_since, w.serving_since)
    return (now - since).total_seconds()


def _settled(w: WorkerView, now: datetime) -> bool:
    """Whether ``w`` may count as serving for another's sleep (``SETTLE_S``)."""
    return w.serving_since is None or (now - w.serving_since).total_seconds() >= SETTLE_S


def _wakes(out: dict[str, Decision], *, awake: list[WorkerView], quiescing: list[WorkerView],
           asleep: list[WorkerView], need: int, policy: Policy, demand: Demand | None) -> None:
    """The deficit of awake workers made up: quiesces called off first (cheapest), then sleepers woken."""
    active_override = DesiredState.ACTIVE.value
    suspended_override = DesiredState.SUSPENDED.value
    # A routable sleeper is its agent's to wake: the requests that make this demand reach it (it is
    # still in serving) and its agent wakes it within a poll (dynsnap/agent/edge.py). Counted as waking,
    # so the controller wakes no other worker for the same request, nor this one a second time.
    held = [w for w in asleep if w.routable and w.override is None]
    deficit = need - len(awake) - (len(held) if demand is not None and demand.total > 0 else 0)
    for w in quiescing:
        if w.override == active_override:
            out[w.name] = Decision(Want.AWAKE, "manual override: active")
            deficit -= 1
        elif deficit > 0 and w.override != suspended_override:
            out[w.name] = Decision(Want.AWAKE, f"{len(awake)} awake of {need} needed: capture called off")
            deficit -= 1
    for w in asleep:
        if w.override == active_override:
            out[w.name] = Decision(Want.AWAKE, "manual override: active")
            deficit -= 1
        elif w in held and demand is not None and demand.total > 0:
            out[w.name] = Decision(Want.ASLEEP, "asleep routable: the requests that reach it wake it at its agent")
        elif deficit > 0 and w.override != suspended_override:
            why = (f"demand {demand.total:g} (in flight, {demand.queued:g} of them queued) needs {need} awake at "
                   f"{policy.wake_at_inflight:g} per worker; {need - deficit} awake or waking"
                   if demand is not None else f"min-active {policy.min_active}")
            out[w.name] = Decision(Want.AWAKE, why)
            deficit -= 1


ROUTABLE_WHY = "; the last worker sleeps routable (wake on request): its first request wakes it"


def _last_of(w: WorkerView, awake: list[WorkerView], quiescing: list[WorkerView], policy: Policy) -> bool:
    """Whether ``w`` going to sleep leaves its component with no awake worker, under wake on request:
    then it sleeps routable, so the model stays listed; every other sleeper is quiesced as usual, so no
    request waits for a wake while an awake worker could serve it."""
    return policy.wake_on_request and not quiescing and [x.name for x in awake] == [w.name]


def plan(workers: list[WorkerView], policy: Policy, demand: Demand | None, now: datetime) -> dict[str, Decision]:
    """What each worker of one component should be."""
    out: dict[str, Decision] = {}
    need = needed(policy, demand)
    active_override = DesiredState.ACTIVE.value
    suspended_override = DesiredState.SUSPENDED.value

    live = [w for w in workers if w.phase != Phase.BROKEN]
    for w in workers:
        if w.phase == Phase.BROKEN:
            out[w.name] = Decision(Want.LEAVE, "lost, refused or failing: the agent's conditions say why")

    def stay_rank(w: WorkerView) -> tuple[int, int, float, str]:
        idle = _idle_for(w, now)
        long_idle = idle is not None and idle >= policy.idle_after
        recent = -(w.last_activity.timestamp() if w.last_activity else 0.0)
        return (0 if w.override == active_override else 1, 1 if long_idle else 0, recent, w.name)

    awake = sorted((w for w in live if w.phase in AWAKE_PHASES), key=stay_rank)
    quiescing = sorted((w for w in live if w.phase == Phase.QUIESCING), key=stay_rank)
    asleep = sorted((w for w in live if w.phase in ASLEEP_PHASES),
                    key=lambda w: (0 if w.override == active_override else 1,
                                   -(w.last_capture.timestamp() if w.last_capture else 0.0), w.name))
    ready = sum(1 for w in awake if w.phase == Phase.SERVING and _settled(w, now))
    unsettled = [w for w in awake if w.phase == Phase.SERVING and not _settled(w, now)]
    settles_in = min((SETTLE_S - (now - w.serving_since).total_seconds() for w in unsettled
                      if w.serving_since is not None), default=None)
    held_by = (f" ({len(unsettled)} back in serving less than {SETTLE_S:g}s ago not counted yet)"
               if unsettled else "")

    # Wakes first: the deficit of awake workers is made up by calling off quiesces, then by waking.
    _wakes(out, awake=awake, quiescing=quiescing, asleep=asleep, need=need, policy=policy, demand=demand)

    # Sleeps: only while the ready workers left stay at or above what is needed.
    for w in reversed(awake):  # the least wanted first
        idle = _idle_for(w, now)
        counted = w.phase == Phase.SERVING and _settled(w, now)
        others = ready - 1 if counted else ready  # the serving workers left without it
        if w.override == active_override:
            out[w.name] = Decision(Want.AWAKE, "manual override: active")
            continue
        if w.sleep_refused is not None:
            refused = w.override == suspended_override
            out[w.name] = Decision(Want.AWAKE, ("manual override suspended refused: " if refused else "")
                                   + w.sleep_refused, refused=refused, reason=Reason.CAPTURE_REFUSED)
            continue
        last = _last_of(w, awake, quiescing, policy)
        if w.override == suspended_override:
            if w.phase == Phase.SERVING and others >= policy.min_active:
                out[w.name] = Decision(Want.ASLEEP, "manual override: suspended" + (ROUTABLE_WHY if last else ""),
                                       routable=last)
                ready = others
            else:
                out[w.name] = Decision(Want.AWAKE, f"manual override suspended refused: it would leave fewer than "
                                       f"min-active {policy.min_active} serving{held_by}", refused=True)
            continue
        if demand is None:
            out[w.name] = Decision(Want.AWAKE, "demand unknown (frontend not scraped): nothing goes to sleep")
            continue
        if idle is None:
            out[w.name] = Decision(Want.AWAKE, "serving traffic")
            continue
        if idle < policy.idle_after:
            out[w.name] = Decision(Want.AWAKE, f"idle {idle:.0f}s of {policy.idle_after:g}s",
                                   again_after=max(policy.idle_after - idle, 0.05))
            continue
        if policy.wake_on_request and w.phase == Phase.SERVING and others < 1 and not last:
            # It would leave none serving while others of the component are still awake or on their way
            # to sleep (this very pass puts them there): it sleeps routable once they sleep.
            out[w.name] = Decision(Want.AWAKE, f"idle {idle:.0f}s, the last one serving: it sleeps routable once "
                                   "every other worker of the component sleeps", again_after=1.0)
        elif w.phase == Phase.SERVING and others >= need:
            out[w.name] = Decision(Want.ASLEEP, f"idle {idle:.0f}s >= {policy.idle_after:g}s; "
                                   f"{others} stay serving (need {need})" + (ROUTABLE_WHY if last else ""),
                                   routable=last)
            ready = others
        else:
            out[w.name] = Decision(Want.AWAKE, f"idle, but {need} must stay serving{held_by}",
                                   again_after=settles_in)
    for w in quiescing:
        out.setdefault(w.name, Decision(Want.ASLEEP, "quiescing for a capture"))
    for w in asleep:
        if w.override == suspended_override:
            out.setdefault(w.name, Decision(Want.ASLEEP, "manual override: suspended"))
        out.setdefault(w.name, Decision(Want.ASLEEP, "asleep; demand met by the awake workers"))
    return out
