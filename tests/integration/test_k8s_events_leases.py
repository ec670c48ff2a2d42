"""Events and Leases against the real API server: what the server stores is what was meant."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta

import pytest

from dynsnap.k8s import retry, times
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.events import EventRecorder
from dynsnap.k8s.leases import Leases
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault

pytestmark = pytest.mark.cluster

MICRO_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")


@pytest.fixture(autouse=True)
def instant_retries() -> Iterator[None]:
    retry.set_instant(True)
    yield
    retry.set_instant(None)


@pytest.fixture
async def config_map(cluster: LocalCluster) -> AsyncIterator[Obj]:
    name = f"ev-{uuid.uuid4().hex[:6]}"
    cm = await cluster.api.create(R.CONFIG_MAPS, {"metadata": {"name": name, "namespace": TEST_NAMESPACE}})
    cm.update(apiVersion="v1", kind="ConfigMap")
    yield cm
    await cluster.api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)


async def _events_about(api: Kube, uid: str) -> list[Obj]:
    listing = await api.list(R.EVENTS, namespace=TEST_NAMESPACE)
    return [e for e in listing["items"] if e.get("regarding", {}).get("uid") == uid]


async def test_events_regarding_an_object_with_series_dedupe(cluster: LocalCluster, config_map: Obj) -> None:
    api = cluster.api
    uid = config_map["metadata"]["uid"]
    rec = EventRecorder(api, reporting_controller="dynsnap.io/controller", reporting_instance="test-0")
    long_note = "é" * 2000  # 4000 bytes: cut to the API's 1 KiB
    first = await rec.warning(config_map, reason="CaptureFailed", action="Capture", note=long_note)
    again = await rec.warning(config_map, reason="CaptureFailed", action="Capture", note=long_note)
    other = await rec.normal(config_map, reason="Woken", action="Wake", note="verified 3/3")
    assert first is not None and again is not None and other is not None
    stored = {e["reason"]: e for e in await _events_about(api, uid)}
    assert set(stored) == {"CaptureFailed", "Woken"}  # the repeat folded into the first Event
    failed = stored["CaptureFailed"]
    assert failed["regarding"] == {"apiVersion": "v1", "kind": "ConfigMap", "name": config_map["metadata"]["name"],
                                   "namespace": TEST_NAMESPACE, "uid": uid}
    assert failed["type"] == "Warning" and failed["action"] == "Capture"
    assert failed["reportingController"] == "dynsnap.io/controller" and failed["reportingInstance"] == "test-0"
    assert len(failed["note"].encode()) <= 1024 and failed["note"].endswith("…")
    assert failed["series"]["count"] == 2 and MICRO_TIME.match(failed["series"]["lastObservedTime"])
    assert MICRO_TIME.match(failed["eventTime"])
    assert stored["Woken"]["type"] == "Normal" and "series" not in stored["Woken"]
    assert (rec.stats.created, rec.stats.series_updates, rec.stats.failures) == (2, 1, 0)


async def test_event_failures_never_reach_the_caller(cluster: LocalCluster, config_map: Obj) -> None:
    assert cluster.cp is not None and cluster.cp.pki is not None
    async with FakeApiProxy.in_front_of(cluster.cp) as proxy:
        proxy.add(Fault("respond", status=500, times=None))
        kube = Kube.from_token(server=proxy.url, token=cluster.cp.identities["admin"].token,
                               ca_cert=cluster.cp.pki.ca_cert)
        async with kube:
            rec = EventRecorder(kube, reporting_controller="dynsnap.io/controller", reporting_instance="test-0")
            assert await rec.normal(config_map, reason="Woken", action="Wake", note="x") is None
            # A reference without a uid is refused here, not by the server, and not raised either.
            no_uid = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": TEST_NAMESPACE}}
            assert await rec.normal(no_uid, reason="Woken", action="Wake", note="x") is None
    assert rec.stats.failures == 2 and "RetryExhausted" in rec.stats.failures_by_kind
    assert await _events_about(cluster.api, config_map["metadata"]["uid"]) == []


async def test_lease_is_exclusive_until_it_expires_then_changes_hands(cluster: LocalCluster) -> None:
    api = cluster.api
    name = f"lease-{uuid.uuid4().hex[:6]}"
    a = Leases(api, namespace=TEST_NAMESPACE, identity="controller-a")
    b = Leases(api, namespace=TEST_NAMESPACE, identity="controller-b")
    held = await a.try_acquire(name, duration_seconds=15)
    assert held is not None and held.holder == "controller-a" and held.transitions == 0
    raw = await api.get(R.LEASES, name, namespace=TEST_NAMESPACE)
    assert MICRO_TIME.match(raw["spec"]["renewTime"]) and MICRO_TIME.match(raw["spec"]["acquireTime"])
    assert raw["spec"]["leaseDurationSeconds"] == 15

    assert await b.try_acquire(name, duration_seconds=15) is None
    renewed = await a.renew(name)
    assert renewed is not None and renewed.renew_time is not None and held.renew_time is not None
    assert renewed.renew_time >= held.renew_time and renewed.transitions == 0

    # B's clock 16 s later: A's renewTime + 15 s is past, so B takes over (no sleeping here).
    def later() -> datetime:
        return times.now() + timedelta(seconds=16)
    b_later = Leases(api, namespace=TEST_NAMESPACE, identity="controller-b", clock=later)
    taken = await b_later.try_acquire(name, duration_seconds=15)
    assert taken is not None and taken.holder == "controller-b" and taken.transitions == 1
    assert await a.renew(name) is None  # A lost it
    assert (await a.get(name)).holder == "controller-b"  # type: ignore[union-attr]

    # A release frees it at once; the next holder counts another transition.
    assert await b_later.release(name) is True
    released = await a.get(name)
    assert released is not None and released.holder is None
    again = await a.try_acquire(name, duration_seconds=15)
    assert again is not None and again.holder == "controller-a" and again.transitions == 2
    await api.delete(R.LEASES, name, namespace=TEST_NAMESPACE)


async def test_two_contenders_for_a_free_lease_exactly_one_wins(cluster: LocalCluster) -> None:
    api = cluster.api
    for _ in range(3):
        name = f"race-{uuid.uuid4().hex[:6]}"
        contenders = [Leases(api, namespace=TEST_NAMESPACE, identity=f"c{i}") for i in range(4)]
        results = await asyncio.gather(*(c.try_acquire(name, duration_seconds=30) for c in contenders))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1  # one create landed; the others got AlreadyExists
        assert (await contenders[0].get(name)).holder == winners[0].holder  # type: ignore[union-attr]
        # Once it has expired, the same race over the existing Lease is decided by resourceVersion.
        def later() -> datetime:
            return times.now() + timedelta(seconds=60)
        late = [Leases(api, namespace=TEST_NAMESPACE, identity=f"late{i}", clock=later) for i in range(4)]
        results = await asyncio.gather(*(c.try_acquire(name, duration_seconds=30) for c in late))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1 and winners[0].transitions == 1
        assert (await late[0].get(name)).holder == winners[0].holder  # type: ignore[union-attr]
        await api.delete(R.LEASES, name, namespace=TEST_NAMESPACE)
