"""An informer's local cache: objects keyed by ``namespace/name`` with pluggable indexes (layer: k8s).

Keys follow client-go's ``MetaNamespaceKeyFunc``: ``namespace/name`` for namespaced objects,
``name`` for cluster-scoped ones. An index function maps an object to the index values it
files under (none, one or several); ``by_index("owner", uid)`` then answers "which objects
name this owner" without a scan. Ready-made index functions: ``pod_node`` (``spec.nodeName``),
``label(key)`` (e.g. ``dynsnap.io/node`` on dynsnap's own objects), ``owner_uids``.

``replace`` applies a full relist and returns the events that take a consumer from the old
contents to the new: ADDED, MODIFIED (resourceVersion changed), and DELETED for every object
missing from the relist, carrying the last known object (the synthetic deletes a consumer
would otherwise never see after a 410). An object recreated under the same name (a new UID)
comes out as DELETED of the old one, then ADDED of the new one.

Objects are stored as the API server sent them and handed out without copying: callers must
treat them as read-only. The store is not thread-safe; it lives on the informer's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

Obj = dict[str, Any]
IndexFunc = Callable[[Obj], Iterable[str]]

# Aliases: inside ``Store`` the name ``list`` is its method.
_Objs = list[Obj]
_Strs = list[str]
_Events = list[tuple[str, Obj]]

ADDED: Final = "ADDED"
MODIFIED: Final = "MODIFIED"
DELETED: Final = "DELETED"


def key_of(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ValueError("object without metadata.name cannot be stored")
    ns = meta.get("namespace")
    return f"{ns}/{name}" if ns else str(name)


def make_key(namespace: str | None, name: str) -> str:
    return f"{namespace}/{name}" if namespace else name


def pod_node(obj: Obj) -> list[str]:
    """A pod's node (``spec.nodeName``); unscheduled pods are in no node's bucket."""
    node = (obj.get("spec") or {}).get("nodeName")
    return [str(node)] if node else []


def label(key: str) -> IndexFunc:
    """Index by the value of label ``key`` (objects without it are not indexed)."""
    def index(obj: Obj) -> list[str]:
        value = ((obj.get("metadata") or {}).get("labels") or {}).get(key)
        return [str(value)] if value is not None else []
    index.__name__ = f"label[{key}]"
    return index


def owner_uids(obj: Obj) -> list[str]:
    """Every ``metadata.ownerReferences[].uid``."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return [str(r["uid"]) for r in refs if r.get("uid")]


def _rv(obj: Obj) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv is not None else None


def _uid(obj: Obj) -> str | None:
    uid = (obj.get("metadata") or {}).get("uid")
    return str(uid) if uid is not None else None


def older(obj: Obj, than: Obj) -> bool:
    """``obj`` is an earlier version of the same object than ``than``: same UID and a smaller
    resourceVersion. resourceVersions are etcd revisions, comparable as integers (KEP-5504 made that
    a guarantee in Kubernetes 1.34); where either is not a number nothing is taken as older."""
    a, b = _rv(obj) or "", _rv(than) or ""
    return _uid(obj) == _uid(than) and a.isdigit() and b.isdigit() and int(a) < int(b)


class Store:
    """Objects by key, plus one reverse map per index: index → value → keys."""

    def __init__(self, indexers: Mapping[str, IndexFunc] | None = None) -> None:
        self._indexers: dict[str, IndexFunc] = dict(indexers or {})
        self._items: dict[str, Obj] = {}
        self._index: dict[str, dict[str, set[str]]] = {name: {} for name in self._indexers}
        # What each key was filed under, so an update or delete unfiles exactly that.
        self._filed: dict[str, dict[str, tuple[str, ...]]] = {name: {} for name in self._indexers}

    # -- reads -------------------------------------------------------------------------------------

    def get(self, namespace: str | None, name: str) -> Obj | None:
        return self._items.get(make_key(namespace, name))

    def get_key(self, key: str) -> Obj | None:
        return self._items.get(key)

    def list(self) -> list[Obj]:
        return list(self._items.values())

    def keys(self) -> _Strs:
        return list(self._items)

    def by_index(self, index: str, value: str) -> _Objs:
        if index not in self._index:
            raise KeyError(f"no index {index!r}; have {sorted(self._index)}")
        return [self._items[k] for k in sorted(self._index[index].get(value, ()))]

    def index_values(self, index: str) -> _Strs:
        """The values that currently have at least one object in ``index``."""
        return sorted(v for v, keys in self._index[index].items() if keys)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[Obj]:
        return iter(list(self._items.values()))

    # -- writes ------------------------------------------------------------------------------------

    def upsert(self, obj: Obj) -> Obj | None:
        """Store ``obj``; return the object it replaced, if any. An earlier version than the one stored
        is not stored (``older``): a process that stores its own writes as the API server answered
        them (read your own write) would otherwise go back in time when the watch event of an earlier
        write of its arrives after a later write's answer, and act on what it has already changed."""
        key = key_of(obj)
        old = self._items.get(key)
        if old is not None and older(obj, old):
            return old
        self._unfile(key)
        self._items[key] = obj
        self._file(key, obj)
        return old

    def remove(self, obj_or_key: Obj | str) -> Obj | None:
        """Drop an object (by key or by the object); return what was stored, if anything."""
        key = obj_or_key if isinstance(obj_or_key, str) else key_of(obj_or_key)
        old = self._items.pop(key, None)
        if old is not None:
            self._unfile(key)
        return old

    def replace(self, objs: Iterable[Obj]) -> _Events:
        """Make the store hold exactly ``objs``; return the events that describe the change."""
        events: _Events = []
        fresh: dict[str, Obj] = {}
        for obj in objs:
            fresh[key_of(obj)] = obj
        for key, old in list(self._items.items()):
            new = fresh.get(key)
            if new is None or _uid(new) != _uid(old):
                self.remove(key)
                events.append((DELETED, old))
        for obj in fresh.values():
            stored = self._items.get(key_of(obj))
            if stored is not None and older(obj, stored):
                continue  # a write of ours newer than the list stands
            before = self.upsert(obj)
            if before is None:
                events.append((ADDED, obj))
            elif _rv(before) != _rv(obj):
                events.append((MODIFIED, obj))
        return events

    # -- indexes -----------------------------------------------------------------------------------

    def _file(self, key: str, obj: Obj) -> None:
        for name, fn in self._indexers.items():
            values = tuple(dict.fromkeys(fn(obj)))  # dedupe, keep order
            self._filed[name][key] = values
            for v in values:
                self._index[name].setdefault(v, set()).add(key)

    def _unfile(self, key: str) -> None:
        for name in self._indexers:
            for v in self._filed[name].pop(key, ()):
                bucket = self._index[name].get(v)
                if bucket is not None:
                    bucket.discard(key)
                    if not bucket:
                        del self._index[name][v]
