"""The informer against the real API server: paginated list, relist after 410 with synthetic
deletes, and reconnects after every fault class. Faults the API server cannot produce on demand
come from ``fake_apiproxy`` in front of it; every test ends with the store level with the server."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from dynsnap.k8s import retry
from dynsnap.k8s import store as S
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import InformerFailed, NotFound
from dynsnap.k8s.informer import Informer, InformerSettings
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster, wait_for
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault

pytestmark = pytest.mark.cluster

NODE_LABEL = "dynsnap.io/node"


@pytest.fixture(autouse=True)
def instant_retries() -> Iterator[None]:
    retry.set_instant(True)
    yield
    retry.set_instant(None)


@pytest.fixture
async def proxy(cluster: LocalCluster) -> AsyncIterator[FakeApiProxy]:
    assert cluster.cp is not None
    async with FakeApiProxy.in_front_of(cluster.cp) as p:
        yield p


@pytest.fixture
async def via_proxy(cluster: LocalCluster, proxy: FakeApiProxy) -> AsyncIterator[Kube]:
    assert cluster.cp is not None and cluster.cp.pki is not None
    kube = Kube.from_token(server=proxy.url, token=cluster.cp.identities["admin"].token,
                           ca_cert=cluster.cp.pki.ca_cert)
    yield kube
    await kube.close()


@pytest.fixture
async def label(cluster: LocalCluster) -> AsyncIterator[str]:
    """A label value unique to the test; its ConfigMaps are deleted afterwards."""
    value = f"t{uuid.uuid4().hex[:8]}"
    yield value
    listing = await cluster.api.list(R.CONFIG_MAPS, namespace=TEST_NAMESPACE, label_selector=f"test={value}")
    for cm in listing["items"]:
        with contextlib.suppress(NotFound):  # the garbage collector may have taken an owned one already
            await cluster.api.delete(R.CONFIG_MAPS, cm["metadata"]["name"], namespace=TEST_NAMESPACE)


def _cm(name: str, test: str, *, node: str | None = None, owner: Obj | None = None) -> Obj:
    meta: dict[str, Any] = {"name": name, "namespace": TEST_NAMESPACE, "labels": {"test": test}}
    if node:
        meta["labels"][NODE_LABEL] = node
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"]}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"v": "0"}}


def _informer(kube: Kube, test: str, **settings: Any) -> Informer:
    return Informer(kube, R.CONFIG_MAPS, namespace=TEST_NAMESPACE, label_selector=f"test={test}",
                    indexers={"node": S.label(NODE_LABEL), "owner": S.owner_uids},
                    settings=InformerSettings(**settings))


async def _level(informer: Informer, api: Kube, test: str) -> None:
    """Wait (bounded) until the store holds exactly the server's objects at their resourceVersions."""
    async def level() -> bool:
        listing = await api.list(R.CONFIG_MAPS, namespace=TEST_NAMESPACE, label_selector=f"test={test}")
        want = {(o["metadata"]["name"], o["metadata"]["resourceVersion"]) for o in listing["items"]}
        have = {(o["metadata"]["name"], o["metadata"]["resourceVersion"]) for o in informer.store.list()}
        return want == have
    await wait_for("the informer's store level with the server", level, timeout=30)


async def _watching(proxy: FakeApiProxy) -> None:
    """Wait (bounded) until the informer's first watch has reached the proxy, so cutting it is a real cut."""
    async def opened() -> bool:
        return bool(proxy.seen(watch=True))
    await wait_for("the informer's watch at the proxy", opened, timeout=30)


async def test_paginated_list_fills_the_indexed_store(cluster: LocalCluster, proxy: FakeApiProxy,
                                                      via_proxy: Kube, label: str) -> None:
    api = cluster.api
    parent = await api.create(R.CONFIG_MAPS, _cm(f"{label}-parent", label))
    for i in range(24):
        await api.create(R.CONFIG_MAPS, _cm(f"{label}-{i:02}", label, node="node-a" if i % 3 == 0 else "node-b",
                                            owner=parent if i < 5 else None))
    seen: list[tuple[str, str]] = []
    informer = _informer(via_proxy, label, page_size=10)
    informer.add_handler(lambda typ, obj: seen.append((typ, obj["metadata"]["name"])))
    async with informer:
        await informer.wait_synced(timeout=30)
        # 25 objects, pages of 10: three list requests reached the API server, two with a continue token.
        lists = proxy.seen(method="GET", path_contains="/configmaps", watch=False)
        assert len(lists) == 3
        assert ["continue=" in s.query for s in lists] == [False, True, True]
        assert all("limit=10" in s.query for s in lists)
        assert len(informer.store) == 25 and len(seen) == 25 and {t for t, _ in seen} == {"ADDED"}
        assert informer.store.get(TEST_NAMESPACE, f"{label}-03")["data"] == {"v": "0"}  # type: ignore[index]
        assert len(informer.store.by_index("node", "node-a")) == 8
        assert {o["metadata"]["name"] for o in informer.store.by_index("owner", parent["metadata"]["uid"])} == {
            f"{label}-{i:02}" for i in range(5)}
        # Then the watch carries changes, resuming from the list's resourceVersion.
        await api.merge_patch(R.CONFIG_MAPS, f"{label}-03", {"data": {"v": "1"}}, namespace=TEST_NAMESPACE)
        await api.delete(R.CONFIG_MAPS, f"{label}-04", namespace=TEST_NAMESPACE)
        await _level(informer, api, label)
        assert ("MODIFIED", f"{label}-03") in seen and ("DELETED", f"{label}-04") in seen
        assert informer.stats.lists == 1


async def test_relist_after_gone_delivers_synthetic_deletes(cluster: LocalCluster, proxy: FakeApiProxy,
                                                            via_proxy: Kube, label: str) -> None:
    api = cluster.api
    assert cluster.cp is not None
    for i in range(6):
        await api.create(R.CONFIG_MAPS, _cm(f"{label}-{i}", label))
    deleted: list[Obj] = []
    informer = _informer(via_proxy, label)
    informer.add_handler(lambda typ, obj: deleted.append(obj) if typ == "DELETED" else None)
    async with informer:
        await informer.wait_synced(timeout=30)
        await _watching(proxy)
        # The informer goes blind: its live watch is cut and its next one held at the proxy.
        proxy.add(Fault("stall", watch=True))
        proxy.abort_all()
        await proxy.wait_stalled()
        gone_uid = informer.store.get(TEST_NAMESPACE, f"{label}-0")["metadata"]["uid"]  # type: ignore[index]
        for i in (0, 1, 2):
            await api.delete(R.CONFIG_MAPS, f"{label}-{i}", namespace=TEST_NAMESPACE)
        await api.merge_patch(R.CONFIG_MAPS, f"{label}-3", {"data": {"v": "changed"}}, namespace=TEST_NAMESPACE)
        await api.create(R.CONFIG_MAPS, _cm(f"{label}-new", label))
        # ... and the history it would resume from is compacted away (ConfigMaps bypass the watch cache).
        await cluster.cp.compact_etcd()
        proxy.release()
        await _level(informer, api, label)
        assert informer.stats.relists_after_gone == 1 and informer.stats.lists == 2
        assert informer.stats.synthetic_deletes == 3
        assert sorted(o["metadata"]["name"] for o in deleted) == [f"{label}-{i}" for i in (0, 1, 2)]
        # A synthetic delete carries the last known object, uid included.
        assert next(o for o in deleted if o["metadata"]["name"] == f"{label}-0")["metadata"]["uid"] == gone_uid
        assert informer.store.get(TEST_NAMESPACE, f"{label}-3")["data"] == {"v": "changed"}  # type: ignore[index]


async def test_expired_continue_token_restarts_the_list(cluster: LocalCluster, proxy: FakeApiProxy,
                                                        via_proxy: Kube, label: str) -> None:
    api = cluster.api
    assert cluster.cp is not None
    for i in range(25):
        await api.create(R.CONFIG_MAPS, _cm(f"{label}-{i:02}", label))
    proxy.add(Fault("stall", watch=False, query_contains="continue="))
    informer = _informer(via_proxy, label, page_size=10)
    async with informer:
        await proxy.wait_stalled()  # page 2 is held; its continue token pins the snapshot of page 1
        await api.delete(R.CONFIG_MAPS, f"{label}-24", namespace=TEST_NAMESPACE)
        await api.create(R.CONFIG_MAPS, _cm(f"{label}-late", label))
        await cluster.cp.compact_etcd()
        proxy.release()
        await informer.wait_synced(timeout=30)
        await _level(informer, api, label)
        lists = proxy.seen(method="GET", path_contains="/configmaps", watch=False)
        # page 1, page 2 (410: token expired), then pages 1-3 again.
        assert ["continue=" in s.query for s in lists] == [False, True, False, True, True]
        assert informer.stats.list_restarts == 1 and informer.stats.lists == 1 and informer.stats.failures == 0
        assert len(informer.store) == 25 and informer.store.get(TEST_NAMESPACE, f"{label}-late") is not None


async def test_429_on_watch_honours_retry_after(cluster: LocalCluster, proxy: FakeApiProxy, via_proxy: Kube,
                                                label: str) -> None:
    api = cluster.api
    await api.create(R.CONFIG_MAPS, _cm(f"{label}-a", label))
    informer = _informer(via_proxy, label)
    async with informer:
        await informer.wait_synced(timeout=30)
        await _watching(proxy)
        proxy.add(Fault("respond", watch=True, status=429, headers={"Retry-After": "7"}))
        proxy.abort_all()
        await api.create(R.CONFIG_MAPS, _cm(f"{label}-b", label))
        await _level(informer, api, label)
        # Two failures: the cut stream, then the 429; the delay after the 429 is the server's 7 s
        # (our own backoff for a second failure is at most 1.6 s).
        assert informer.stats.failures == 2
        assert informer.stats.delays[-1] == 7.0
        assert "TooManyRequests" in informer.stats.last_error
        assert len(proxy.seen(watch=True)) >= 3


async def test_5xx_on_list_backs_off_then_syncs(cluster: LocalCluster, proxy: FakeApiProxy, via_proxy: Kube,
                                                label: str) -> None:
    api = cluster.api
    await api.create(R.CONFIG_MAPS, _cm(f"{label}-a", label))
    proxy.add(Fault("respond", watch=False, status=503, times=3))
    informer = _informer(via_proxy, label)
    async with informer:
        await informer.wait_synced(timeout=30)
        await _level(informer, api, label)
        assert informer.stats.failures == 3 and informer.stats.lists == 1
        delays = list(informer.stats.delays)
        # Jittered exponential backoff: each delay within [base*2^(n-1) / 2, base*2^(n-1)].
        base = informer.settings.backoff.base
        assert all(base * 2 ** n / 2 <= d <= base * 2 ** n for n, d in enumerate(delays))


async def test_resets_and_refused_connections_reconnect(cluster: LocalCluster, proxy: FakeApiProxy,
                                                        via_proxy: Kube, label: str) -> None:
    api = cluster.api
    await api.create(R.CONFIG_MAPS, _cm(f"{label}-a", label))
    proxy.refuse_next(2)  # the first list's connections are reset at accept, before TLS
    informer = _informer(via_proxy, label)
    async with informer:
        await informer.wait_synced(timeout=30)
        assert informer.stats.failures == 2
        await _watching(proxy)
        # A watch reset mid-stream: changes made while it is down are replayed by the next watch
        # (resumed from the last resourceVersion, no relist).
        proxy.add(Fault("reset_after", watch=True, after_bytes=40))
        proxy.abort_all()
        for i in range(5):
            await api.create(R.CONFIG_MAPS, _cm(f"{label}-{i}", label))
        await api.delete(R.CONFIG_MAPS, f"{label}-a", namespace=TEST_NAMESPACE)
        await _level(informer, api, label)
        assert informer.stats.failures >= 4 and informer.stats.lists == 1


async def test_silent_stream_is_declared_dead_and_replaced(cluster: LocalCluster, proxy: FakeApiProxy,
                                                           via_proxy: Kube, label: str) -> None:
    api = cluster.api
    await api.create(R.CONFIG_MAPS, _cm(f"{label}-a", label))
    # Short stream lifetimes so that a healthy idle stream ends (normally) well inside the deadline.
    informer = _informer(via_proxy, label, watch_timeout_seconds=1, silent_deadline=4.0)
    async with informer:
        await informer.wait_synced(timeout=30)
        await _watching(proxy)
        proxy.add(Fault("silent_after", watch=True, after_bytes=0))
        proxy.abort_all()
        await api.create(R.CONFIG_MAPS, _cm(f"{label}-b", label))
        await _level(informer, api, label)
        assert informer.stats.silent_streams >= 1 and informer.stats.lists == 1


async def test_informer_gives_up_with_a_named_error_past_its_rate_bound(cluster: LocalCluster, proxy: FakeApiProxy,
                                                                        via_proxy: Kube, label: str) -> None:
    proxy.add(Fault("respond", watch=False, status=503, times=None))
    informer = _informer(via_proxy, label, max_failures=3, failure_window=600.0)
    informer.start()
    with pytest.raises(InformerFailed) as err:
        await informer.wait_synced(timeout=30)
    await informer.stop()
    assert err.value.failures == 4 and informer.stats.failures == 4
    assert len(proxy.seen(watch=False)) == 4
    assert informer.failure is err.value
