"""Leader election and the manager against the real API server: of two replicas exactly one
leads and acts; a leader that stops hands over at once through the released lease; a leader
whose lease is taken, or whose API server goes away or stops answering, declares the loss by
itself and its work is cancelled before another replica could take over.

Each replica is a ``Manager`` with a ``LeaderElector`` in this process, under a service
account whose Role grants only ``get``/``create``/``update`` on Leases in the test namespace
(what deploy/rbac/controller.yaml grants the controller), so the elector is shown to need no
more. Its work is ``stub_counter``: it stands in for the controller's reconcile workers and
increments a ConfigMap (as admin, with optimistic concurrency, so two replicas acting at once
would make one fail with 409 and end its manager with that error).

Timing: a 30 s lease, 6 s renew deadline, 1 s retry period. No test asserts a duration: they
assert outcomes, their causes (the reason in ``LeadershipLost``) and the order of events.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta

import pytest

from dynsnap.k8s import times
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Conflict, NotFound, RetryExhausted
from dynsnap.k8s.leases import Leases
from dynsnap.models import resources as R
from dynsnap.runtime.leader import LeaderElector, LeadershipLost
from dynsnap.runtime.manager import Manager
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault

pytestmark = pytest.mark.cluster

NS = TEST_NAMESPACE
LEASE_DURATION = 30
RENEW_DEADLINE = 6.0
RETRY_PERIOD = 1.0
BOUND = 60.0  # every wait on an outcome gives up after this many seconds
# The leader-election Role of deploy/rbac/controller.yaml, in the test namespace.
LEASE_RULES = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}]


@dataclass
class Identity:
    """A service account with only the leader-election Role, and a token for it."""

    name: str
    token: str


@pytest.fixture
async def lease_account(cluster: LocalCluster) -> AsyncIterator[Identity]:
    api = cluster.api
    name = f"elector-{uuid.uuid4().hex[:6]}"
    await api.create(R.SERVICE_ACCOUNTS, {"metadata": {"name": name, "namespace": NS}})
    await api.apply(R.ROLES, {"metadata": {"name": name, "namespace": NS}, "rules": LEASE_RULES})
    await api.apply(R.ROLE_BINDINGS, {
        "metadata": {"name": name, "namespace": NS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NS}]})
    token = await api.request_token(name, namespace=NS, expiration_seconds=3600)
    yield Identity(name, token)
    for res in (R.ROLE_BINDINGS, R.ROLES, R.SERVICE_ACCOUNTS):
        with contextlib.suppress(NotFound):
            await api.delete(res, name, namespace=NS)


@pytest.fixture
async def names(cluster: LocalCluster) -> AsyncIterator[tuple[str, str]]:
    """A fresh lease name and a counter ConfigMap (count 0); both deleted afterwards."""
    lease, counter = f"lead-{uuid.uuid4().hex[:6]}", f"count-{uuid.uuid4().hex[:6]}"
    await cluster.api.create(R.CONFIG_MAPS, {"metadata": {"name": counter, "namespace": NS},
                                             "data": {"count": "0", "by": ""}})
    yield lease, counter
    for res, name in ((R.LEASES, lease), (R.CONFIG_MAPS, counter)):
        with contextlib.suppress(NotFound):
            await cluster.api.delete(res, name, namespace=NS)


def stub_counter(api: Kube, counter: str, who: str, journal: list[str], writes: list[int],
                 winding_down: Callable[[], Awaitable[None] | None]) -> Callable[[asyncio.Event], Awaitable[None]]:
    """Stands in for a controller's reconcile workers: while it runs it increments the ConfigMap
    ``counter`` every 0.2 s (read, then replace with the read resourceVersion), appending each
    value it wrote to ``writes``; it records in ``journal`` how it started and ended. On ``stop``
    it awaits ``winding_down()`` (work still finishing), makes one last write and returns. A 409
    (another replica wrote meanwhile) is not caught: it ends the replica's manager with it."""

    async def write() -> None:
        try:
            cm = await api.get(R.CONFIG_MAPS, counter, namespace=NS)
            n = int(cm["data"]["count"]) + 1
            await api.replace(R.CONFIG_MAPS, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
                "name": counter, "namespace": NS, "resourceVersion": cm["metadata"]["resourceVersion"]},
                "data": {"count": str(n), "by": who}})
            writes.append(n)
        except RetryExhausted:  # an API server outage: a reconcile would retry too (not a 409)
            journal.append(f"{who} write failed")

    async def run(stop: asyncio.Event) -> None:
        journal.append(f"{who} started")
        try:
            while not stop.is_set():
                await write()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)
            pending = winding_down()
            if pending is not None:
                await pending
            await write()
            journal.append(f"{who} returned")
        except asyncio.CancelledError:
            journal.append(f"{who} cancelled")
            raise
    return run


@dataclass
class Replica:
    """One controller replica: its client (the lease account's token), elector and manager."""

    identity: str
    kube: Kube
    elector: LeaderElector
    manager: Manager
    writes: list[int] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    losses: list[LeadershipLost] = field(default_factory=list)
    # What its work awaits after ``stop`` before its last write (default: nothing).
    winding_down: Callable[[], Awaitable[None] | None] = lambda: None

    def start(self) -> None:
        self.task = asyncio.create_task(self.manager.run(self.stop), name=f"replica {self.identity}")

    async def outcome(self) -> BaseException | None:
        """How ``manager.run`` ended (None: returned), bounded."""
        assert self.task is not None
        done, _ = await asyncio.wait({self.task}, timeout=BOUND)
        assert done, f"replica {self.identity} did not end"
        return self.task.exception()


@dataclass
class Contenders:
    """The replicas of one test, contending for its lease; ``journal`` is their work's shared record."""

    cluster: LocalCluster
    token: str
    lease: str
    counter: str
    journal: list[str] = field(default_factory=list)
    made: list[Replica] = field(default_factory=list)

    def replica(self, identity: str, *, server: str | None = None) -> Replica:
        """A replica (not started) whose client talks to ``server`` (default: the API server)."""
        assert self.cluster.cp is not None and self.cluster.cp.pki is not None
        kube = Kube.from_token(server=server or self.cluster.cp.url, token=self.token,
                               ca_cert=self.cluster.cp.pki.ca_cert)
        elector = LeaderElector(Leases(kube, namespace=NS, identity=identity), self.lease,
                                lease_duration=LEASE_DURATION, renew_deadline=RENEW_DEADLINE,
                                retry_period=RETRY_PERIOD)
        manager = Manager(f"replica {identity}", health_host="127.0.0.1", health_port=0, elector=elector)
        r = Replica(identity, kube, elector, manager)
        elector.on_lost(r.losses.append)
        manager.add("work", stub_counter(self.cluster.api, self.counter, identity, self.journal, r.writes,
                                         lambda: r.winding_down()))
        self.made.append(r)
        return r


@pytest.fixture
async def contenders(cluster: LocalCluster, lease_account: Identity, names: tuple[str, str]
                     ) -> AsyncIterator[Contenders]:
    c = Contenders(cluster, lease_account.token, *names)
    yield c
    for r in c.made:  # whatever a test left running
        r.stop.set()
    for r in c.made:
        if r.task is not None:
            await asyncio.wait({r.task}, timeout=BOUND)
            if not r.task.done():
                r.task.cancel()
                await asyncio.wait({r.task}, timeout=BOUND)
            elif not r.task.cancelled():
                r.task.exception()
        await r.kube.close()


async def http_status(port: int | None, path: str) -> int:
    assert port is not None
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    return int(head.split()[1])


async def until(what: str, check: Callable[[], Awaitable[bool] | bool], *, timeout: float = BOUND) -> None:
    """Poll ``check`` every 0.1 s until it holds; bounded by ``timeout``."""
    async with asyncio.timeout(timeout):
        for _ in range(int(timeout * 20)):
            got = check()
            if got if isinstance(got, bool) else await got:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"never: {what}")


async def counter_value(api: Kube, counter: str) -> tuple[int, str]:
    cm = await api.get(R.CONFIG_MAPS, counter, namespace=NS)
    return int(cm["data"]["count"]), cm["data"]["by"]


async def lease_spec(api: Kube, lease: str) -> Obj:
    spec: Obj = (await api.get(R.LEASES, lease, namespace=NS))["spec"]
    return spec


async def test_exactly_one_of_two_leads_and_a_graceful_stop_hands_over_through_the_release(
        cluster: LocalCluster, names: tuple[str, str], contenders: Contenders) -> None:
    api = cluster.api
    lease, counter = names
    journal = contenders.journal
    a, b = contenders.replica("replica-a"), contenders.replica("replica-b")
    a.start()
    b.start()
    waits = {asyncio.ensure_future(r.elector.wait_leading()): r for r in (a, b)}
    done, pending = await asyncio.wait(waits, timeout=BOUND, return_when=asyncio.FIRST_COMPLETED)
    for f in pending:
        f.cancel()
    assert done, "neither replica became the leader"
    leader = waits[done.pop()]
    follower = b if leader is a else a

    # The follower keeps trying and is refused while the leader renews; only the leader acts.
    await until("the leader acts", lambda: len(leader.writes) >= 3)
    await until("the follower tried 3 times", lambda: follower.elector.stats.acquire_attempts >= 3)
    assert leader.elector.leading and not follower.elector.leading
    assert follower.elector.stats.acquisitions == 0 and f"{follower.identity} started" not in journal
    assert (await lease_spec(api, lease))["holderIdentity"] == leader.identity
    # The leader writes on while the counter is read: the value read is its write of that moment or a
    # later one (the comparison reads writes[-1] after the counter).
    last = leader.writes[-1]
    value, writer = await counter_value(api, counter)
    assert writer == leader.identity and value in leader.writes and value >= last, (value, writer, last)
    assert leader.elector.stats.renewals >= 1
    assert (await http_status(leader.manager.port, "/readyz"), await http_status(follower.manager.port, "/readyz")) \
        == (200, 503)
    assert await http_status(follower.manager.port, "/healthz") == 200

    # A graceful stop: the leader's work winds down (while the follower is refused twice more),
    # makes its last write and returns; only then does the leader release the lease, and the
    # follower takes it over before the leader's last renewal could have expired.
    async def until_follower_refused_twice_more() -> None:
        seen = follower.elector.stats.acquire_attempts
        await until("the follower refused twice more", lambda: follower.elector.stats.acquire_attempts >= seen + 2)
    leader.winding_down = until_follower_refused_twice_more
    renewed = times.parse_time((await lease_spec(api, lease))["renewTime"])
    leader.stop.set()
    assert await leader.outcome() is None
    assert leader.elector.stats.releases == 1 and not leader.elector.leading
    await asyncio.wait_for(follower.elector.wait_leading(), BOUND)
    await until("the new leader acts", lambda: len(follower.writes) >= 2)
    spec = await lease_spec(api, lease)
    assert spec["holderIdentity"] == follower.identity and spec["leaseTransitions"] == 1
    assert times.parse_time(spec["acquireTime"]) < renewed + timedelta(seconds=LEASE_DURATION)
    assert journal.index(f"{leader.identity} returned") < journal.index(f"{follower.identity} started")
    assert follower.writes[0] == leader.writes[-1] + 1  # no write lost, none made twice
    assert leader.losses == [] and follower.losses == []

    follower.stop.set()
    assert await follower.outcome() is None
    spec = await lease_spec(api, lease)
    assert "holderIdentity" not in spec  # released: the next replica need not wait


async def test_a_stolen_lease_is_lost_at_once_and_the_work_is_cancelled(
        cluster: LocalCluster, names: tuple[str, str], contenders: Contenders) -> None:
    api = cluster.api
    lease, counter = names
    journal = contenders.journal
    victim = contenders.replica("replica-v")
    victim.start()
    await asyncio.wait_for(victim.elector.wait_leading(), BOUND)
    await until("the leader acts", lambda: len(victim.writes) >= 3)

    # Someone else writes the Lease as theirs, freshly renewed (a replica whose clock or network
    # made it believe the lease had expired). Retried on 409: the victim renews meanwhile.
    for _ in range(20):
        obj = await api.get(R.LEASES, lease, namespace=NS)
        now = times.micro_time(times.now())
        obj["spec"].update(holderIdentity="intruder", renewTime=now, acquireTime=now, leaseDurationSeconds=60,
                           leaseTransitions=obj["spec"].get("leaseTransitions", 0) + 1)
        try:
            await api.replace(R.LEASES, obj)
            break
        except Conflict:
            continue
    else:
        raise AssertionError("could not write the intruder's lease")

    err = await victim.outcome()
    assert isinstance(err, LeadershipLost) and err.identity == "replica-v"
    assert err.reason == "the lease is held by intruder"  # seen on its next renew, not by a deadline
    assert victim.losses == [err] and victim.elector.lost.is_set() and not victim.elector.leading
    # Cancelled, not asked to finish: it stopped in the middle of its loop.
    assert f"{victim.identity} cancelled" in journal and f"{victim.identity} returned" not in journal
    assert victim.manager.phase == "stopped"

    # The victim's work stays stopped while time passes (a second replica's refused attempts
    # measure it), and it neither wrote the Lease back nor released the intruder's hold.
    value, by = await counter_value(api, counter)
    assert by == victim.identity and value in (victim.writes[-1], victim.writes[-1] + 1)  # +1: a write in flight
    witness = contenders.replica("replica-w")
    witness.start()
    await until("the witness was refused 3 times", lambda: witness.elector.stats.acquire_attempts >= 3)
    assert await counter_value(api, counter) == (value, by)
    spec = await lease_spec(api, lease)
    assert spec["holderIdentity"] == "intruder" and witness.elector.stats.acquisitions == 0
    assert victim.elector.stats.releases == 0


async def test_an_api_server_that_is_down_during_renewal_means_loss_not_a_hang(
        cluster: LocalCluster, names: tuple[str, str], contenders: Contenders) -> None:
    api = cluster.api
    lease, _ = names
    journal = contenders.journal
    victim = contenders.replica("replica-d")
    victim.start()
    await asyncio.wait_for(victim.elector.wait_leading(), BOUND)
    await until("the leader acts", lambda: len(victim.writes) >= 2)
    outcome: list[BaseException | None] = []

    async def while_down() -> None:
        outcome.append(await victim.outcome())

    await cluster.restart_apiserver(while_down=while_down)
    [err] = outcome
    assert isinstance(err, LeadershipLost), f"ended with {err!r}"
    assert err.reason.startswith(f"could not renew within {RENEW_DEADLINE:g} s"), err.reason
    assert f"{victim.identity} cancelled" in journal and victim.manager.phase == "stopped"
    # The API server was down for the release too: the lease is still the victim's, and it will
    # expire by itself.
    assert victim.elector.stats.releases == 0
    assert (await lease_spec(api, lease))["holderIdentity"] == victim.identity


async def test_an_api_server_that_stops_answering_during_renewal_means_loss_not_a_hang(
        cluster: LocalCluster, names: tuple[str, str], contenders: Contenders) -> None:
    assert cluster.cp is not None
    api = cluster.api
    lease, counter = names
    journal = contenders.journal
    async with FakeApiProxy.in_front_of(cluster.cp) as proxy:
        victim = contenders.replica("replica-s", server=proxy.url)
        victim.start()
        await asyncio.wait_for(victim.elector.wait_leading(), BOUND)
        await until("the leader acts", lambda: len(victim.writes) >= 2)
        # Every Lease request now waits forever (a hung load balancer); the work's own requests
        # go to the API server directly and keep succeeding: only the loss can stop it.
        proxy.add(Fault("stall", path_contains="/leases/", times=None))
        try:
            err = await victim.outcome()
        finally:
            proxy.clear()
            proxy.release()
    assert isinstance(err, LeadershipLost), f"ended with {err!r}"
    assert err.reason == f"could not renew within {RENEW_DEADLINE:g} s (no answer before the deadline)"
    assert f"{victim.identity} cancelled" in journal and victim.manager.phase == "stopped"
    assert victim.elector.stats.renew_failures >= 1
    value, by = await counter_value(api, counter)
    assert by == victim.identity and value in (victim.writes[-1], victim.writes[-1] + 1)
    assert (await lease_spec(api, lease))["holderIdentity"] == victim.identity  # its release stalled too
