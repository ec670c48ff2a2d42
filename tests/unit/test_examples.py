"""The example DGDs are what a Dynamo 1.6.1 cluster accepts and what dynsnap needs.

Two halves. Schema: every example validates against the DGD nvidia.com/v1beta1 schema of ai-dynamo
1.6.1 (tests/data/dynamo-1.6.1-dgd-v1beta1.yaml, written by hack/vendor_dgd_schema.py, its sources in
its header) with a small structural validator that does what the API server does with a CRD's
openAPIV3Schema: types, required fields, enums, bounds, list-map keys, and an unknown field is an
error unless the schema preserves unknown fields (kubectl apply's field validation refuses it; the
local stand-in CRD keeps everything, so only this catches it). The validator's own table shows it
refuses each kind of mistake. Wiring: every worker component runs under the entrypoint with the
probes on its port, the serving readiness gate, the control directory, the discovery env and, for
no tier, an added capability; its policy annotations parse with dynsnap's own parser.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynsnap.models import protocol as P
from dynsnap.models.policy import parse_policy

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples" / "dgd").glob("*.yaml"))
SCHEMA_FILE = ROOT / "tests" / "data" / "dynamo-1.6.1-dgd-v1beta1.yaml"
WORKER_TYPES = ("worker", "prefill", "decode")

Obj = dict[str, Any]


# -- a structural validator (what the API server checks against a CRD's openAPIV3Schema) -----------

def _type_ok(value: Any, typ: str) -> bool:
    if typ == "object":
        return isinstance(value, dict)
    if typ == "array":
        return isinstance(value, list)
    if typ == "string":
        return isinstance(value, str)
    if typ == "boolean":
        return isinstance(value, bool)
    if typ == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if typ == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    raise AssertionError(f"schema type {typ!r} not handled")


def _object_meta(value: Any, path: str) -> list[str]:
    """The API server validates a root metadata as an ObjectMeta: labels and annotations are maps of
    strings (an unquoted `min-active: 1` is an int, and refused)."""
    if not isinstance(value, dict):
        return [f"{path}: expected an object"]
    errors = [] if isinstance(value.get("name"), str) else [f"{path}.name: required string"]
    for key in ("labels", "annotations"):
        for k, v in (value.get(key) or {}).items():
            if not isinstance(v, str):
                errors.append(f"{path}.{key}.{k}: expected a string, got {type(v).__name__}")
    return errors


def validate(value: Any, schema: Obj, path: str = "") -> list[str]:
    """Every way ``value`` breaks ``schema``, as ``path: reason`` (empty: valid)."""
    if path == ".metadata":
        return _object_meta(value, path)
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, int | str) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected an integer or a string, got {type(value).__name__}"]
    typ = schema.get("type")
    if typ is not None and not _type_ok(value, typ):
        return [f"{path}: expected {typ}, got {type(value).__name__}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{path}: length {len(value)} out of bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        for field in schema.get("required") or []:
            if field not in value:
                errors.append(f"{path}.{field}: required")
        for key, item in value.items():
            if key in props:
                errors += validate(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += validate(item, extra, f"{path}.{key}")
            elif not preserve:
                errors.append(f"{path}.{key}: unknown field")
    if isinstance(value, list):
        for i, item in enumerate(value):
            errors += validate(item, schema.get("items") or {}, f"{path}[{i}]")
        if schema.get("x-kubernetes-list-type") == "map":
            keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"])
                    for item in value if isinstance(item, dict)]
            dupes = sorted({k for k in keys if keys.count(k) > 1}, key=str)
            if dupes:
                errors.append(f"{path}: duplicate entries for key {schema['x-kubernetes-list-map-keys']}: {dupes}")
    return errors


@functools.cache
def _schema() -> Obj:
    """Read once (a 200 KB YAML: the C loader when PyYAML has it). Nothing mutates it."""
    crd = yaml.load(SCHEMA_FILE.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == P.DGD_VERSION]
    schema: Obj = version["schema"]["openAPIV3Schema"]
    return schema


def _load(path: Path) -> Obj:
    doc: Obj = yaml.safe_load(path.read_text())
    return doc


def _workers(dgd: Obj) -> list[Obj]:
    return [c for c in dgd["spec"]["components"] if c.get("type") in WORKER_TYPES]


def _main(comp: Obj) -> Obj:
    (main,) = [c for c in comp["podTemplate"]["spec"]["containers"] if c["name"] == P.DEFAULT_CONTAINER]
    return main


# -- the examples against the schema ---------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_a_valid_dynamo_1_6_1_v1beta1_dgd(path: Path) -> None:
    dgd = _load(path)
    assert dgd["apiVersion"] == f"{P.DYNAMO_GROUP}/{P.DGD_VERSION}" and dgd["kind"] == "DynamoGraphDeployment"
    assert validate(dgd, _schema()) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_header_names_the_release_and_schema_it_was_checked_against(path: Path) -> None:
    header = "".join(ln for ln in path.read_text().splitlines(keepends=True) if ln.startswith("#"))
    assert "ai-dynamo 1.6.1" in header and str(SCHEMA_FILE.relative_to(ROOT)) in header
    assert "ai-dynamo 1.6.1" in SCHEMA_FILE.read_text().splitlines()[0]


def _set(doc: Obj, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _drop(doc: Obj, path: tuple[Any, ...]) -> None:
    for key in path[:-1]:
        doc = doc[key]
    del doc[path[-1]]


W = ("spec", "components", 1)  # agg.yaml's worker component
C = (*W, "podTemplate", "spec", "containers", 0)  # its main container

# Each row: a change to agg.yaml an API server serving the real schema refuses, and the error.
MISTAKES = [
    ("v1alpha1 field names under v1beta1", lambda d: _set(d, (*W, "componentType"), "worker"),
     ".spec.components[1].componentType: unknown field"),
    ("extraPodSpec is gone in v1beta1", lambda d: _set(d, (*W, "extraPodSpec"), {"mainContainer": {}}),
     ".spec.components[1].extraPodSpec: unknown field"),
    ("component annotations are not a v1beta1 field", lambda d: _set(d, (*W, "annotations"), {}),
     ".spec.components[1].annotations: unknown field"),
    ("an unquoted annotation value", lambda d: _set(d, ("metadata", "annotations", P.ANN_MIN_ACTIVE), 1),
     ".metadata.annotations.dynsnap.io/min-active: expected a string, got int"),
    ("a component without a name", lambda d: _drop(d, (*W, "name")), ".spec.components[1].name: required"),
    ("an unknown component type", lambda d: _set(d, (*W, "type"), "wrker"),
     ".spec.components[1].type: 'wrker' is not one of"),
    ("negative replicas", lambda d: _set(d, (*W, "replicas"), -1),
     ".spec.components[1].replicas: -1 is below the minimum 0"),
    ("replicas as a string", lambda d: _set(d, (*W, "replicas"), "2"),
     ".spec.components[1].replicas: expected integer, got str"),
    ("a misspelt container field", lambda d: _set(d, (*C, "readinesProbe"), {}),
     ".spec.components[1].podTemplate.spec.containers[0].readinesProbe: unknown field"),
    ("a probe port that is neither a number nor a name", lambda d: _set(d, (*C, "livenessProbe", "httpGet", "port"),
                                                                        [8081]),
     ".spec.components[1].podTemplate.spec.containers[0].livenessProbe.httpGet.port: expected an integer or"),
    ("a capability list that is not a list", lambda d: _set(d, (*C, "securityContext"),
                                                            {"capabilities": {"add": "CHECKPOINT_RESTORE"}}),
     "securityContext.capabilities.add: expected array, got str"),
    ("two volumes of one name", lambda d: d["spec"]["components"][1]["podTemplate"]["spec"]["volumes"].append(
        {"name": "dynsnap-bin", "emptyDir": {}}), "volumes: duplicate entries for key ['name']"),
    ("a backend Dynamo does not know", lambda d: _set(d, ("spec", "backendFramework"), "tensorrt"),
     ".spec.backendFramework: 'tensorrt' is not one of"),
]


@pytest.mark.parametrize(("what", "change", "error"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_the_validator_refuses_what_the_api_server_refuses(what: str, change: Any, error: str) -> None:
    dgd = _load(ROOT / "examples" / "dgd" / "agg.yaml")
    assert validate(dgd, _schema()) == []  # the row's change is the only thing wrong
    broken = copy.deepcopy(dgd)
    change(broken)
    errors = validate(broken, _schema())
    assert any(error in e for e in errors), errors


# -- the wiring dynsnap needs ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_workers_are_wired_for_dynsnap(path: Path) -> None:
    dgd = _load(path)
    parsed = parse_policy(dgd["metadata"]["annotations"], {})
    assert parsed.ok and parsed.policy is not None and parsed.policy.enabled, parsed
    assert _workers(dgd)
    for comp in _workers(dgd):
        spec = comp["podTemplate"]["spec"]
        main = _main(comp)
        # the entrypoint is PID 1, from the init container's copy, on the control directory's volume
        cmd = main["command"]
        assert cmd[-1] == "--" and main["args"][:2] == ["python3", "-m"], cmd
        assert cmd[cmd.index("--control-dir") + 1] == P.ENTRYPOINT_CONTROL_DIR
        assert int(cmd[cmd.index("--probe-port") + 1]) == P.ENTRYPOINT_PROBE_PORT
        assert int(cmd[cmd.index("--system-port") + 1]) == P.DYNAMO_SYSTEM_PORT
        mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        (init,) = [c for c in spec["initContainers"] if c["name"] == "dynsnap-entrypoint"]
        init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        bin_volume = next(n for n, p in init_mounts.items() if init["command"][-1].startswith(p + "/"))
        assert cmd[0] == init["command"][-1] and cmd[0].startswith(mounts[bin_volume] + "/")
        assert "emptyDir" in volumes[bin_volume]
        control = next(n for n, p in mounts.items() if p == P.ENTRYPOINT_CONTROL_DIR)
        assert "emptyDir" in volumes[control]
        # the pod's probes ask the entrypoint, never the worker
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = main[probe]["httpGet"]["port"]
            assert ports.get(port, port) == P.ENTRYPOINT_PROBE_PORT, probe
        # the controller's readiness gate; the entrypoint must be PID 1 of its own pid namespace
        assert {"conditionType": P.CONDITION_SERVING} in spec["readinessGates"]
        assert not spec.get("shareProcessNamespace")
        # Dynamo's Kubernetes discovery (the identity a wake is verified against)
        env = {e["name"]: e for e in main["env"]}
        assert env["DYN_DISCOVERY_BACKEND"]["value"] == "kubernetes"
        for name, field in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"),
                            ("POD_UID", "metadata.uid")):
            assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == field
        assert env["DYN_SYSTEM_PORT"]["value"] == str(P.DYNAMO_SYSTEM_PORT)
        # no capability added in any tier (Pod Security baseline: test_examples_pod_security.py asks the
        # API server), nothing privileged
        sc = main.get("securityContext") or {}
        added = (sc.get("capabilities") or {}).get("add") or []
        assert added == [], (comp["name"], added)
        assert not sc.get("privileged") and not spec.get("hostPID")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_only_workers_carry_the_serving_gate(path: Path) -> None:
    for comp in _load(path)["spec"]["components"]:
        gates = comp["podTemplate"]["spec"].get("readinessGates") or []
        assert (comp["type"] in WORKER_TYPES) == ({"conditionType": P.CONDITION_SERVING} in gates), comp["name"]


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"agg.yaml", "disagg.yaml"}
    types = {c["type"] for p in EXAMPLES for c in _load(p)["spec"]["components"]}
    assert types >= {"frontend", "worker", "prefill", "decode"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_controller_reads_each_example_as_it_is_written(path: Path) -> None:
    """The controller's reading of a DGD (dynsnap/controller/fleet.py) finds every worker component of
    the example, with its role, and an enabled policy for it: otherwise it would never scrape the
    graph's demand, and nothing would ever sleep."""
    from dynsnap.controller.fleet import dgd_components

    dgd = _load(path)
    comps = {c.name: c for c in dgd_components(dgd)}
    for comp in dgd["spec"]["components"]:
        spec = comps[comp["name"]]
        assert spec.is_worker == (comp["type"] in WORKER_TYPES), comp["name"]
        if comp["type"] in ("prefill", "decode"):
            assert spec.sub == comp["type"]
        if spec.is_worker:
            parsed = parse_policy(dgd["metadata"]["annotations"], spec.annotations)
            assert parsed.ok and parsed.policy is not None and parsed.policy.enabled, (comp["name"], parsed)
