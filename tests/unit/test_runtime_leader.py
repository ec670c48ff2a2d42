"""The elector refuses timings under which a deposed leader could still act after another replica
took over (client-go's validation), and runs once. Its behaviour against a real API server is in
tests/integration/test_leader.py."""

from __future__ import annotations

import asyncio

import pytest

from dynsnap.k8s.leases import Leases
from dynsnap.runtime.leader import LeaderElector, LeadershipLost

# Never contacted: every case here fails before a request.
UNUSED_LEASES = Leases(None, namespace="ns", identity="replica-a")  # type: ignore[arg-type]


@pytest.mark.parametrize(("duration", "deadline", "period", "why"), [
    (10, 10.0, 2.0, r"lease_duration \(10\) must exceed renew_deadline \(10"),  # could expire before we notice
    (15, 2.0, 2.0, r"renew_deadline \(2.0\) must exceed 1.2 x retry_period"),  # no room for a retry
    (15, 10.0, 0.0, "retry_period must be positive"),  # would spin
])
def test_timings_that_would_let_two_replicas_act_are_refused(duration: int, deadline: float, period: float,
                                                            why: str) -> None:
    with pytest.raises(ValueError, match=why):
        LeaderElector(UNUSED_LEASES, "lead", lease_duration=duration, renew_deadline=deadline, retry_period=period)


def test_defaults_are_client_gos_and_a_fresh_elector_does_not_lead() -> None:
    e = LeaderElector(UNUSED_LEASES, "lead")
    assert (e.lease_duration, e.renew_deadline, e.retry_period) == (15, 10.0, 2.0)
    assert e.identity == "replica-a" and not e.leading and not e.lost.is_set()


async def test_an_elector_runs_once() -> None:
    e = LeaderElector(UNUSED_LEASES, "lead")
    stop = asyncio.Event()
    stop.set()
    await e.run(stop)  # stopped before its first attempt: no request
    assert e.stats.acquire_attempts == 0
    with pytest.raises(RuntimeError, match="runs once"):
        await e.run(stop)
    assert await e.release() is False  # never held: nothing to release, no request


def test_the_loss_names_who_lost_which_lease_and_why() -> None:
    err = LeadershipLost(lease="dynsnap-controller", identity="pod-1", reason="the lease is held by pod-2")
    assert str(err) == "pod-1 lost the leadership of lease dynsnap-controller: the lease is held by pod-2"
