"""The WorkerSnapshot CustomResourceDefinition, generated from the pydantic models.

``workersnapshot_crd()`` turns the JSON schema pydantic writes for ``WorkerSnapshotSpec`` and
``WorkerSnapshotStatus`` into a Kubernetes structural schema: references inlined, ``anyOf`` with
null turned into ``nullable``, titles and Python defaults dropped (the API server would apply
them), enums kept, patterns and bounds kept, ``x-kubernetes-*`` extensions passed through. The
committed ``crds/workersnapshots.yaml`` is this function's output (``dynsnap crd``);
``tests/unit/test_crd.py`` fails when they differ. Pure (bottom layer).
"""

from __future__ import annotations

import copy
from typing import Any

from dynsnap.models import protocol as P
from dynsnap.models.workersnapshot import WorkerSnapshotSpec, WorkerSnapshotStatus

Schema = dict[str, Any]

# Defaults the API server should apply (the spec's container and desired state); every other
# pydantic default is Python-side only.
_KEEP_DEFAULTS = {("spec", "container"), ("spec", "desiredState")}


def _structural(node: Any, defs: dict[str, Any], path: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs, path) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        ref = node["$ref"].rsplit("/", 1)[-1]
        merged = {**copy.deepcopy(defs[ref]), **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs, path)
    node = dict(node)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [a for a in any_of if a.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"{'.'.join(path)}: only `X | None` unions map onto a structural schema")
        inner = _structural(non_null[0], defs, path)
        outer = {k: v for k, v in node.items() if k not in ("default",)}
        node = {**inner, **outer}
        if len(any_of) > len(non_null):
            node["nullable"] = True
    out: Schema = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "default":
            if path[-2:] in _KEEP_DEFAULTS and value is not None:
                out[key] = value
            continue
        if key == "const":
            out["enum"] = [value]
            continue
        if key == "properties":
            out[key] = {name: _structural(v, defs, (*path, name)) for name, v in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs, (*path, "[]"))
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _structural(value, defs, (*path, "*"))
            # `false` (extra="forbid") is what a structural schema does anyway: unknown fields pruned
        else:
            out[key] = _structural(value, defs, path)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


def model_schema(model: type[Any], *, root: str) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="serialization")
    defs = raw.pop("$defs", {})
    schema: Schema = _structural(raw, defs, (root,))
    return schema


def workersnapshot_crd() -> Schema:
    spec = model_schema(WorkerSnapshotSpec, root="spec")
    status = model_schema(WorkerSnapshotStatus, root="status")

    def cond(ctype: P.ConditionType, field: str) -> str:
        return f'.status.conditions[?(@.type=="{ctype.value}")].{field}'

    columns = [
        {"name": "Pod", "type": "string", "jsonPath": ".spec.podName"},
        {"name": "Tier", "type": "string", "jsonPath": ".spec.tier"},
        {"name": "Desired", "type": "string", "jsonPath": ".spec.desiredState"},
        {"name": "Suspended", "type": "string", "jsonPath": cond(P.ConditionType.SUSPENDED, "status")},
        {"name": "Reason", "type": "string", "jsonPath": cond(P.ConditionType.SUSPENDED, "reason")},
        {"name": "Degraded", "type": "string", "jsonPath": cond(P.ConditionType.DEGRADED, "reason"),
         "priority": 1},
        {"name": "Verified", "type": "string", "jsonPath": cond(P.ConditionType.VERIFIED, "status"),
         "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    root: Schema = {
        "type": "object",
        "description": "One Dynamo worker pod that dynsnap may put to sleep and wake in place.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            # fieldPath: the error names spec.podName (without it the API server says "<nil>").
            {"rule": "self.metadata.name == self.spec.podName", "fieldPath": ".spec.podName",
             "message": "a WorkerSnapshot is named after its pod: metadata.name must equal spec.podName"},
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{P.WS_PLURAL}.{P.DYNSNAP_GROUP}"},
        "spec": {
            "group": P.DYNSNAP_GROUP,
            "scope": "Namespaced",
            "names": {"kind": P.WS_KIND, "plural": P.WS_PLURAL, "singular": P.WS_SINGULAR,
                      "shortNames": list(P.WS_SHORT_NAMES), "categories": list(P.WS_CATEGORIES)},
            "versions": [{
                "name": P.WS_VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }
