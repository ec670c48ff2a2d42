"""stub_operator: stands in for the Dynamo operator (a Go operator we do not run here).

Given a DynamoGraphDeployment (v1beta1, ``spec.components[]``) it creates what the
real operator creates for each component and no more: a Service carrying Dynamo's
discovery labels (its EndpointSlices are what Dynamo's Kubernetes discovery reads) and
``replicas`` worker pods with Dynamo's labels, env and probes, owned by the DGD.

Two shapes of component:

- ``podTemplate`` (v1beta1 as ai-dynamo 1.6.1 serves it, examples/dgd/): the template's pod, with
  the operator's defaults merged into the container named ``main`` where the template does not say
  otherwise (its env by name, its ports by name, its probes), the Dynamo labels, and the graph's
  own service account (:func:`discovery_rbac`: what Dynamo's discovery asks of the API server,
  DESIGN.md 3.4); a real kubelet runs these pods as they are (real_graph.py);
- ``extraPodSpec.mainContainer`` (the older shape the sandboxes run): the pods' command is that
  container's, which the test harness runs in pod sandboxes; other ``extraPodSpec`` fields
  (readinessGates, ...) pass through to the pod spec as the operator does.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.resources import Resource

Obj = dict[str, Any]

# Probes as Dynamo's operator sets them on workers (DESIGN.md 3.4): /live every 5 s with
# failureThreshold 1 (a dumped worker would be restarted), /health for readiness.
WORKER_LIVENESS = {"httpGet": {"path": "/live", "port": "system"}, "periodSeconds": 5, "failureThreshold": 1,
                   "timeoutSeconds": 4}
# Startup: liveness is not checked until /live has answered once (model load time).
WORKER_STARTUP = {"httpGet": {"path": "/live", "port": "system"}, "periodSeconds": 10, "failureThreshold": 60,
                  "timeoutSeconds": 4}
WORKER_READINESS = {"httpGet": {"path": "/health", "port": "system"}, "periodSeconds": 10, "failureThreshold": 3,
                    "timeoutSeconds": 4}
FRONTEND_READINESS = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3,
                      "timeoutSeconds": 4}


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def component_type(comp: Obj) -> str:
    """The component's kind: v1beta1's ``type``, or the older ``componentType``."""
    return str(comp.get("type") or comp.get("componentType") or "worker")


def component_service(dgd: Obj, comp: Obj) -> Obj:
    name, ns = dgd["metadata"]["name"], dgd["metadata"]["namespace"]
    frontend = component_type(comp) == "frontend"
    port = ({"name": "http", "port": P.DYNAMO_FRONTEND_PORT, "targetPort": P.DYNAMO_FRONTEND_PORT}
            if frontend else {"name": "system", "port": P.DYNAMO_SYSTEM_PORT, "targetPort": P.DYNAMO_SYSTEM_PORT})
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"{name}-{comp['name']}".lower(), "namespace": ns,
                     "labels": {P.LABEL_DGD_NAME: name, P.LABEL_COMPONENT: comp["name"],
                                P.LABEL_DISCOVERY_BACKEND: "kubernetes", P.LABEL_DISCOVERY_ENABLED: "true"},
                     "ownerReferences": [_owner(dgd)]},
        "spec": {"clusterIP": "None", "selector": {P.LABEL_DGD_NAME: name, P.LABEL_COMPONENT: comp["name"]},
                 "ports": [port], "publishNotReadyAddresses": False},
    }


def _owner(dgd: Obj) -> Obj:
    return {"apiVersion": f"{P.DYNAMO_GROUP}/{P.DGD_VERSION}", "kind": "DynamoGraphDeployment",
            "name": dgd["metadata"]["name"], "uid": dgd["metadata"]["uid"], "controller": True,
            "blockOwnerDeletion": True}


def _operator_env(dgd: Obj, comp: Obj, *, frontend: bool) -> list[Obj]:
    name, ns = dgd["metadata"]["name"], dgd["metadata"]["namespace"]
    env: list[Obj] = [
        _field_env("POD_NAME", "metadata.name"), _field_env("POD_UID", "metadata.uid"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        {"name": "DYN_DISCOVERY_BACKEND", "value": "kubernetes"},
        {"name": "DYN_NAMESPACE", "value": f"{ns}-{name}"},
    ]
    if not frontend:
        env += [{"name": "DYN_SYSTEM_ENABLED", "value": "true"},
                {"name": "DYN_SYSTEM_PORT", "value": str(P.DYNAMO_SYSTEM_PORT)},
                {"name": "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS", "value": json.dumps(["generate"])}]
    return env + [{"name": e["name"], "value": str(e["value"])} for e in comp.get("envs", [])]


def _labels(dgd: Obj, comp: Obj) -> dict[str, str]:
    labels = {P.LABEL_DGD_NAME: dgd["metadata"]["name"], P.LABEL_COMPONENT: comp["name"],
              P.LABEL_COMPONENT_TYPE: component_type(comp)}
    if comp.get("subComponentType"):
        labels[P.LABEL_SUB_COMPONENT_TYPE] = comp["subComponentType"]
    return labels


def discovery_sa(dgd: Obj) -> str:
    """The service account of a graph's pods (the stand-in's name for what the operator makes)."""
    return f"{dgd['metadata']['name']}-dynamo"


def discovery_rbac(dgd: Obj) -> list[tuple[Resource, Obj]]:
    """The graph's service account and what Dynamo 1.6.1's frontend and workers ask of the API server
    for Kubernetes discovery (DESIGN.md 3.4), in the graph's namespace, owned by the DGD."""
    ns, sa = dgd["metadata"]["namespace"], discovery_sa(dgd)
    meta = {"name": sa, "namespace": ns, "ownerReferences": [_owner(dgd)]}
    rules = [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [P.DYNAMO_GROUP], "resources": ["dynamoworkermetadatas"],
         "verbs": ["get", "list", "watch", "create", "update", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
    ]
    return [
        (R.SERVICE_ACCOUNTS, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}),
        (R.ROLES, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules}),
        (R.ROLE_BINDINGS, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
                           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
                           "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]}),
    ]


def _merged(defaults: list[Obj], given: list[Obj], key: str) -> list[Obj]:
    """The operator's ``defaults`` the template does not name (by ``key``), then the template's own."""
    named = {g.get(key) for g in given}
    return [d for d in defaults if d.get(key) not in named] + given


def _template_pods(dgd: Obj, comp: Obj) -> list[Obj]:
    """A v1beta1 component's pods: its podTemplate with the operator's defaults merged into ``main``."""
    name, ns = dgd["metadata"]["name"], dgd["metadata"]["namespace"]
    frontend = component_type(comp) == "frontend"
    tmpl = comp.get("podTemplate") or {}
    meta, spec = tmpl.get("metadata") or {}, copy.deepcopy(tmpl.get("spec") or {})
    main = next((c for c in spec.get("containers") or [] if c.get("name") == "main"), None)
    if main is None:
        raise ValueError(f"component {comp['name']}: its podTemplate has no container named main, the one the "
                         "operator merges its defaults into")
    main["env"] = _merged(_operator_env(dgd, comp, frontend=frontend), main.get("env") or [], "name")
    ports = ([{"name": "http", "containerPort": P.DYNAMO_FRONTEND_PORT}] if frontend
             else [{"name": "system", "containerPort": P.DYNAMO_SYSTEM_PORT}])
    main["ports"] = _merged(ports, main.get("ports") or [], "name")
    probes = {"readinessProbe": FRONTEND_READINESS} if frontend else {
        "readinessProbe": WORKER_READINESS, "livenessProbe": WORKER_LIVENESS, "startupProbe": WORKER_STARTUP}
    for key, probe in probes.items():
        main.setdefault(key, probe)
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("serviceAccountName", discovery_sa(dgd))
    annotations = {**(meta.get("annotations") or {}), **(comp.get("annotations") or {})}
    return [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-{comp['name']}-{i}".lower(), "namespace": ns,
                     "labels": {**(meta.get("labels") or {}), **_labels(dgd, comp)}, "annotations": annotations,
                     "ownerReferences": [_owner(dgd)]},
        "spec": copy.deepcopy(spec),
    } for i in range(int(comp.get("replicas", 1)))]


def component_pods(dgd: Obj, comp: Obj) -> list[Obj]:
    if "podTemplate" in comp:
        return _template_pods(dgd, comp)
    name, ns = dgd["metadata"]["name"], dgd["metadata"]["namespace"]
    frontend = component_type(comp) == "frontend"
    extra = dict(comp.get("extraPodSpec", {}))
    main = dict(extra.pop("mainContainer", {}))
    env = _operator_env(dgd, comp, frontend=frontend)
    env += main.pop("env", [])
    ports = ([{"name": "http", "containerPort": P.DYNAMO_FRONTEND_PORT}] if frontend
             else [{"name": "system", "containerPort": P.DYNAMO_SYSTEM_PORT}])
    container: Obj = {
        "name": "main", "image": main.pop("image", "dynamo-runtime:stub"),
        "command": main.pop("command", []), "args": main.pop("args", []), "env": env, "ports": ports,
        "readinessProbe": FRONTEND_READINESS if frontend else WORKER_READINESS,
        **({} if frontend else {"livenessProbe": WORKER_LIVENESS, "startupProbe": WORKER_STARTUP}),
        **main,
    }
    labels = _labels(dgd, comp)
    pods = []
    for i in range(int(comp.get("replicas", 1))):
        pods.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{comp['name']}-{i}".lower(), "namespace": ns, "labels": dict(labels),
                         "annotations": dict(comp.get("annotations", {})), "ownerReferences": [_owner(dgd)]},
            "spec": {"containers": [container], "restartPolicy": "Always", **extra},
        })
    return pods


def components(dgd: Obj) -> list[Obj]:
    comps: list[Obj] = dgd.get("spec", {}).get("components", [])
    return comps
