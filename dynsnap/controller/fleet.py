"""The controller's reading of the cluster: Dynamo graphs, their components and worker pods, each
worker's WorkerSnapshot, DWM and EndpointSlice endpoint, read from the informers' stores (never
from the API server directly), and the phase each worker is in. Pure functions over objects.

Dynamo facts (DESIGN.md section 3.4): a DGD's components are ``spec.components[]`` in v1beta1 and
``spec.services{name: ...}`` in v1alpha1; worker pods carry ``nvidia.com/dynamo-graph-deployment-name``,
``nvidia.com/dynamo-component`` and ``nvidia.com/dynamo-component-type`` (``worker``; ``prefill`` /
``decode`` in ``nvidia.com/dynamo-sub-component-type`` for a disaggregated graph); a worker's DWM is
named after its pod and owned by it; the frontend serves on port 8000.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dynsnap.controller.plan import Phase
from dynsnap.k8s.store import Store
from dynsnap.models import protocol as P
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.models.ids import InstanceId
from dynsnap.models.policy import parse_override
from dynsnap.models.workersnapshot import WorkerSnapshot

Obj = dict[str, Any]
WORKER_TYPES = frozenset({"worker", "prefill", "decode"})


class Role(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    type: str
    sub: str | None
    annotations: dict[str, str]

    @property
    def is_worker(self) -> bool:
        return self.type in WORKER_TYPES


def _component_annotations(c: Obj) -> dict[str, str]:
    """A component's own annotations: its pod template's metadata (v1beta1 as Dynamo 1.6.1 serves it:
    what the operator puts on the pods), ``extraPodMetadata`` (v1alpha1), or ``annotations`` (both
    shapes carry it in older releases); later ones win key by key."""
    out: dict[str, str] = {}
    for part in (((c.get("podTemplate") or {}).get("metadata") or {}).get("annotations"),
                 (c.get("extraPodMetadata") or {}).get("annotations"), c.get("annotations")):
        if isinstance(part, dict):
            out.update({str(k): str(v) for k, v in part.items()})
    return out


def _component(name: str, c: Obj) -> ComponentSpec:
    # v1beta1 names the kind of component `type` (frontend, worker, prefill, decode, planner, epp);
    # v1alpha1 and older v1beta1 `componentType` (+ `subComponentType` for prefill/decode).
    ctype = str(c.get("type") or c.get("componentType") or "")
    sub = c.get("subComponentType") or (ctype if ctype in ("prefill", "decode") else None)
    return ComponentSpec(name, ctype, sub, _component_annotations(c))


def dgd_components(dgd: Obj) -> list[ComponentSpec]:
    """A DGD's components, v1beta1 (``spec.components[]``) or v1alpha1 (``spec.services``)."""
    spec = dgd.get("spec") or {}
    out = []
    for c in spec.get("components") or []:
        if isinstance(c, dict) and c.get("name"):
            out.append(_component(str(c["name"]), c))
    services = spec.get("services") or {}
    if isinstance(services, dict):
        for name, s in services.items():
            if isinstance(s, dict):
                out.append(_component(str(name), s))
    return out


def labels(obj: Obj) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def override_of(pod: Obj, ws: WorkerSnapshot | None) -> tuple[str | None, str | None, bool]:
    """A person's override of the worker: its WorkerSnapshot's ``dynsnap.io/override`` annotation, else
    (deprecated) the pod's ``dynsnap.io/desired-state``. (``"Suspended"``/``"Active"``/None, the problem of
    a value that is neither or None, whether the deprecated pod annotation is what was read.)"""
    if ws is not None and P.ANN_OVERRIDE in ws.metadata.annotations:
        value, bad = parse_override(ws.metadata.annotations[P.ANN_OVERRIDE], key=P.ANN_OVERRIDE)
        return value, bad, False
    raw = annotations_of(pod).get(P.ANN_DESIRED_STATE)
    value, bad = parse_override(raw)
    return value, bad, raw is not None


def annotations_of(obj: Obj) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("annotations") or {})


def is_worker_pod(pod: Obj) -> bool:
    lab = labels(pod)
    return P.LABEL_DGD_NAME in lab and lab.get(P.LABEL_COMPONENT_TYPE) in WORKER_TYPES


def role_of(pod: Obj) -> Role:
    lab = labels(pod)
    sub = lab.get(P.LABEL_SUB_COMPONENT_TYPE) or lab.get(P.LABEL_COMPONENT_TYPE)
    if sub == "prefill":
        return Role.PREFILL
    if sub == "decode":
        return Role.DECODE
    return Role.AGGREGATED


def dgd_key(obj: Obj) -> str | None:
    """``namespace/dgd`` of a worker or frontend pod (None for a pod of no graph)."""
    name = labels(obj).get(P.LABEL_DGD_NAME)
    return f"{obj['metadata'].get('namespace')}/{name}" if name else None


def component_of(pod: Obj) -> str | None:
    return labels(pod).get(P.LABEL_COMPONENT)


def pod_uid(pod: Obj) -> str:
    return str(pod["metadata"].get("uid", ""))


def pod_ip(pod: Obj) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return str(ip) if ip else None


def pod_condition(pod: Obj, ctype: str) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return str(c.get("status"))
    return None


def pod_ready(pod: Obj) -> bool:
    return pod_condition(pod, "Ready") == "True"


def opted_in(pod: Obj) -> bool:
    """The pod carries dynsnap's readiness gate (what the agent also requires)."""
    gates = (pod.get("spec") or {}).get("readinessGates") or []
    return any(g.get("conditionType") == P.CONDITION_SERVING for g in gates)


def endpoint_targets(slice_: Obj) -> list[str]:
    """EndpointSlice index: the pod UIDs its endpoints point at."""
    return [str(e["targetRef"]["uid"]) for e in slice_.get("endpoints") or []
            if (e.get("targetRef") or {}).get("uid")]


def endpoint_ready(slices: Store, pod: Obj) -> bool | None:
    """Whether the pod's endpoint is ready in a discovery EndpointSlice (None: no endpoint for it)."""
    uid = pod_uid(pod)
    seen: bool | None = None
    for s in slices.by_index("target", uid):
        for e in s.get("endpoints") or []:
            if (e.get("targetRef") or {}).get("uid") == uid:
                ready = bool((e.get("conditions") or {}).get("ready"))
                seen = ready or bool(seen)
    return seen


def dwm_of(dwms: Store, pod: Obj) -> Obj | None:
    """The pod's DWM: named after it and owned by it (another owner UID is a stale one)."""
    dwm = dwms.get(pod["metadata"].get("namespace"), pod["metadata"]["name"])
    if dwm is None:
        return None
    owners = {o.get("uid") for o in (dwm.get("metadata") or {}).get("ownerReferences") or []}
    return dwm if pod_uid(pod) in owners else None


def instance_id(dwm: Obj | None) -> InstanceId | None:
    if dwm is None:
        return None
    try:
        return instance_id_from_dwm(dwm)
    except (ValueError, KeyError, TypeError):
        return None


def frontend_url(pods: Store, namespace: str, dgd: str) -> str | None:
    """The graph's frontend (a Ready pod of its frontend component), as a base URL."""
    for p in sorted(pods.by_index("dgd", f"{namespace}/{dgd}"), key=lambda p: p["metadata"]["name"]):
        if labels(p).get(P.LABEL_COMPONENT_TYPE) == "frontend" and pod_ready(p) and pod_ip(p):
            return f"http://{pod_ip(p)}:{P.DYNAMO_FRONTEND_PORT}"
    return None


def parse_ws(obj: Obj | None) -> WorkerSnapshot | None:
    if obj is None:
        return None
    try:
        return WorkerSnapshot.model_validate(obj)
    except ValueError:
        return None


def verification_pending(ws: WorkerSnapshot) -> bool:
    """The worker came back from a quiesce (a capture, or one called off) and is not yet proven."""
    rec = ws.status.controller
    if rec is None or rec.quiesce is None:
        return False
    v = rec.verification
    return v is None or v.started < rec.quiesce.started or v.ok is None


def verification_failed(ws: WorkerSnapshot) -> bool:
    rec = ws.status.controller
    return bool(rec and rec.verification and rec.verification.ok is False and rec.quiesce
                and rec.verification.started >= rec.quiesce.started)


@dataclass
class WorkerFacts:
    pod: Obj
    ws: WorkerSnapshot | None
    endpoint_ready: bool | None
    dwm: Obj | None
    phase: Phase = Phase.NEW
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])


def phase_of(pod: Obj, ws: WorkerSnapshot | None, ep_ready: bool | None) -> Phase:
    if ws is None or ws.spec.pod_uid != pod_uid(pod):
        return Phase.NEW
    st = ws.status
    accepted = ws.condition(P.ConditionType.ACCEPTED)
    if accepted is not None and accepted.status == "False":
        return Phase.BROKEN
    if st.state == P.ObservedState.LOST:
        return Phase.BROKEN
    if verification_failed(ws):
        return Phase.BROKEN
    if ws.spec.desired_state == P.DesiredState.SUSPENDED:
        sus = ws.condition(P.ConditionType.SUSPENDED)
        if st.state == P.ObservedState.SUSPENDED and sus is not None and sus.status == "True":
            return Phase.ASLEEP
        return Phase.CAPTURING
    rec = st.controller
    if rec is not None and rec.quiesce is not None and rec.quiesce.finished is None:
        return Phase.QUIESCING
    # The agent's wake still open is a wake under way, whatever state the worker shows meanwhile (a wake
    # on request shows Active once resumed, a step before the agent records it done): nothing is proven
    # of a wake the agent may still fail.
    if st.state in (P.ObservedState.WAKING, P.ObservedState.SUSPENDED, P.ObservedState.CAPTURING) or \
            (st.last_wake is not None and st.last_wake.finished is None):
        return Phase.WAKING
    if st.state != P.ObservedState.ACTIVE:
        return Phase.NEW
    if not starting_why(pod, ws, ep_ready):
        return Phase.SERVING
    return Phase.STARTING


def starting_why(pod: Obj, ws: WorkerSnapshot, ep_ready: bool | None) -> list[str]:
    """What an awake worker still lacks to be serving (empty: nothing): the words of the controller's
    log for a worker held in Starting."""
    why = []
    if pod_condition(pod, P.CONDITION_SERVING) != "True":
        why.append(f"gate {P.CONDITION_SERVING} not True")
    if not pod_ready(pod):
        why.append("pod not Ready")
    if not ep_ready:
        why.append("no endpoint" if ep_ready is None else "endpoint not ready")
    if verification_pending(ws):
        why.append("verification pending")
    return why
