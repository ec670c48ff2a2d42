"""The real API server's semantics the controller relies on: create, watch with
bookmarks, server-side apply, status subresource writes, and 410 Gone on a too-old
resourceVersion followed by a relist."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from dynsnap.k8s.errors import Conflict, Gone
from dynsnap.k8s.informer import Informer
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster

pytestmark = pytest.mark.cluster


def _cm(name: str, data: dict[str, str]) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": TEST_NAMESPACE},
            "data": data}


async def test_create_then_watch_sees_later_changes(cluster: LocalCluster) -> None:
    api = cluster.api
    name = f"cm-{uuid.uuid4().hex[:6]}"
    created = await api.create(R.CONFIG_MAPS, _cm(name, {"a": "1"}))
    seen: list[tuple[str, str]] = []

    async def collect() -> None:
        async for ev in api.watch(R.CONFIG_MAPS, namespace=TEST_NAMESPACE,
                                  resource_version=created["metadata"]["resourceVersion"],
                                  field_selector=f"metadata.name={name}", timeout_seconds=20):
            seen.append((ev["type"], ev["object"].get("data", {}).get("a", "")))
            if ("DELETED", "2") in seen:
                return

    task = asyncio.create_task(collect())
    await asyncio.sleep(0.5)
    await api.merge_patch(R.CONFIG_MAPS, name, {"data": {"a": "2"}}, namespace=TEST_NAMESPACE)
    await api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
    await asyncio.wait_for(task, 20)
    assert seen == [("MODIFIED", "2"), ("DELETED", "2")]


async def test_watch_receives_bookmarks(cluster: LocalCluster) -> None:
    # A streaming list (sendInitialEvents) ends its initial events with a BOOKMARK annotated
    # k8s.io/initial-events-end: the API server sends it only to clients that allow bookmarks.
    api = cluster.api
    name = f"bm-{uuid.uuid4().hex[:6]}"
    await api.create(R.CONFIG_MAPS, _cm(name, {"k": "v"}))
    added: list[str] = []
    bookmark: dict[str, object] | None = None
    async for ev in api.watch(R.CONFIG_MAPS, namespace=TEST_NAMESPACE, send_initial_events=True,
                              timeout_seconds=20):
        if ev["type"] == "ADDED":
            added.append(ev["object"]["metadata"]["name"])
        elif ev["type"] == "BOOKMARK":
            bookmark = ev["object"]
            break
    assert name in added
    assert bookmark is not None
    meta = bookmark["metadata"]
    assert isinstance(meta, dict)
    assert meta["annotations"]["k8s.io/initial-events-end"] == "true" and meta["resourceVersion"]
    await api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)


async def test_server_side_apply_merges_field_managers_and_detects_conflicts(cluster: LocalCluster) -> None:
    api = cluster.api
    name = f"ssa-{uuid.uuid4().hex[:6]}"
    await api.apply(R.CONFIG_MAPS, _cm(name, {"owned-by-a": "x"}), field_manager="manager-a")
    merged = await api.apply(R.CONFIG_MAPS, _cm(name, {"owned-by-b": "y"}), field_manager="manager-b")
    assert merged["data"] == {"owned-by-a": "x", "owned-by-b": "y"}
    managers = {m["manager"] for m in merged["metadata"]["managedFields"]}
    assert {"manager-a", "manager-b"} <= managers
    # Without force, taking a field another manager owns is a conflict and changes nothing.
    with pytest.raises(Conflict):
        await api.apply(R.CONFIG_MAPS, _cm(name, {"owned-by-a": "stolen"}), field_manager="manager-b")
    after = await api.get(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
    assert after["data"]["owned-by-a"] == "x"
    await api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)


async def test_status_subresource_write_leaves_spec_and_spec_write_leaves_status(cluster: LocalCluster) -> None:
    api = cluster.api
    name = f"dgd-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "nvidia.com/v1beta1", "kind": "DynamoGraphDeployment",
            "metadata": {"name": name, "namespace": TEST_NAMESPACE},
            "spec": {"components": [{"name": "w", "componentType": "worker", "replicas": 1}]}}
    created = await api.create(R.DGDS, body)
    gen = created["metadata"]["generation"]
    st = await api.merge_patch(R.DGDS, name, {"status": {"state": "ok"}, "spec": {"ignored": True}},
                               namespace=TEST_NAMESPACE, subresource="status")
    assert st["status"] == {"state": "ok"}
    assert "ignored" not in st["spec"] and st["metadata"]["generation"] == gen
    sp = await api.merge_patch(R.DGDS, name, {"status": {"state": "changed"}, "spec": {"x": 1}},
                               namespace=TEST_NAMESPACE)
    assert sp["status"] == {"state": "ok"} and sp["spec"]["x"] == 1
    assert sp["metadata"]["generation"] == gen + 1
    await api.delete(R.DGDS, name, namespace=TEST_NAMESPACE)


async def test_watch_from_too_old_resource_version_is_gone_and_relist_recovers(cluster: LocalCluster) -> None:
    api = cluster.api
    old = await api.create(R.CONFIG_MAPS, _cm(f"old-{uuid.uuid4().hex[:6]}", {"k": "v"}))
    old_rv = old["metadata"]["resourceVersion"]
    # Before compaction the API server can still serve history from that point ...
    async for ev in api.watch(R.CONFIG_MAPS, namespace=TEST_NAMESPACE, resource_version=old_rv, timeout_seconds=1):
        assert ev["type"] in {"ADDED", "MODIFIED", "DELETED"}
    # Two writes after it, so compacting at the head removes the revision right after old_rv too.
    for _ in range(2):
        await api.create(R.CONFIG_MAPS, _cm(f"newer-{uuid.uuid4().hex[:6]}", {"k": "v"}))
    assert cluster.cp is not None
    assert await cluster.cp.compact_etcd() > int(old_rv) + 1
    # ... after it, that resourceVersion is too old: 410 Gone.
    with pytest.raises(Gone):
        async for _ in api.watch(R.CONFIG_MAPS, namespace=TEST_NAMESPACE, resource_version=old_rv, timeout_seconds=5):
            pass
    name = f"relist-{uuid.uuid4().hex[:6]}"
    await api.create(R.CONFIG_MAPS, _cm(name, {"k": "v"}))
    # An informer told to resume from the compacted point gets the 410, relists, and is level.
    informer = Informer(api, R.CONFIG_MAPS, namespace=TEST_NAMESPACE)
    informer.resource_version = old_rv
    async with informer:
        await informer.wait_synced(timeout=30)
        assert informer.stats.relists_after_gone == 1 and informer.stats.lists == 1
        assert informer.store.get(TEST_NAMESPACE, name) is not None
    await api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
