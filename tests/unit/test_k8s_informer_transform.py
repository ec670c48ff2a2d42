"""An informer's ``transform`` (dynsnap.k8s.informer): every listed and watched object passes through
it before the store keeps it and the handlers see it; ``strip_managed_fields`` drops server-side
apply's bookkeeping and nothing else. A fake API (one list page, one watch stream) stands in for the
server: what is tested is the informer's own path from answer to store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from dynsnap.k8s.informer import Informer, strip_managed_fields
from dynsnap.models import resources as R

MANAGED = [{"manager": "kubelet", "operation": "Update", "fieldsV1": {"f:status": {}}}]


def pod(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": rv,
                         "labels": {"a": "b"}, "managedFields": list(MANAGED)},
            "spec": {"nodeName": "n"}, "status": {"phase": "Running"}}


class FakeApi:
    on_request: Any = None

    async def list(self, res: Any, **kw: Any) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "10"}, "items": [pod("a", "5"), pod("b", "6")]}

    async def watch(self, res: Any, **kw: Any) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "MODIFIED", "object": pod("a", "11")}
        yield {"type": "ADDED", "object": pod("c", "12")}
        yield {"type": "DELETED", "object": pod("b", "13")}


async def run(transform: Any) -> tuple[Informer, list[tuple[str, dict[str, Any]]]]:
    inf = Informer(FakeApi(), R.PODS, transform=transform)  # type: ignore[arg-type]
    seen: list[tuple[str, dict[str, Any]]] = []
    inf.add_handler(lambda typ, obj: seen.append((typ, obj)))
    inf.resource_version = await inf._list()
    await inf._watch()
    return inf, seen


async def test_stripped_objects_in_the_store_and_in_the_handlers() -> None:
    inf, seen = await run(strip_managed_fields)
    assert sorted(inf.store.keys()) == ["ns/a", "ns/c"]
    assert [(t, o["metadata"]["name"]) for t, o in seen] == [("ADDED", "a"), ("ADDED", "b"), ("MODIFIED", "a"),
                                                             ("ADDED", "c"), ("DELETED", "b")]
    for _, o in seen:
        assert "managedFields" not in o["metadata"]
        assert o["metadata"]["labels"] == {"a": "b"} and o["spec"] == {"nodeName": "n"}
    a = inf.store.get("ns", "a")
    assert a is not None and a["metadata"]["resourceVersion"] == "11" and "managedFields" not in a["metadata"]
    assert inf.resource_version == "13"


async def test_without_a_transform_objects_are_kept_as_sent() -> None:
    inf, seen = await run(None)
    assert all(o["metadata"]["managedFields"] == MANAGED for _, o in seen)
    a = inf.store.get("ns", "a")
    assert a is not None and a["metadata"]["managedFields"] == MANAGED
