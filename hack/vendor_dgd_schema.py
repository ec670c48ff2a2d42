#!/usr/bin/env python3
"""Writes tests/data/dynamo-1.6.1-dgd-v1beta1.yaml: the structural schema of Dynamo's
DynamoGraphDeployment nvidia.com/v1beta1 (ai-dynamo 1.6.1), which tests/unit/test_examples.py
holds examples/dgd/*.yaml to (types, required fields, enums, bounds, and no unknown field).

Two parts, each from its published source (the header written into the file says which):

- the Dynamo part (graph-level spec, a component's fields): transcribed from Dynamo's generated
  v1beta1 DGD reference and the operator's v1beta1 API types, cross-checked with the DGD v1beta1
  templates the ai-dynamo 1.6.1 wheel ships (dynamo/profiler/templates/dgd/*): DYNAMO below;
- a component's ``podTemplate`` (a native ``corev1.PodTemplateSpec``, which is what the operator's
  CRD embeds): converted from Kubernetes' own OpenAPI v3 document of core/v1
  (k8s.io/kubernetes@$KUBE_VERSION/api/openapi-spec/v3/api__v1_openapi.json, in the Go module cache
  after ./run setup built kube), the way controller-gen renders it in a CRD: no descriptions, int-or-
  string and quantities as ``x-kubernetes-int-or-string``, the embedded ObjectMeta reduced to
  name/namespace/labels/annotations/finalizers (controller-gen's generateEmbeddedObjectMeta).

Run from the repository root: ``python3 hack/vendor_dgd_schema.py`` (uses go env GOMODCACHE).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "dynamo-1.6.1-dgd-v1beta1.yaml"

Schema = dict[str, Any]

PRESERVE: Schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
STR: Schema = {"type": "string"}
STR_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
INT_OR_STRING: Schema = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}


def kube_openapi() -> dict[str, Any]:
    lines = (ROOT / "hack" / "versions.env").read_text().splitlines()
    version = next(line.split("=", 1)[1].split()[0] for line in lines if line.startswith("KUBE_VERSION="))
    modcache = os.environ.get("GOMODCACHE") or subprocess.run(
        [os.environ.get("DYNSNAP_GO", "go"), "env", "GOMODCACHE"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = Path(modcache) / f"k8s.io/kubernetes@{version}" / "api/openapi-spec/v3/api__v1_openapi.json"
    doc: dict[str, Any] = json.loads(path.read_text())
    doc["x-source"] = f"k8s.io/kubernetes@{version}/api/openapi-spec/v3/api__v1_openapi.json"
    return doc


class Converter:
    """Kubernetes OpenAPI v3 component schemas -> an inlined structural schema (controller-gen style)."""

    def __init__(self, schemas: dict[str, Any]) -> None:
        self.schemas = schemas
        self.stack: list[str] = []

    def ref(self, name: str) -> Schema:
        short = name.rsplit("/", 1)[-1]
        if short in ("io.k8s.apimachinery.pkg.util.intstr.IntOrString",
                     "io.k8s.apimachinery.pkg.api.resource.Quantity"):
            return dict(INT_OR_STRING)
        if short in ("io.k8s.apimachinery.pkg.apis.meta.v1.Time", "io.k8s.apimachinery.pkg.apis.meta.v1.MicroTime"):
            return {"type": "string", "format": "date-time"}
        if short == "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta":
            return {"type": "object", "properties": {
                "annotations": STR_MAP, "finalizers": {"type": "array", "items": STR}, "labels": STR_MAP,
                "name": STR, "namespace": STR}}
        if short == "io.k8s.apimachinery.pkg.runtime.RawExtension":
            return dict(PRESERVE)
        if short in self.stack:
            raise SystemExit(f"recursive schema {short}: not expected under PodTemplateSpec")
        self.stack.append(short)
        try:
            return self.convert(self.schemas[short])
        finally:
            self.stack.pop()

    def convert(self, s: dict[str, Any]) -> Schema:
        if "$ref" in s:
            return self.ref(s["$ref"])
        if "allOf" in s and len(s["allOf"]) == 1 and "$ref" in s["allOf"][0]:
            return self.ref(s["allOf"][0]["$ref"])
        out: Schema = {}
        if "properties" in s:
            out["type"] = "object"
            out["properties"] = {k: self.convert(v) for k, v in sorted(s["properties"].items())}
            if s.get("required"):
                out["required"] = sorted(s["required"])
        elif s.get("type"):
            out["type"] = s["type"]
        if "items" in s:
            out["items"] = self.convert(s["items"])
        if isinstance(s.get("additionalProperties"), dict):
            out["additionalProperties"] = self.convert(s["additionalProperties"])
        if "enum" in s:
            out["enum"] = list(s["enum"])
        if s.get("format") in ("int32", "int64", "byte", "date-time"):
            out["format"] = s["format"]
        for key in ("x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type"):
            if key in s:
                out[key] = s[key]
        if not out:  # an object with no schema of its own (a free-form map): keep what it holds
            return dict(PRESERVE)
        return out


def dynamo(pod_template: Schema, env_var: Schema) -> Schema:
    """The DGD v1beta1 schema's Dynamo part (see the module docstring for where it comes from)."""
    component: Schema = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "compilationCache": {"type": "object", "required": ["pvcName"], "properties": {
                "mountPath": STR, "pvcName": {"type": "string", "minLength": 1}}},
            "eppConfig": {"type": "object", "properties": {"config": PRESERVE, "configMapRef": PRESERVE}},
            "experimental": {"type": "object", "properties": {
                "checkpoint": PRESERVE, "failover": PRESERVE, "gpuMemoryService": PRESERVE}},
            "frontendSidecar": STR,
            "globalDynamoNamespace": {"type": "boolean"},
            "modelRef": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "minLength": 1}, "revision": STR}},
            "multinode": {"type": "object", "properties": {
                "nodeCount": {"type": "integer", "format": "int32", "minimum": 2, "default": 2}}},
            "name": {"type": "string", "minLength": 1, "maxLength": 63},
            "podTemplate": pod_template,
            "replicas": {"type": "integer", "format": "int32", "minimum": 0},
            "scalingAdapter": PRESERVE,
            "sharedMemorySize": INT_OR_STRING,
            "topologyConstraint": {"type": "object", "required": ["packDomain"], "properties": {"packDomain": STR}},
            "type": {"type": "string", "enum": ["frontend", "worker", "prefill", "decode", "planner", "epp"]},
        },
    }
    spec: Schema = {
        "type": "object",
        "properties": {
            "annotations": STR_MAP,
            "backendFramework": {"type": "string", "enum": ["sglang", "vllm", "trtllm"]},
            "components": {"type": "array", "items": component, "x-kubernetes-list-type": "map",
                           "x-kubernetes-list-map-keys": ["name"]},
            "env": {"type": "array", "items": env_var},
            "experimental": {"type": "object", "properties": {"kvTransferPolicy": PRESERVE}},
            "labels": STR_MAP,
            "priorityClassName": STR,
            "restart": {"type": "object", "required": ["id"], "properties": {
                "id": {"type": "string", "minLength": 1},
                "strategy": {"type": "object", "properties": {
                    "order": {"type": "array", "items": STR},
                    "type": {"type": "string", "enum": ["Sequential", "Parallel"], "default": "Sequential"}}}}},
            "topologyConstraint": {"type": "object", "required": ["clusterTopologyName"], "properties": {
                "clusterTopologyName": {"type": "string", "minLength": 1}, "packDomain": STR}},
        },
    }
    return {"type": "object", "properties": {
        "apiVersion": STR, "kind": STR, "metadata": {"type": "object"}, "spec": spec,
        # The operator writes status; nothing here is checked against it.
        "status": PRESERVE}}


HEADER = """\
# DynamoGraphDeployment nvidia.com/v1beta1, ai-dynamo 1.6.1: the structural schema the examples in
# examples/dgd/ are checked against (tests/unit/test_examples.py). Written by hack/vendor_dgd_schema.py;
# do not edit by hand.
#
# Where it comes from (Apache-2.0 sources, reduced to types, required fields, enums and bounds):
#  - Dynamo's part (spec; a component's name, type, replicas and other fields): Dynamo's v1beta1 DGD
#    reference generated from its operator CRD, and the operator's v1beta1 API types
#    (github.com/ai-dynamo/dynamo, deploy/operator/api/v1beta1/dynamocomponentdeployment_types.go),
#    cross-checked with the v1beta1 DGD templates the ai-dynamo 1.6.1 wheel itself ships
#    (dynamo/profiler/templates/dgd/*/{{agg,disagg}}.yaml: components[] with name, type, replicas,
#    podTemplate). The operator's CRD file of the v1.6.1 tag itself could not be read: the stored
#    copies of nvidia.com_dynamographdeployments.yaml reachable here (deploy/operator/config/crd/bases
#    at 29a131e8e8f2, deploy/cloud/operator/config/crd/bases at 020073063688, the Helm chart's
#    deploy/helm/charts/platform/components/operator/crds at 03e4f32a3b35) serve only v1alpha1.
#    Sub-objects no example uses (experimental, eppConfig, scalingAdapter, ...) are kept as objects
#    that accept anything.
#  - a component's podTemplate (corev1.PodTemplateSpec, embedded as controller-gen renders it):
#    converted from Kubernetes' OpenAPI v3 document of core/v1,
#    {kube_source}.
"""


def main() -> int:
    doc = kube_openapi()
    conv = Converter(doc["components"]["schemas"])
    pod_template = conv.ref("io.k8s.api.core.v1.PodTemplateSpec")
    env_var = conv.ref("io.k8s.api.core.v1.EnvVar")
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "dynamographdeployments.nvidia.com"},
        "spec": {
            "group": "nvidia.com",
            "scope": "Namespaced",
            "names": {"kind": "DynamoGraphDeployment", "listKind": "DynamoGraphDeploymentList",
                      "plural": "dynamographdeployments", "singular": "dynamographdeployment", "shortNames": ["dgd"]},
            "versions": [{"name": "v1beta1", "served": True, "storage": True, "subresources": {"status": {}},
                          "schema": {"openAPIV3Schema": dynamo(pod_template, env_var)}}],
        },
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(HEADER.format(kube_source=doc["x-source"]) + yaml.safe_dump(crd, sort_keys=False, width=120))
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
