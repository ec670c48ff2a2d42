"""Event notes and object references (the pure parts of the recorder)."""

from __future__ import annotations

import pytest

from dynsnap.k8s.events import NOTE_LIMIT, object_reference, truncate_note


def test_notes_are_cut_to_1_kib_on_a_character_boundary() -> None:
    assert truncate_note("short") == "short"
    exact = "a" * NOTE_LIMIT
    assert truncate_note(exact) == exact
    for note in ("a" * 5000, "é" * 5000, "日本" * 2000, "a" + "😀" * 1000):
        cut = truncate_note(note)
        assert len(cut.encode()) <= NOTE_LIMIT and cut.endswith("…") and note.startswith(cut[:-1])


def test_object_reference() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w-0", "namespace": "dynamo", "uid": "u1",
                                                            "labels": {"a": "b"}}, "spec": {}}
    assert object_reference(pod) == {"apiVersion": "v1", "kind": "Pod", "name": "w-0", "namespace": "dynamo",
                                     "uid": "u1"}
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n", "uid": "u2"}}
    assert "namespace" not in object_reference(node)
    ref = {"apiVersion": "v1", "kind": "Pod", "name": "w-0", "namespace": "dynamo", "uid": "u1", "extra": 1}
    assert "extra" not in object_reference(ref)
    with pytest.raises(ValueError, match="uid"):
        object_reference({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}})
