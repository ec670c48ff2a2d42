"""List-then-watch with resume, bookmarks and relist on 410 (a minimal reflector).

``ListWatch.events()`` yields ``("SYNC", [objects])`` after every (re)list and then
``(type, object)`` for each watch event; bookmarks only advance the resume point. When
the server answers 410 Gone the resume point is dropped and the next iteration relists,
so a consumer always ends up level with the server. Loops are bounded by ``max_relists``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Gone
from dynsnap.models.resources import Resource

log = logging.getLogger(__name__)


@dataclass
class ListWatch:
    kube: Kube
    res: Resource
    namespace: str | None = None
    label_selector: str | None = None
    resource_version: str | None = None  # resume point; None = relist first
    timeout_seconds: int = 60
    max_relists: int = 1000
    relists: int = 0
    bookmarks_seen: int = 0
    _seen: dict[str, Any] = field(default_factory=dict)

    async def events(self) -> AsyncIterator[tuple[str, Obj | list[Obj]]]:
        while self.relists <= self.max_relists:
            if self.resource_version is None:
                listing = await self.kube.list(self.res, namespace=self.namespace, label_selector=self.label_selector)
                self.resource_version = listing["metadata"]["resourceVersion"]
                self.relists += 1
                yield "SYNC", list(listing.get("items", []))
            try:
                async for ev in self.kube.watch(self.res, namespace=self.namespace,
                                                label_selector=self.label_selector,
                                                resource_version=self.resource_version,
                                                timeout_seconds=self.timeout_seconds):
                    obj = ev["object"]
                    self.resource_version = obj["metadata"]["resourceVersion"]
                    if ev["type"] == "BOOKMARK":
                        self.bookmarks_seen += 1
                        continue
                    yield ev["type"], obj
            except Gone as e:
                log.info("watch %s from %s: %s; relisting", self.res.plural, self.resource_version, e.message)
                self.resource_version = None
        raise RuntimeError(f"watch of {self.res.plural} relisted more than {self.max_relists} times")
