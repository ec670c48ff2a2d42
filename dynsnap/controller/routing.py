"""Whether the frontend still routes to a worker, told from its answer to a request pinned to it,
and the names the controller pins requests with (the worker's ids, the graph's model). Pure, but
for :class:`ModelCache`, which only keeps what the frontend said.

Fail closed. Dynamo 1.6.1's frontend answers a request pinned (``x-dynamo-worker-instance-id`` /
``x-dynamo-prefill-instance-id``) to an instance it does not route to, whether the id is unknown
or its endpoint went not ready, with exactly ``400 {"message":"Invalid request","type":"Bad
Request","code":400}`` (observed on the local cluster: tests/integration/node/test_controller_quiesce.py
waits for exactly this answer; its log says ``error_detail=invalid request parameters``). The
controller's request is otherwise always the same valid one, so that answer means "not this
instance". Only that answer counts as not routed; 200 is routed; anything else (404 model not found,
429, 5xx, another 400, a timeout, no frontend at all) proves nothing and the quiesce asks again,
until its deadline calls it off.

Layer: ``dynsnap.controller`` (pure).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dynsnap.controller import fleet as F
from dynsnap.controller.frontend import PinnedAnswer
from dynsnap.k8s.store import Store
from dynsnap.models import protocol as P

Obj = dict[str, Any]

# Dynamo 1.6.1's refusal of a pinned request to an instance it does not route to (see above).
REFUSAL_STATUS = 400
REFUSAL_BODY = {"message": "Invalid request", "type": "Bad Request", "code": 400}
MODEL_NOT_FOUND = 404  # the frontend no longer serves the model the request named


class Routed(StrEnum):
    YES = "routed"  # answered: the frontend routes to it
    NO = "refused"  # the frontend's explicit refusal of that instance
    UNKNOWN = "unknown"  # anything else: proves nothing


def refused_instance(a: PinnedAnswer) -> bool:
    """The frontend's explicit refusal of the pinned instance, and nothing else."""
    if a.status != REFUSAL_STATUS:
        return False
    try:
        body = json.loads(a.error)
    except ValueError:
        return False
    return isinstance(body, dict) and all(body.get(k) == v for k, v in REFUSAL_BODY.items())


def routed(a: PinnedAnswer | None) -> Routed:
    """What a pinned answer says of routing (None: nothing could be asked, e.g. no ready frontend)."""
    if a is None:
        return Routed.UNKNOWN
    if a.ok:
        return Routed.YES
    return Routed.NO if refused_instance(a) else Routed.UNKNOWN


def describe(a: PinnedAnswer | None) -> str:
    if a is None:
        return "no frontend or model to ask"
    return f"HTTP {a.status}" + (f": {a.error[:120]}" if a.error else "")


@dataclass
class ModelCache:
    """The model each graph's frontend serves (the first listed), kept per graph version: a changed
    graph (another UID or generation) is asked again, an answer that the model is not found drops it,
    and a graph gone is forgotten (:meth:`prune`)."""

    _models: dict[str, tuple[str, int, str]] = field(default_factory=dict)  # key -> (uid, generation, model)

    @staticmethod
    def _version(dgd: Obj) -> tuple[str, int]:
        meta = dgd.get("metadata") or {}
        return str(meta.get("uid") or ""), int(meta.get("generation") or 0)

    def get(self, key: str, dgd: Obj) -> str | None:
        hit = self._models.get(key)
        if hit is None or hit[:2] != self._version(dgd):
            return None
        return hit[2]

    def put(self, key: str, dgd: Obj, model: str) -> None:
        self._models[key] = (*self._version(dgd), model)

    def drop(self, key: str) -> None:
        self._models.pop(key, None)

    def prune(self, live: set[str]) -> None:
        for key in [k for k in self._models if k not in live]:
            del self._models[key]

    def __len__(self) -> int:
        return len(self._models)


def serving_prefill(pods: Store, dwms: Store, pod: Obj) -> int | None:
    """The instance id of a Ready prefill worker of the pod's graph (the first by name)."""
    ns = pod["metadata"]["namespace"]
    for p in sorted(pods.by_index("dgd", f"{ns}/{F.labels(pod)[P.LABEL_DGD_NAME]}"),
                    key=lambda p: p["metadata"]["name"]):
        if F.is_worker_pod(p) and F.role_of(p) == F.Role.PREFILL and F.pod_ready(p):
            iid = F.instance_id(F.dwm_of(dwms, p))
            if iid is not None:
                return int(iid)
    return None


def pins(pods: Store, dwms: Store, pod: Obj) -> tuple[int | None, int | None, list[str]]:
    """(worker id, prefill id, header names) that pin a verification request to this worker: its own
    id (prefill header for a prefill worker) and, for a decode worker, a serving prefill worker's."""
    iid = F.instance_id(F.dwm_of(dwms, pod))
    role = F.role_of(pod)
    if iid is None:
        return None, None, []
    if role == F.Role.PREFILL:
        return None, int(iid), [P.HEADER_PREFILL_INSTANCE_ID]
    if role == F.Role.DECODE:
        prefill = serving_prefill(pods, dwms, pod)
        return int(iid), prefill, [P.HEADER_WORKER_INSTANCE_ID, P.HEADER_PREFILL_INSTANCE_ID] if prefill \
            is not None else [P.HEADER_WORKER_INSTANCE_ID]
    return int(iid), None, [P.HEADER_WORKER_INSTANCE_ID]


def probe_pins(pod: Obj, instance_id: int) -> tuple[int | None, int | None]:
    """(worker id, prefill id) of the routing probe: the one instance asked about, and nothing else,
    so that a refusal can only be of that instance (a decode worker's probe names no prefill worker)."""
    if F.role_of(pod) == F.Role.PREFILL:
        return None, instance_id
    return instance_id, None
