"""Capture images on the node's disk: one directory per capture, written under a staging name
and renamed when complete, mode 0700 (images hold the worker's environment, so its secrets),
with a manifest carrying a format version; a capture of a format this agent does not read
(``IMAGE_FORMATS_READ``: its own and the older ones it understands) is never reused.

Layer: ``dynsnap.agent``. Layout under the images root (a node path, see AgentSettings)::

    <root>/<namespace>_<pod>_<pod uid>/<capture id>/            complete (manifest.json present)
    <root>/<namespace>_<pod>_<pod uid>/.staging-<capture id>/   being written, or left by a crash
    <root>/<namespace>_<pod>_<pod uid>/.staging-<capture id>/REJECTED   a dump the guard refused
    <root>/<namespace>_<pod>_<pod uid>/.staging-<capture id>/RESERVED   the bytes its dump was estimated at

The disk the images of a node may use is bounded (``budget_bytes``); a capture whose estimate
would pass it is refused before it starts. The check and the staging directory that takes the
estimate out of the budget are one step (:meth:`ImageStore.reserve`, under a lock on the root), and
a staging directory counts for at least its reservation until it is sealed or removed: captures
running at once each see the others' reservations, where a check alone would let each pass against
the others' still-empty directories and together overshoot the budget. Images of pods that no longer
exist, and of captures that were woken from, are deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dynsnap.models import protocol as P
from dynsnap.models.ids import PodUID

REJECTED_FILE = "REJECTED"
RESERVED_FILE = "RESERVED"
_LOCK_FILE = ".budget.lock"  # flock'd by a reservation: also an agent exec beside the node agent waits
_UID_IN_NAME = re.compile(r"_([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$")


class ImageFormatMismatch(RuntimeError):
    """A complete capture exists, but in a format this agent does not read."""


class BudgetExceeded(RuntimeError):
    """A capture's estimate does not fit the node's image budget or the disk's free space."""


def new_capture_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


@dataclass(frozen=True)
class Capture:
    path: Path
    manifest: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.manifest["captureId"])


class ImageStore:
    def __init__(self, root: Path, *, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes

    def _private(self, path: Path) -> None:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)

    def pod_dir(self, namespace: str, pod: str, uid: PodUID) -> Path:
        # The names are validated by the API server (DNS-1123) and the UID by its pattern; the
        # check here keeps a bad caller from writing outside the root all the same.
        for part in (namespace, pod, uid):
            if not part or "/" in part or part in (".", "..") or "\0" in part:
                raise ValueError(f"refusing image path component {part!r}")
        return self.root / f"{namespace}_{pod}_{uid}"

    def reserve(self, namespace: str, pod: str, uid: PodUID, capture_id: str, estimate: int) -> Path:
        """The staging directory of a capture estimated at ``estimate`` bytes, made only if the estimate
        fits (:meth:`room_for`, counting every other staging directory's reservation), and holding that
        much of the budget (its RESERVED file) until it is sealed or removed. BudgetExceeded otherwise,
        with nothing made."""
        self._private(self.root)
        with open(self.root / _LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file: check and reservation are one step
            ok, why = self.room_for(estimate)
            if not ok:
                raise BudgetExceeded(why)
            s = self.staging(namespace, pod, uid, capture_id)
            (s / RESERVED_FILE).write_text(f"{max(estimate, 0)}\n")
            return s

    def staging(self, namespace: str, pod: str, uid: PodUID, capture_id: str) -> Path:
        d = self.pod_dir(namespace, pod, uid)
        self._private(self.root)
        self._private(d)
        s = d / f"{P.STAGING_PREFIX}{capture_id}"
        self._private(s)
        return s

    def stagings(self, uid: PodUID) -> list[Path]:
        return sorted(p for d in self._pod_dirs(uid) for p in d.iterdir()
                      if p.is_dir() and p.name.startswith(P.STAGING_PREFIX))

    def _pod_dirs(self, uid: PodUID) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [d for d in self.root.iterdir() if d.is_dir() and d.name.endswith(f"_{uid}")]

    def seal(self, staging: Path, manifest: dict[str, Any]) -> Capture:
        """Write the manifest (last, fsynced), then rename the staging dir to its final name."""
        manifest = {"format": P.IMAGE_FORMAT, **manifest}
        (staging / RESERVED_FILE).unlink(missing_ok=True)  # sealed: it counts by its bytes from now on
        tmp = staging / (P.MANIFEST_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, staging / P.MANIFEST_FILE)
        final = staging.parent / staging.name.removeprefix(P.STAGING_PREFIX)
        os.rename(staging, final)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself is durable once the parent directory is
        finally:
            os.close(fd)
        return Capture(final, manifest)

    def reject(self, staging: Path, reason: str) -> None:
        (staging / REJECTED_FILE).write_text(reason + "\n")

    @staticmethod
    def rejected(staging: Path) -> str | None:
        try:
            return (staging / REJECTED_FILE).read_text().strip()
        except OSError:
            return None

    def captures(self, uid: PodUID) -> list[Capture]:
        """Complete captures of this pod, newest first. A directory without a readable manifest
        is not a capture; one with another format raises ImageFormatMismatch (never reused)."""
        out = []
        for d in self._pod_dirs(uid):
            for c in d.iterdir():
                if not c.is_dir() or c.name.startswith("."):
                    continue
                try:
                    manifest = json.loads((c / P.MANIFEST_FILE).read_text())
                except (OSError, ValueError):
                    continue
                if manifest.get("format") not in P.IMAGE_FORMATS_READ:
                    raise ImageFormatMismatch(f"{c}: image format {manifest.get('format')!r}, this agent reads "
                                              f"formats {sorted(P.IMAGE_FORMATS_READ)}; it will not be reused")
                out.append(Capture(c, manifest))
        return sorted(out, key=lambda c: c.id, reverse=True)

    def latest(self, uid: PodUID) -> Capture | None:
        found = self.captures(uid)
        return found[0] if found else None

    def remove(self, path: Path) -> None:
        if path.is_relative_to(self.root) and path != self.root:
            shutil.rmtree(path, ignore_errors=True)

    def remove_pod(self, uid: PodUID) -> list[Path]:
        gone = self._pod_dirs(uid)
        for d in gone:
            self.remove(d)
        return gone

    def used_bytes(self) -> int:
        """Bytes the images of this node hold, a staging directory counted for at least its reservation."""
        if not self.root.is_dir():
            return 0
        total = dir_bytes(self.root)
        for d in self.root.iterdir():
            if not d.is_dir():
                continue
            for s in d.iterdir():
                reserved = _reserved(s) if s.name.startswith(P.STAGING_PREFIX) else None
                if reserved is not None:
                    total += max(reserved - dir_bytes(s), 0)
        return total

    def room_for(self, estimate: int) -> tuple[bool, str]:
        """Whether a capture of ``estimate`` bytes fits the node's budget and the disk's free space."""
        used = self.used_bytes()
        if used + estimate > self.budget_bytes:
            return False, (f"capture estimated at {estimate >> 20} MiB; images on this node use {used >> 20} MiB "
                           f"of a {self.budget_bytes >> 20} MiB budget")
        self._private(self.root)
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        if estimate > free:
            return False, f"capture estimated at {estimate >> 20} MiB; {free >> 20} MiB free on {self.root}"
        return True, ""

    def pod_uids(self) -> set[PodUID]:
        if not self.root.is_dir():
            return set()
        out = set()
        for d in self.root.iterdir():
            m = _UID_IN_NAME.search(d.name)
            if m:
                out.add(PodUID(m.group(1)))
        return out

    def gc(self, live: set[PodUID]) -> list[Path]:
        """Delete the images of pods not in ``live`` (pods that no longer exist on this node)."""
        removed = []
        for uid in self.pod_uids() - live:
            removed += self.remove_pod(uid)
        return removed


def _reserved(staging: Path) -> int | None:
    """The bytes a staging directory reserved, None without a (readable) reservation."""
    try:
        text = (staging / RESERVED_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
