"""The informer's store: keys, pluggable indexes, and the events a relist produces (synthetic deletes)."""

from __future__ import annotations

from typing import Any

import pytest

from dynsnap.k8s import store as S


def _obj(name: str, *, ns: str | None = "dynamo", rv: str = "1", uid: str | None = None, node: str | None = None,
         labels: dict[str, str] | None = None, owners: tuple[str, ...] = ()) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "resourceVersion": rv, "uid": uid or f"uid-{name}"}
    if ns:
        meta["namespace"] = ns
    if labels:
        meta["labels"] = labels
    if owners:
        meta["ownerReferences"] = [{"uid": o, "kind": "Pod", "name": o} for o in owners]
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}}


def _store() -> S.Store:
    return S.Store({"node": S.pod_node, "owner": S.owner_uids, "dsnode": S.label("dynsnap.io/node")})


def test_keys_follow_client_go() -> None:
    assert S.key_of(_obj("a")) == "dynamo/a"
    assert S.key_of(_obj("n1", ns=None)) == "n1"
    with pytest.raises(ValueError):
        S.key_of({"metadata": {}})


def test_get_list_and_indexes() -> None:
    st = _store()
    st.upsert(_obj("p1", node="node-a", owners=("o1",)))
    st.upsert(_obj("p2", node="node-a", owners=("o1", "o2")))
    st.upsert(_obj("p3", node="node-b", labels={"dynsnap.io/node": "node-b"}))
    st.upsert(_obj("p4"))  # unscheduled: in no node bucket
    assert st.get("dynamo", "p2")["metadata"]["name"] == "p2"  # type: ignore[index]
    assert st.get("other", "p2") is None
    assert len(st) == 4 and "dynamo/p4" in st
    assert [o["metadata"]["name"] for o in st.by_index("node", "node-a")] == ["p1", "p2"]
    assert [o["metadata"]["name"] for o in st.by_index("owner", "o1")] == ["p1", "p2"]
    assert [o["metadata"]["name"] for o in st.by_index("owner", "o2")] == ["p2"]
    assert [o["metadata"]["name"] for o in st.by_index("dsnode", "node-b")] == ["p3"]
    assert st.by_index("node", "nowhere") == []
    assert st.index_values("node") == ["node-a", "node-b"]
    with pytest.raises(KeyError):
        st.by_index("nope", "x")


def test_update_refiles_and_remove_unfiles() -> None:
    st = _store()
    st.upsert(_obj("p1", node="node-a", owners=("o1",)))
    old = st.upsert(_obj("p1", rv="2", node="node-b"))
    assert old is not None and old["metadata"]["resourceVersion"] == "1"
    assert st.by_index("node", "node-a") == [] and len(st.by_index("node", "node-b")) == 1
    assert st.by_index("owner", "o1") == [] and st.index_values("owner") == []
    assert st.remove("dynamo/p1") is not None
    assert st.by_index("node", "node-b") == [] and len(st) == 0
    assert st.remove(_obj("p1")) is None


def test_replace_emits_adds_modifies_and_synthetic_deletes() -> None:
    st = _store()
    st.replace([_obj("keep"), _obj("change"), _obj("gone", node="node-a")])
    events = st.replace([_obj("keep"), _obj("change", rv="2"), _obj("new")])
    assert sorted((t, o["metadata"]["name"]) for t, o in events) == [
        ("ADDED", "new"), ("DELETED", "gone"), ("MODIFIED", "change")]
    # The synthetic delete carries the last known object; the unchanged object yields nothing.
    gone = next(o for t, o in events if t == "DELETED")
    assert gone["spec"] == {"nodeName": "node-a"} and gone["metadata"]["uid"] == "uid-gone"
    assert sorted(st.keys()) == ["dynamo/change", "dynamo/keep", "dynamo/new"]
    assert st.by_index("node", "node-a") == []


def test_replace_sees_a_recreated_object_as_delete_then_add() -> None:
    st = _store()
    st.replace([_obj("w", uid="old-uid")])
    events = st.replace([_obj("w", uid="new-uid", rv="9")])
    assert [(t, o["metadata"]["uid"]) for t, o in events] == [("DELETED", "old-uid"), ("ADDED", "new-uid")]
    assert st.get("dynamo", "w")["metadata"]["uid"] == "new-uid"  # type: ignore[index]


def test_an_earlier_version_does_not_replace_a_later_one() -> None:
    # A controller stores its own write (rv 12); the watch event of its earlier write (rv 11) arrives
    # after it: the store keeps 12, so a reconcile never acts on what it has already changed.
    st = _store()
    st.upsert(_obj("ws", rv="12", node="node-b"))
    assert st.upsert(_obj("ws", rv="11", node="node-a"))["metadata"]["resourceVersion"] == "12"
    assert st.get("dynamo", "ws")["metadata"]["resourceVersion"] == "12"
    assert st.by_index("node", "node-a") == [] and len(st.by_index("node", "node-b")) == 1
    # The same version, a later one, another object under the name, or a version that is not a number: stored.
    st.upsert(_obj("ws", rv="12", node="node-c"))
    assert st.by_index("node", "node-c")
    st.upsert(_obj("ws", rv="13"))
    assert st.get("dynamo", "ws")["metadata"]["resourceVersion"] == "13"
    st.upsert(_obj("ws", rv="5", uid="recreated"))
    assert st.get("dynamo", "ws")["metadata"]["uid"] == "recreated"
    st.upsert(_obj("ws", rv="a1", uid="recreated"))
    assert st.get("dynamo", "ws")["metadata"]["resourceVersion"] == "a1"


def test_a_relist_older_than_our_write_keeps_the_write_and_reports_nothing() -> None:
    st = _store()
    st.upsert(_obj("ws", rv="20"))
    assert st.replace([_obj("ws", rv="19"), _obj("other", rv="19")]) == [("ADDED", _obj("other", rv="19"))]
    assert st.get("dynamo", "ws")["metadata"]["resourceVersion"] == "20"
