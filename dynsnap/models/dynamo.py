"""Facts about Dynamo (ai-dynamo 1.6.1) objects and answers, as pure functions: the instance
id a worker publishes in its DynamoWorkerMetadata and where it leads (the generate endpoint's
transport), the worker ids a frontend answer carries
(``nvext.worker_id``), and the hex spelling the worker's metrics use. Bottom layer."""

from __future__ import annotations

import json
from typing import Any

from dynsnap.models.ids import InstanceId


def instance_id_from_dwm(dwm: dict[str, Any]) -> InstanceId:
    """The instance id of the worker's ``generate`` endpoint in its DWM (Dynamo 1.6.1 layout:
    ``spec.data.endpoints[<key>] = {"type": "Endpoint", "endpoint": "generate", "instance_id": N}``).

    Event channels carry other ids; only the ``generate`` endpoint's is the one pinning takes.
    """
    endpoints = (dwm.get("spec", {}).get("data") or {}).get("endpoints") or {}
    found = {int(e["instance_id"]) for e in endpoints.values()
             if isinstance(e, dict) and e.get("type") == "Endpoint" and e.get("endpoint") == "generate"}
    if len(found) != 1:
        name = dwm.get("metadata", {}).get("name", "?")
        raise ValueError(f"DWM {name}: expected one generate endpoint, found {sorted(found)}")
    return InstanceId(found.pop())


def transport_from_dwm(dwm: dict[str, Any]) -> str | None:
    """Where the frontend sends requests for the worker's ``generate`` endpoint: its ``transport`` in
    the DWM (1.6.1: ``{"tcp": "<ip>:<port>/<endpoint path>"}``), as one canonical string (JSON, keys
    sorted; several generate entries joined by a space). None when the DWM names no generate endpoint.
    The frontend names the instance it routed to in its answer, not the process that served it: an
    instance id whose transport leads elsewhere is answered in this worker's name by another."""
    endpoints = (dwm.get("spec", {}).get("data") or {}).get("endpoints") or {}
    found = sorted({json.dumps(e.get("transport"), sort_keys=True, separators=(",", ":"))
                    for e in endpoints.values()
                    if isinstance(e, dict) and e.get("type") == "Endpoint" and e.get("endpoint") == "generate"})
    return " ".join(found) if found else None


def worker_ids_from(data: Any) -> tuple[InstanceId | None, InstanceId | None]:
    """(decode or aggregated worker id, prefill worker id) from a frontend answer's
    ``nvext.worker_id`` (present when the request asked ``nvext.extra_fields: ["worker_id"]``).
    An answer of another shape (not an object, ``nvext`` not one, an id that is no whole number) names no
    worker: (None, None) for what is missing or malformed, never an exception (a frontend's answer is
    untrusted)."""
    if not isinstance(data, dict) or not isinstance(data.get("nvext"), dict):
        return None, None
    wid = data["nvext"].get("worker_id")
    if isinstance(wid, dict):
        decode = wid.get("decode_worker_id", wid.get("worker_id"))
        return _instance_id(decode), _instance_id(wid.get("prefill_worker_id"))
    return _instance_id(wid), None


def _instance_id(value: Any) -> InstanceId | None:
    """A worker id as a frontend writes it: a non-negative whole number (a JSON integer, or its decimal
    string); anything else is None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return InstanceId(value)
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return InstanceId(int(value))
    return None


def metrics_worker_label(instance_id: InstanceId) -> str:
    """The ``worker_id`` label value of a worker's own metrics: its instance id in hex."""
    return format(instance_id, "x")
