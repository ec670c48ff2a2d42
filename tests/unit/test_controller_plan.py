"""The controller's planner (dynsnap/controller/plan.py) by tables: the observed workers of one
component + its policy + the frontend's demand -> what each worker should be. Never fewer than
min-active serving workers; a worker still waking or verifying is not serving; a manual suspend that
would break min-active is refused; unknown demand sends nothing to sleep; a deficit calls off a
quiesce before it wakes anyone, then wakes the most recently captured; the same facts in any order
give the same plan."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from dynsnap.controller.plan import SETTLE_S, Decision, Demand, Phase, Want, WorkerView, needed, plan
from dynsnap.models.policy import Policy
from dynsnap.models.protocol import DesiredState, Reason

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
POLICY = Policy(enabled=True, idle_after=300.0, min_active=1, wake_at_inflight=4.0)
IDLE = 400  # seconds idle: past idle-after
NO_DEMAND = Demand(0)
S, ST, Q, C, A, WK, N, B = (Phase.SERVING, Phase.STARTING, Phase.QUIESCING, Phase.CAPTURING, Phase.ASLEEP,
                            Phase.WAKING, Phase.NEW, Phase.BROKEN)


def w(name: str, phase: Phase, *, idle: float | None = IDLE, active_ago: float | None = None,
      captured_ago: float | None = None, override: DesiredState | None = None) -> WorkerView:
    """A worker: idle for ``idle`` seconds (None: busy), last active ``active_ago`` seconds ago
    (default: when it went idle), captured ``captured_ago`` seconds ago."""
    ago = active_ago if active_ago is not None else idle
    return WorkerView(name=name, phase=phase,
                      idle_since=NOW - timedelta(seconds=idle) if idle is not None else None,
                      last_activity=NOW - timedelta(seconds=ago) if ago is not None else None,
                      last_capture=NOW - timedelta(seconds=captured_ago) if captured_ago is not None else None,
                      override=override.value if override else None)


def wants(workers: list[WorkerView], policy: Policy = POLICY, demand: Demand | None = NO_DEMAND) -> dict[str, Want]:
    return {k: d.want for k, d in plan(workers, policy, demand, NOW).items()}


def serving_after(workers: list[WorkerView], decisions: dict[str, Decision]) -> int:
    return sum(1 for x in workers if x.phase == Phase.SERVING and decisions[x.name].want == Want.AWAKE)


@pytest.mark.parametrize(("min_active", "n", "asleep"), [(1, 1, 0), (1, 2, 1), (1, 3, 2), (2, 3, 1), (3, 3, 0),
                                                         (2, 5, 3), (5, 3, 0)])
def test_idle_serving_workers_sleep_down_to_min_active_never_below(min_active: int, n: int, asleep: int) -> None:
    workers = [w(f"w{i}", S, idle=IDLE + i) for i in range(n)]
    got = plan(workers, replace(POLICY, min_active=min_active), Demand(0), NOW)
    assert sum(d.want == Want.ASLEEP for d in got.values()) == asleep
    assert serving_after(workers, got) == min(n, min_active)


@pytest.mark.parametrize("other", [ST, WK, N], ids=["starting", "waking", "new"])
def test_a_worker_still_waking_or_verifying_does_not_count_as_serving(other: Phase) -> None:
    # Two awake, but only one of them serves: the serving one may not sleep (min-active 1).
    got = plan([w("a", S), w("b", other)], POLICY, Demand(0), NOW)
    assert got["a"].want == Want.AWAKE and "must stay serving" in got["a"].why
    assert got["b"].want == Want.AWAKE
    # Once both serve, one may go.
    assert sorted(wants([w("a", S), w("b", S)]).values()) == [Want.ASLEEP, Want.AWAKE]


def test_the_most_recently_active_stays_awake() -> None:
    got = wants([w("a", S, active_ago=900), w("b", S, active_ago=320), w("c", S, active_ago=600)])
    assert got == {"a": Want.ASLEEP, "b": Want.AWAKE, "c": Want.ASLEEP}


@pytest.mark.parametrize(("idle", "want"), [(None, Want.AWAKE), (100, Want.AWAKE), (299, Want.AWAKE),
                                            (300, Want.ASLEEP), (IDLE, Want.ASLEEP)])
def test_only_idle_past_idle_after_sleeps(idle: float | None, want: Want) -> None:
    got = plan([w("keep", S, idle=None, active_ago=1), w("x", S, idle=idle)], POLICY, Demand(0), NOW)
    assert got["x"].want == want, got["x"]
    if idle is not None and idle < POLICY.idle_after:
        assert got["x"].again_after == pytest.approx(POLICY.idle_after - idle)  # look again when it crosses


@pytest.mark.parametrize(("served_ago", "want"), [(1, Want.AWAKE), (299, Want.AWAKE), (300, Want.ASLEEP),
                                                  (IDLE + 100, Want.ASLEEP)])
def test_a_worker_back_in_serving_is_idle_only_from_its_return(served_ago: float, want: Want) -> None:
    # The agent's idle facts come back from a sleep as they were before it (idle 400 s here): a worker
    # woken (or recalled) and verified 1 s ago has been idle 1 s, not 400 s, and is not quiesced again
    # before the load that woke it reaches it (the demo met this: woken, verified, quiesced at once).
    x = replace(w("x", S, idle=IDLE), serving_since=NOW - timedelta(seconds=served_ago))
    got = plan([w("keep", S, idle=None, active_ago=1), x], POLICY, Demand(0), NOW)
    assert got["x"].want == want, got["x"]
    if want == Want.AWAKE:
        assert got["x"].why == f"idle {served_ago:.0f}s of {POLICY.idle_after:g}s"
        assert got["x"].again_after == pytest.approx(POLICY.idle_after - served_ago)
    # busy is busy, whenever it came back
    assert plan([w("keep", S, idle=None), replace(x, idle_since=None)], POLICY, Demand(0), NOW)["x"].want \
        == Want.AWAKE


@pytest.mark.parametrize(("back_ago", "want"), [(0.5, Want.AWAKE), (SETTLE_S - 0.1, Want.AWAKE),
                                                (SETTLE_S, Want.ASLEEP), (60, Want.ASLEEP)])
def test_a_worker_just_back_in_serving_is_no_floor_for_another_to_sleep(back_ago: float, want: Want) -> None:
    # "back" had its quiesce called off (or was woken) back_ago seconds ago and serves; "old" has been idle
    # long. kubelet may still take "back" out of its EndpointSlice for a moment (its copy of the serving
    # gate lags), so until it settles, "old" stays: the component is never left with none in serving.
    # The real node met this (node/test_controller.py, tier snapshot): a 404 from the frontend.
    back = replace(w("back", S, idle=IDLE, active_ago=1), serving_since=NOW - timedelta(seconds=back_ago))
    got = plan([w("old", S, idle=IDLE), back], POLICY, Demand(0), NOW)
    assert got["back"].want == Want.AWAKE  # the most recently active stays awake either way
    assert got["old"].want == want, got["old"]
    if want == Want.AWAKE:
        assert got["old"].why == f"idle, but 1 must stay serving (1 back in serving less than {SETTLE_S:g}s ago " \
            "not counted yet)"
        assert got["old"].again_after == pytest.approx(SETTLE_S - back_ago)  # looked at again once it settles
    # A manual suspend waits for it too, refused with min-active meanwhile.
    sus = plan([w("old", S, idle=None, override=DesiredState.SUSPENDED), back], POLICY, Demand(0), NOW)["old"]
    assert (sus.want, sus.refused) == ((Want.AWAKE, True) if want == Want.AWAKE else (Want.ASLEEP, False)), sus


def test_manual_suspend_is_refused_with_min_active_when_it_would_break_it() -> None:
    got = plan([w("a", S, idle=None, override=DesiredState.SUSPENDED)], POLICY, Demand(0), NOW)
    assert got["a"].want == Want.AWAKE and got["a"].refused
    assert "min-active 1" in got["a"].why
    # With a peer serving it is granted, even though it is busy and no idleness asks for it.
    got = plan([w("a", S, idle=None, override=DesiredState.SUSPENDED), w("b", S, idle=None)], POLICY,
               Demand(0), NOW)
    assert got["a"] == Decision(Want.ASLEEP, "manual override: suspended")
    assert got["b"].want == Want.AWAKE
    # A peer that is only starting does not serve: refused.
    got = plan([w("a", S, override=DesiredState.SUSPENDED), w("b", ST)], POLICY, Demand(0), NOW)
    assert got["a"].refused and got["a"].want == Want.AWAKE


def test_manual_active_wins_over_idleness_and_wakes_a_sleeper() -> None:
    got = plan([w("a", S), w("b", S, override=DesiredState.ACTIVE), w("c", A, captured_ago=50,
                                                                       override=DesiredState.ACTIVE)],
               POLICY, Demand(0), NOW)
    assert got["b"] == Decision(Want.AWAKE, "manual override: active")
    assert got["c"] == Decision(Want.AWAKE, "manual override: active")
    assert got["a"].want == Want.ASLEEP  # b serves and stays, so a may go


def test_unknown_demand_sleeps_nothing_and_wakes_nothing_beyond_min_active() -> None:
    got = plan([w("a", S), w("b", S), w("c", A, captured_ago=10)], POLICY, None, NOW)
    assert {k: d.want for k, d in got.items()} == {"a": Want.AWAKE, "b": Want.AWAKE, "c": Want.ASLEEP}
    assert "demand unknown" in got["a"].why
    # Below min-active it still restores min-active (that needs no demand).
    got = plan([w("a", A, captured_ago=20), w("b", A, captured_ago=10)], POLICY, None, NOW)
    assert got["b"] == Decision(Want.AWAKE, "min-active 1") and got["a"].want == Want.ASLEEP


def test_demand_sets_how_many_are_needed() -> None:
    assert needed(POLICY, None) == 1
    assert needed(POLICY, Demand(0)) == 1
    assert needed(POLICY, Demand(4)) == 1
    assert needed(POLICY, Demand(4.5)) == 2
    # The queue is a part of in-flight (Dynamo's gauges): 5 in flight, 4 of them queued, is 5, not 9.
    assert needed(POLICY, Demand(inflight=5, queued=4)) == 2
    assert needed(replace(POLICY, wake_at_inflight=1.0), Demand(inflight=1, queued=1)) == 1
    assert needed(POLICY, Demand(inflight=0, queued=9)) == 3  # a page with the queue gauge alone
    assert needed(replace(POLICY, min_active=3), Demand(1)) == 3
    # Idle workers stay awake while the demand needs them.
    got = wants([w("a", S), w("b", S), w("c", S)], demand=Demand(inflight=6))
    assert sorted(got.values()) == [Want.ASLEEP, Want.AWAKE, Want.AWAKE]


def test_a_deficit_calls_off_a_quiesce_first_then_wakes_the_most_recently_captured() -> None:
    workers = [w("busy", S, idle=None), w("q", Q), w("old", A, captured_ago=100), w("new", A, captured_ago=10),
               w("cap", C, captured_ago=50)]
    # Need 2: the quiesce is called off, nobody is woken.
    got = plan(workers, POLICY, Demand(8), NOW)
    assert got["q"].want == Want.AWAKE and "capture called off" in got["q"].why
    assert [got[n].want for n in ("old", "new", "cap")] == [Want.ASLEEP] * 3
    # Need 3: then the most recently captured wakes.
    got = plan(workers, POLICY, Demand(12), NOW)
    assert [got[n].want for n in ("q", "new", "cap", "old")] == [Want.AWAKE, Want.AWAKE, Want.ASLEEP, Want.ASLEEP]
    assert got["new"].why.startswith("demand 12 ") and "needs 3 awake" in got["new"].why, got["new"].why
    # Need 5: all of them, a capture still under way included.
    got = plan(workers, POLICY, Demand(20), NOW)
    assert all(d.want == Want.AWAKE for d in got.values())
    # No deficit: the quiesce carries on.
    got = plan(workers, POLICY, Demand(0), NOW)
    assert got["q"] == Decision(Want.ASLEEP, "quiescing for a capture")


def test_a_manual_suspend_is_not_called_off_nor_woken_by_demand() -> None:
    got = plan([w("busy", S, idle=None), w("q", Q, override=DesiredState.SUSPENDED),
                w("s", A, captured_ago=5, override=DesiredState.SUSPENDED), w("t", A, captured_ago=50)],
               POLICY, Demand(8), NOW)
    assert got["q"].want == Want.ASLEEP and got["s"].want == Want.ASLEEP
    assert got["t"].want == Want.AWAKE  # the deficit goes to a worker not held asleep by hand


def test_broken_workers_are_left_alone_and_do_not_count() -> None:
    got = plan([w("a", S), w("b", B)], POLICY, Demand(0), NOW)
    assert got["b"].want == Want.LEAVE
    assert got["a"].want == Want.AWAKE  # the broken one does not serve in its place


def test_the_plan_is_the_same_in_any_order() -> None:
    workers = [w("a", S, active_ago=IDLE), w("b", S, active_ago=IDLE), w("c", S, active_ago=IDLE),
               w("d", A, captured_ago=30), w("e", A, captured_ago=30), w("f", Q), w("g", ST), w("h", B)]
    first = plan(workers, POLICY, Demand(2), NOW)
    rng = random.Random(7)
    for _ in range(20):
        shuffled = workers[:]
        rng.shuffle(shuffled)
        assert plan(shuffled, POLICY, Demand(2), NOW) == first
    # Ties are broken by name: of three equally idle serving workers, "a" stays.
    assert [n for n in "abc" if first[n].want == Want.AWAKE] == ["a"]
    # And of two captured at the same time, "d" is woken first (need 6 of 4 awake: the quiesce, then d).
    more = plan(workers, POLICY, Demand(21), NOW)
    assert (more["f"].want, more["d"].want, more["e"].want) == (Want.AWAKE, Want.AWAKE, Want.ASLEEP)


def test_a_worker_whose_wake_failed_is_not_awake_and_another_is_woken_in_its_place() -> None:
    # min-active 2: one serves, one was woken and its wake failed (broken), two sleep. The failed one
    # counts as neither awake nor waking, so the most recently captured sleeper is woken for it.
    workers = [w("a", S), w("failed", B, captured_ago=5), w("s1", A, captured_ago=10), w("s2", A, captured_ago=60)]
    got = plan(workers, replace(POLICY, min_active=2), Demand(0), NOW)
    assert got["failed"].want == Want.LEAVE
    assert (got["s1"].want, got["s2"].want) == (Want.AWAKE, Want.ASLEEP)
    # Counted as waking instead (as before issue 18), nothing would be woken in its place.
    got = plan([*workers[:1], replace(workers[1], phase=WK), *workers[2:]], replace(POLICY, min_active=2), Demand(0),
               NOW)
    assert (got["s1"].want, got["s2"].want) == (Want.ASLEEP, Want.ASLEEP)


def test_a_worker_whose_capture_was_refused_for_good_serves_and_is_never_chosen_to_sleep() -> None:
    why = "capture refused by the agent: SeccompOff (...); not asked again until ..."
    refused = replace(w("a", S, idle=IDLE + 50), sleep_refused=why)
    got = plan([refused, w("b", S), w("c", S, idle=IDLE + 10)], POLICY, Demand(0), NOW)
    assert got["a"].want == Want.AWAKE and got["a"].why == why and not got["a"].refused
    # the others sleep down to min-active, the refused one counting as serving
    assert (got["b"].want, got["c"].want) == (Want.ASLEEP, Want.ASLEEP)
    # not even the manual override: refused, with the refusal's reason for its Event
    got = plan([replace(refused, override=DesiredState.SUSPENDED.value), w("b", S, idle=None)], POLICY, Demand(0),
               NOW)
    assert got["a"].want == Want.AWAKE and got["a"].refused and got["a"].reason == Reason.CAPTURE_REFUSED
    assert got["a"].why.startswith("manual override suspended refused: capture refused")


WOR = Policy(enabled=True, idle_after=300.0, min_active=0, wake_on_request=True, wake_at_inflight=4.0)


@pytest.mark.parametrize(("workers", "routable", "normal"), [
    # the last awake worker, idle, the others asleep: it sleeps routable
    ([w("a", S), w("b", A)], {"a"}, set()),
    ([w("a", S)], {"a"}, set()),
    # two idle and awake: the least wanted sleeps as any sleeper (quiesced), the other stays for now
    ([w("a", S, idle=IDLE), w("b", S, idle=IDLE + 10)], set(), {"b"}),
    # another still quiescing: the last one waits (no routable sleeper beside a capture under way)
    ([w("a", S), w("b", Q)], set(), set()),
    # another waking (not yet serving): it stays, lest the component have none serving meanwhile
    ([w("a", S), w("b", WK)], set(), set()),
])
def test_with_wake_on_request_only_the_last_worker_sleeps_routable(workers: list[WorkerView], routable: set[str],
                                                                   normal: set[str]) -> None:
    out = plan(workers, WOR, NO_DEMAND, NOW)
    got_routable = {n for n, d in out.items() if d.want == Want.ASLEEP and d.routable}
    got_normal = {n for n, d in out.items() if d.want == Want.ASLEEP and not d.routable
                  and n in {x.name for x in workers if x.phase in (S, ST)}}
    assert got_routable == routable and got_normal == normal, out


def test_without_wake_on_request_no_worker_sleeps_routable() -> None:
    out = plan([w("a", S), w("b", S, idle=IDLE + 10)], POLICY, NO_DEMAND, NOW)
    assert not any(d.routable for d in out.values())


@pytest.mark.parametrize(("demand", "woken"), [
    # the one request is in the routable sleeper: its agent wakes it; the controller wakes nothing
    (Demand(1), set()),
    # more than it can take (4 per worker): the others are woken for the rest, the routable one still its agent's
    (Demand(9), {"a", "c"}),
])
def test_a_routable_sleeper_is_its_agents_to_wake_and_counts_as_waking(demand: Demand, woken: set[str]) -> None:
    out = plan([replace(w("a", A, captured_ago=10)), replace(w("b", A, captured_ago=100), routable=True),
                replace(w("c", A, captured_ago=50))], WOR, demand, NOW)
    assert {n for n, d in out.items() if d.want == Want.AWAKE} == woken, out
    assert out["b"].want == Want.ASLEEP and "wake it at its agent" in out["b"].why


def test_a_routable_sleeper_overridden_active_is_woken_by_the_controller() -> None:
    out = plan([replace(w("b", A), routable=True, override=DesiredState.ACTIVE.value)], WOR, Demand(0), NOW)
    assert out["b"].want == Want.AWAKE
