"""Capture images on the node: staged then renamed, mode 0700, manifest with a format version; another
format is never reused; the node's budget is checked before a capture; images of gone pods go."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynsnap.agent.images import BudgetExceeded, ImageFormatMismatch, ImageStore
from dynsnap.models import protocol as P
from dynsnap.models.ids import PodUID

UID = PodUID("0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f")
GONE = PodUID("1f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f")


def test_staging_seal_rename(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", budget_bytes=1 << 30)
    st = store.staging("ns", "w-0", UID, "c1")
    assert st.name == f"{P.STAGING_PREFIX}c1" and oct(st.stat().st_mode & 0o777) == "0o700"
    assert store.latest(UID) is None and store.stagings(UID) == [st]
    (st / "core-10000.img").write_bytes(b"x" * 100)
    cap = store.seal(st, {"captureId": "c1"})
    assert not st.exists() and cap.path.name == "c1" and (cap.path / "core-10000.img").exists()
    manifest = json.loads((cap.path / P.MANIFEST_FILE).read_text())
    assert manifest["format"] == P.IMAGE_FORMAT
    assert store.latest(UID) is not None and store.latest(UID).id == "c1"  # type: ignore[union-attr]


def test_other_format_is_never_reused(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", budget_bytes=1 << 30)
    cap = store.seal(store.staging("ns", "w-0", UID, "c1"), {"captureId": "c1"})
    (cap.path / P.MANIFEST_FILE).write_text(json.dumps({"format": P.IMAGE_FORMAT + 1, "captureId": "c1"}))
    with pytest.raises(ImageFormatMismatch, match="will not be reused"):
        store.latest(UID)


def test_a_directory_without_manifest_is_not_a_capture(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", budget_bytes=1 << 30)
    d = store.pod_dir("ns", "w-0", UID) / "half"
    d.mkdir(parents=True)
    assert store.captures(UID) == []


def test_budget_is_checked_before_a_capture(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", budget_bytes=64 * 1024)
    st = store.staging("ns", "w-0", UID, "c1")
    (st / "pages-1.img").write_bytes(b"x" * 40 * 1024)
    ok, why = store.room_for(8 * 1024)
    assert ok and why == ""
    ok, why = store.room_for(32 * 1024)
    assert not ok and "budget" in why


@pytest.mark.parametrize("bad", ["..", "a/b", "", "."])
def test_path_like_names_are_refused(tmp_path: Path, bad: str) -> None:
    store = ImageStore(tmp_path / "images", budget_bytes=1)
    with pytest.raises(ValueError, match="refusing"):
        store.pod_dir(bad, "w-0", UID)
    with pytest.raises(ValueError, match="refusing"):
        store.pod_dir("ns", bad, UID)


def test_gc_deletes_only_images_of_pods_gone(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", budget_bytes=1 << 30)
    store.seal(store.staging("ns", "live", UID, "c1"), {"captureId": "c1"})
    store.seal(store.staging("ns", "gone", GONE, "c2"), {"captureId": "c2"})
    removed = store.gc({UID})
    assert [p.name for p in removed] == [f"ns_gone_{GONE}"]
    assert store.latest(UID) is not None and store.latest(GONE) is None


def test_captures_at_once_each_count_the_others_reservation(tmp_path: Path) -> None:
    """Two captures checked against the budget before either has written a byte (issue 18: each check
    passed against the other's still-empty staging directory, and together they overshot the budget).
    The second is refused, with nothing made for it; the first holds its estimate until it is sealed or
    removed, and a sealed capture counts by its bytes."""
    store = ImageStore(tmp_path / "images", budget_bytes=100 * 1024)
    first = store.reserve("ns", "w-0", UID, "c1", 60 * 1024)
    assert store.used_bytes() >= 60 * 1024
    with pytest.raises(BudgetExceeded, match=r"capture estimated at 0 MiB; images on this node use 0 MiB"):
        store.reserve("ns", "w-1", GONE, "c2", 60 * 1024)
    assert store.stagings(GONE) == [] and not store.pod_dir("ns", "w-1", GONE).exists()
    # Its bytes written (fewer than it reserved), then sealed: it counts by what it holds.
    (first / "pages-1.img").write_bytes(b"x" * 20 * 1024)
    assert store.used_bytes() >= 60 * 1024
    store.seal(first, {"captureId": "c1"})
    assert 20 * 1024 <= store.used_bytes() < 60 * 1024
    second = store.reserve("ns", "w-1", GONE, "c2", 60 * 1024)
    # A failed dump's staging is removed: its reservation goes with it.
    store.remove(second)
    assert store.used_bytes() < 60 * 1024
    store.reserve("ns", "w-1", GONE, "c3", 60 * 1024)


def test_a_staging_directory_counts_for_its_bytes_when_they_pass_its_reservation(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", budget_bytes=1 << 30)
    st = store.reserve("ns", "w-0", UID, "c1", 4 * 1024)
    (st / "pages-1.img").write_bytes(b"x" * 64 * 1024)
    assert 64 * 1024 <= store.used_bytes() < 64 * 1024 + 64 * 1024
