"""``coordination.k8s.io/v1`` Leases: get, try_acquire, renew, release (layer: k8s).

The k8s-level half of leader election; the loop that renews on a timer and stops work when
the lease is lost belongs to ``dynsnap.runtime``. Every write is a PUT (or the first POST)
carrying the resourceVersion that was read, so of two contenders that both saw a free lease
exactly one write lands; the other gets 409 Conflict, which here means "someone else won" and
comes back as None, never as an exception.

Acquire succeeds when there is no Lease, when we already hold it (that is a renew), when it
was released (no holder), or when the holder's ``renewTime + leaseDurationSeconds`` is in the
past by our clock. Taking it from another holder (or after a release) increments
``leaseTransitions``, as client-go does. Times are ``MicroTime``.

Expiry is judged against the holder's ``renewTime`` and our clock, so clock skew between
contenders shortens or lengthens the lease by that skew: keep durations well above the
skew NTP allows (client-go instead times from when it observed a change; the runtime loop can
do that on top of this helper). A renew whose response was lost and then retried gets 409 and
reports the lease lost even though it was renewed; the next ``try_acquire`` finds it held by
us and carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from dynsnap.k8s import times
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Conflict, NotFound
from dynsnap.models.resources import LEASES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseState:
    """A Lease as read from (or written to) the API server."""

    name: str
    namespace: str
    holder: str | None
    duration_seconds: int
    acquire_time: datetime | None
    renew_time: datetime | None
    transitions: int
    resource_version: str
    uid: str

    @classmethod
    def from_obj(cls, obj: Obj) -> LeaseState:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        return cls(
            name=meta["name"], namespace=meta["namespace"],
            holder=spec.get("holderIdentity") or None,
            duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=times.parse_time(spec["acquireTime"]) if spec.get("acquireTime") else None,
            renew_time=times.parse_time(spec["renewTime"]) if spec.get("renewTime") else None,
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str(meta.get("resourceVersion", "")),
            uid=str(meta.get("uid", "")),
        )

    def expires_at(self) -> datetime | None:
        last = self.renew_time or self.acquire_time
        return last + timedelta(seconds=self.duration_seconds) if last else None

    def expired(self, now: datetime) -> bool:
        end = self.expires_at()
        return end is None or end < now

    def free_for(self, identity: str, now: datetime) -> bool:
        return self.holder is None or self.holder == identity or self.expired(now)


class Leases:
    """Lease operations in one namespace on behalf of one ``identity`` (holderIdentity)."""

    def __init__(
        self, kube: Kube, *, namespace: str, identity: str, clock: Callable[[], datetime] = times.now
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.identity = identity
        self.clock = clock

    async def get(self, name: str) -> LeaseState | None:
        try:
            return LeaseState.from_obj(await self.kube.get(LEASES, name, namespace=self.namespace))
        except NotFound:
            return None

    async def try_acquire(self, name: str, *, duration_seconds: int) -> LeaseState | None:
        """Hold ``name`` for ``duration_seconds`` from now; the new state, or None if another holds it
        (unexpired) or won the race."""
        if duration_seconds < 1:
            raise ValueError("leaseDurationSeconds must be at least 1")
        now = self.clock()
        current = await self.get(name)
        if current is None:
            body = self._body(name, holder=self.identity, now=now, acquire_time=now, duration_seconds=duration_seconds,
                              transitions=0)
            try:
                return LeaseState.from_obj(await self.kube.create(LEASES, body))
            except Conflict:  # AlreadyExists: another contender created it first
                log.info("lease %s/%s: created by another contender first", self.namespace, name)
                return None
        if not current.free_for(self.identity, now):
            return None
        ours = current.holder == self.identity
        body = self._body(
            name, holder=self.identity, now=now, duration_seconds=duration_seconds,
            acquire_time=current.acquire_time if ours and current.acquire_time else now,
            transitions=current.transitions if ours else current.transitions + 1,
            resource_version=current.resource_version,
        )
        return await self._put(body)

    async def renew(self, name: str) -> LeaseState | None:
        """Extend our hold; None if the lease is not ours any more (or a concurrent write won)."""
        current = await self.get(name)
        if current is None or current.holder != self.identity:
            return None
        body = self._body(name, holder=self.identity, now=self.clock(), duration_seconds=current.duration_seconds,
                          acquire_time=current.acquire_time or self.clock(), transitions=current.transitions,
                          resource_version=current.resource_version)
        return await self._put(body)

    async def release(self, name: str) -> bool:
        """Give the lease up now (holder cleared) so a successor need not wait out the duration.
        True if released; False if it was not ours or changed under us."""
        current = await self.get(name)
        if current is None or current.holder != self.identity:
            return False
        # client-go leaves a released lease with a 1 s duration and no holder; the holder-less
        # lease is free to anyone at once, the short duration only guards older clients.
        body = self._body(name, holder=None, now=self.clock(), duration_seconds=1, acquire_time=None,
                          transitions=current.transitions, resource_version=current.resource_version)
        return await self._put(body) is not None

    async def _put(self, body: Obj) -> LeaseState | None:
        try:
            return LeaseState.from_obj(await self.kube.replace(LEASES, body))
        except Conflict:
            log.info("lease %s/%s: a concurrent write won", self.namespace, body["metadata"]["name"])
            return None
        except NotFound:  # deleted between our read and our write
            return None

    def _body(
        self, name: str, *, holder: str | None, now: datetime, duration_seconds: int, acquire_time: datetime | None,
        transitions: int, resource_version: str | None = None,
    ) -> Obj:
        spec: Obj = {
            "leaseDurationSeconds": duration_seconds,
            "renewTime": times.micro_time(now),
            "leaseTransitions": transitions,
        }
        if holder is not None:
            spec["holderIdentity"] = holder
        if acquire_time is not None:
            spec["acquireTime"] = times.micro_time(acquire_time)
        meta: Obj = {"name": name, "namespace": self.namespace}
        if resource_version:
            meta["resourceVersion"] = resource_version
        return {"apiVersion": LEASES.api_version, "kind": LEASES.kind, "metadata": meta, "spec": spec}
