"""stub_operator: stands in for the Dynamo operator (a Go operator we do not run here).

Given a DynamoGraphDeployment (v1beta1, ``spec.components[]``) it creates what the
real operator creates for each component and no more: a Service carrying Dynamo's
discovery labels (its EndpointSlices are what Dynamo's Kubernetes discovery reads) and
``replicas`` worker pods with Dynamo's labels, env and probes, owned by the DGD. The
pods' command is the component's ``extraPodSpec.mainContainer`` command, which the test
harness runs in pod sandboxes; other ``extraPodSpec`` fields (readinessGates, ...) pass
through to the pod spec as the operator does.
"""

from __future__ import annotations

import json
from typing import Any

from dynsnap.models import protocol as P

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


def component_service(dgd: Obj, comp: Obj) -> Obj:
    name, ns = dgd["metadata"]["name"], dgd["metadata"]["namespace"]
    frontend = comp.get("componentType") == "frontend"
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


def component_pods(dgd: Obj, comp: Obj) -> list[Obj]:
    name, ns = dgd["metadata"]["name"], dgd["metadata"]["namespace"]
    ctype = comp.get("componentType", "worker")
    frontend = ctype == "frontend"
    extra = dict(comp.get("extraPodSpec", {}))
    main = dict(extra.pop("mainContainer", {}))
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
    env += [{"name": e["name"], "value": str(e["value"])} for e in comp.get("envs", [])]
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
    labels = {P.LABEL_DGD_NAME: name, P.LABEL_COMPONENT: comp["name"], P.LABEL_COMPONENT_TYPE: ctype}
    if comp.get("subComponentType"):
        labels[P.LABEL_SUB_COMPONENT_TYPE] = comp["subComponentType"]
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
