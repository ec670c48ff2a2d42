"""Kubernetes Events (``events.k8s.io/v1``) that never fail the caller (layer: k8s).

``EventRecorder(kube, reporting_controller="dynsnap.io/controller", reporting_instance=pod)``
writes one Event per ``record(regarding, type=..., reason=..., action=..., note=...)``:
``regarding`` is the object's reference (apiVersion, kind, namespace, name, uid), ``type``
``Normal`` or ``Warning``, ``reason`` CamelCase (the reasons live in ``models/protocol.py``),
``note`` cut to the API's 1 KiB. The Event goes to the regarding object's namespace
(``default`` for cluster-scoped objects, as the API requires).

Names are the regarding object's name plus a random suffix, made here rather than by
``generateName`` so that a create retried after a lost connection answers 409 instead of
writing a second Event.

Dedupe, kept simple: the same (regarding uid, type, reason, action, note) within
``dedupe_window`` seconds of the Event's first write does not create a new Event; it bumps
``series.count`` and ``series.lastObservedTime`` on the one already written (one merge patch),
as client-go's recorder does. A reconcile stuck on one failure thus shows one Event whose
count climbs. Past the window the next occurrence starts a new Event. At most ``max_tracked``
keys are remembered (oldest forgotten first), so memory stays bounded.

``record`` never raises (cancellation aside): an Event is an explanation, and failing to
write one must not fail the reconcile that tried. Failures are logged and counted in ``stats``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime
from typing import Final

from dynsnap.k8s import times
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models.resources import EVENTS

log = logging.getLogger(__name__)

NORMAL: Final = "Normal"
WARNING: Final = "Warning"
NOTE_LIMIT: Final = 1024  # bytes; the API server rejects longer notes
_NAME_PREFIX_LIMIT = 200  # leaves room for ".<16 hex>" inside the 253-byte name limit


def object_reference(obj: Obj) -> Obj:
    """The ``regarding``/``related`` reference of an object (or a reference given as such)."""
    if "metadata" not in obj:
        return {k: v for k, v in obj.items() if k in ("apiVersion", "kind", "namespace", "name", "uid",
                                                      "resourceVersion", "fieldPath")}
    meta = obj["metadata"]
    ref: Obj = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
                "uid": meta.get("uid")}
    if meta.get("namespace"):
        ref["namespace"] = meta["namespace"]
    missing = [k for k in ("apiVersion", "kind", "uid") if not ref.get(k)]
    if missing:
        raise ValueError(f"cannot refer to {meta['name']}: no {', '.join(missing)}")
    return ref


def truncate_note(note: str, limit: int = NOTE_LIMIT) -> str:
    """``note`` cut to ``limit`` UTF-8 bytes, on a character boundary, marked with an ellipsis."""
    raw = note.encode()
    if len(raw) <= limit:
        return note
    ellipsis = "…".encode()
    return raw[: limit - len(ellipsis)].decode(errors="ignore") + "…"


@dataclass
class EventStats:
    created: int = 0
    series_updates: int = 0
    failures: int = 0
    failures_by_kind: dict[str, int] = field(default_factory=dict)  # exception class name -> count
    last_error: str = ""


@dataclass
class _Seen:
    name: str
    namespace: str
    first: float
    count: int = 1


@dataclass
class EventRecorder:
    kube: Kube
    _: KW_ONLY
    reporting_controller: str  # a qualified name, e.g. "dynsnap.io/controller"
    reporting_instance: str  # this process, e.g. the pod name
    # Five minutes: a failing reconcile retried on controller-runtime-style backoff (capped at a few
    # minutes) keeps folding into one Event; after five quiet minutes a recurrence is news again.
    dedupe_window: float = 300.0
    max_tracked: int = 1024
    clock: Callable[[], float] = time.monotonic
    now: Callable[[], datetime] = times.now
    stats: EventStats = field(default_factory=EventStats, init=False)
    _seen: OrderedDict[tuple[str, ...], _Seen] = field(default_factory=OrderedDict, init=False)

    async def normal(self, regarding: Obj, *, reason: str, action: str, note: str,
                     related: Obj | None = None) -> Obj | None:
        return await self.record(regarding, type=NORMAL, reason=reason, action=action, note=note, related=related)

    async def warning(self, regarding: Obj, *, reason: str, action: str, note: str,
                      related: Obj | None = None) -> Obj | None:
        return await self.record(regarding, type=WARNING, reason=reason, action=action, note=note, related=related)

    async def record(
        self, regarding: Obj, *, type: str, reason: str, action: str, note: str, related: Obj | None = None
    ) -> Obj | None:
        """Write (or fold into a series) one Event; the written Event, or None if that failed."""
        try:
            return await self._record(regarding, type=type, reason=reason, action=action, note=note, related=related)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never into the caller's reconcile: see the module docstring
            kind = e.__class__.__name__
            self.stats.failures += 1
            self.stats.failures_by_kind[kind] = self.stats.failures_by_kind.get(kind, 0) + 1
            self.stats.last_error = f"{kind}: {e}"
            log.warning("event %s/%s not recorded: %s", reason, action, self.stats.last_error)
            return None

    async def _record(
        self, regarding: Obj, *, type: str, reason: str, action: str, note: str, related: Obj | None
    ) -> Obj:
        ref = object_reference(regarding)
        note = truncate_note(note)
        key = (str(ref.get("uid") or f"{ref.get('kind')}/{ref.get('namespace')}/{ref.get('name')}"),
               type, reason, action, note)
        when = self.now()
        seen = self._seen.get(key)
        if seen is not None and self.clock() - seen.first <= self.dedupe_window:
            seen.count += 1
            series = {"series": {"count": seen.count, "lastObservedTime": times.micro_time(when)}}
            try:
                out = await self.kube.merge_patch(EVENTS, seen.name, series, namespace=seen.namespace)
                self.stats.series_updates += 1
                self._seen.move_to_end(key)
                return out
            except NotFound:  # expired (the API server keeps Events for an hour) or deleted: start anew
                pass
        namespace = ref.get("namespace") or "default"
        body: Obj = {
            "apiVersion": EVENTS.api_version, "kind": EVENTS.kind,
            "metadata": {"name": f"{str(ref['name'])[:_NAME_PREFIX_LIMIT]}.{uuid.uuid4().hex[:16]}",
                         "namespace": namespace},
            "eventTime": times.micro_time(when),
            "reportingController": self.reporting_controller,
            "reportingInstance": self.reporting_instance,
            "type": type, "reason": reason, "action": action, "note": note,
            "regarding": ref,
        }
        if related is not None:
            body["related"] = object_reference(related)
        out = await self.kube.create(EVENTS, body)
        self.stats.created += 1
        self._seen[key] = _Seen(out["metadata"]["name"], namespace, self.clock())
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_tracked:
            self._seen.popitem(last=False)
        return out


__all__ = ["NORMAL", "WARNING", "EventRecorder", "EventStats", "object_reference", "truncate_note"]
