"""The real node's graph, as pure parts: the stub operator's pods for a v1beta1 podTemplate component
(examples/dgd/agg.yaml: the operator's defaults merged into ``main`` only where the example says
nothing), the graph's discovery RBAC, the GPU stand-in's driver for GPU containers only, and the local
overlay changing only what its docstring lists. tests/integration/test_real_node_wake.py runs them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import stub_gpu_stack, stub_operator
from dynsnap.testenv.dynsnap_parts import StubDriver
from dynsnap.testenv.real_graph import MODEL_DIR, local_overlay, mocker_args

ROOT = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]


def _agg() -> Obj:
    dgd: Obj = yaml.safe_load((ROOT / "examples" / "dgd" / "agg.yaml").read_text())
    dgd["metadata"] |= {"namespace": "dynamo", "uid": "dgd-uid"}
    return dgd


def _comp(dgd: Obj, ctype: str) -> Obj:
    return next(c for c in dgd["spec"]["components"] if stub_operator.component_type(c) == ctype)


def _main(spec: Obj) -> Obj:
    return next(c for c in spec["containers"] if c["name"] == "main")


def test_stub_operator_merges_its_defaults_into_the_examples_main_container() -> None:
    dgd = _agg()
    comp = _comp(dgd, "worker")
    pods = stub_operator.component_pods(dgd, comp)
    assert [p["metadata"]["name"] for p in pods] == ["llm-agg-vllmworker-0", "llm-agg-vllmworker-1"]
    pod = pods[0]
    assert pod["metadata"]["labels"] == {P.LABEL_DGD_NAME: "llm-agg", P.LABEL_COMPONENT: "VllmWorker",
                                         P.LABEL_COMPONENT_TYPE: "worker"}
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "dgd-uid"
    spec, tmpl = pod["spec"], comp["podTemplate"]["spec"]
    assert spec["serviceAccountName"] == stub_operator.discovery_sa(dgd) and spec["restartPolicy"] == "Always"
    # What the example says stays as it says it.
    for key in ("readinessGates", "volumes", "initContainers"):
        assert spec[key] == tmpl[key], key
    main, want = _main(spec), _main(tmpl)
    for key in ("image", "command", "args", "resources", "volumeMounts", "startupProbe",
                "livenessProbe", "readinessProbe"):
        assert main[key] == want[key], key
    assert "securityContext" not in main and "securityContext" not in want  # none added, none in the example
    # The operator's defaults only where the example names nothing: its env by name, its port by name.
    env = [e["name"] for e in main["env"]]
    assert len(env) == len(set(env)), env
    assert {"DYN_NAMESPACE", "DYN_SYSTEM_ENABLED", "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"} <= set(env)
    assert [e for e in main["env"] if e["name"] == "POD_NAME"] == [e for e in want["env"] if e["name"] == "POD_NAME"]
    assert {p["name"] for p in main["ports"]} == {"probe", "system"}
    # The example's own object is not changed.
    assert comp == _comp(_agg(), "worker")


def test_stub_operator_gives_the_frontend_its_port_and_probe() -> None:
    dgd = _agg()
    (pod,) = stub_operator.component_pods(dgd, _comp(dgd, "frontend"))
    main = _main(pod["spec"])
    assert main["ports"] == [{"name": "http", "containerPort": P.DYNAMO_FRONTEND_PORT}]
    assert main["readinessProbe"] == stub_operator.FRONTEND_READINESS and "livenessProbe" not in main
    assert stub_operator.component_service(dgd, _comp(dgd, "frontend"))["spec"]["ports"][0]["name"] == "http"


def test_discovery_rbac_grants_what_dynamo_asks_to_the_graphs_account() -> None:
    dgd = _agg()
    objs = dict((res.kind, obj) for res, obj in stub_operator.discovery_rbac(dgd))
    assert set(objs) == {R.SERVICE_ACCOUNTS.kind, R.ROLES.kind, R.ROLE_BINDINGS.kind}
    sa = stub_operator.discovery_sa(dgd)
    assert objs["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "dynamo"}]
    rules = {(r["apiGroups"][0], r["resources"][0]): set(r["verbs"]) for r in objs["Role"]["rules"]}
    assert rules[("discovery.k8s.io", "endpointslices")] == {"get", "list", "watch"}
    assert "patch" in rules[(P.DYNAMO_GROUP, "dynamoworkermetadatas")]
    assert rules[("", "pods")] == {"get"}


def test_local_overlay_changes_only_what_it_lists(tmp_path: Path) -> None:
    driver = StubDriver(tmp_path / "stub")
    src = _agg()
    out = local_overlay(src, dynamo_image="dynsnap-dynamo:1.6.1", entrypoint_image="dynsnap-entrypoint:0.1.0",
                        driver=driver, policy={"dynsnap.io/tier": "suspend"}, memory_limit="2Gi")
    assert src == _agg()  # a copy
    assert out["metadata"]["namespace"] == "dynamo" and out["metadata"]["annotations"]["dynsnap.io/tier"] == "suspend"
    assert {k: v for k, v in out["metadata"]["annotations"].items() if k != "dynsnap.io/tier"} == {
        k: v for k, v in src["metadata"]["annotations"].items() if k != "dynsnap.io/tier"}
    fe_src, fe = _comp(src, "frontend"), _comp(out, "frontend")
    assert _main(fe["podTemplate"]["spec"])["image"] == "dynsnap-dynamo:1.6.1"
    undo = copy.deepcopy(fe)
    _main(undo["podTemplate"]["spec"])["image"] = _main(fe_src["podTemplate"]["spec"])["image"]
    assert undo == fe_src  # the frontend: its image only
    w_src, w = _comp(src, "worker")["podTemplate"]["spec"], _comp(out, "worker")["podTemplate"]["spec"]
    assert {i["image"] for i in w["initContainers"]} == {"dynsnap-entrypoint:0.1.0"}
    assert [i["command"] for i in w["initContainers"]] == [i["command"] for i in w_src["initContainers"]]
    main, main_src = _main(w), _main(w_src)
    assert main["image"] == "dynsnap-dynamo:1.6.1" and main["args"] == mocker_args()
    assert MODEL_DIR in main["args"] and main["command"] == main_src["command"]
    assert main["resources"]["limits"] == {**main_src["resources"]["limits"], "memory": "2Gi"}
    for key in ("securityContext", "startupProbe", "livenessProbe", "readinessProbe", "ports"):
        assert main.get(key) == main_src.get(key), key
    assert w["readinessGates"] == w_src["readinessGates"]
    # The driver where the container toolkit would put it, in the GPU container, and only there.
    assert w["volumes"][:len(w_src["volumes"])] == w_src["volumes"]
    assert {v["name"] for v in w["volumes"][len(w_src["volumes"]):]} == {stub_gpu_stack.DRIVER_VOLUME,
                                                                         stub_gpu_stack.DRIVER_STATE_VOLUME}
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["LD_PRELOAD"] == str(driver.libcuda)
    assert {e["name"] for e in main["env"]} - {"LD_PRELOAD", "DYNSNAP_STUB_DIR"} == {e["name"] for e in main_src["env"]}


def test_with_driver_keeps_a_containers_own_preload_and_skips_cpu_containers(tmp_path: Path) -> None:
    driver = StubDriver(tmp_path / "stub")
    spec = {"containers": [
        {"name": "gpu", "resources": {"limits": {stub_gpu_stack.GPU_RESOURCE: "1"}}, "env": [{"name": "LD_PRELOAD",
                                                                                     "value": "/x/own.so"}]},
        {"name": "cpu"}]}
    out = stub_gpu_stack.with_driver(spec, driver)
    gpu, cpu = out["containers"]
    assert {e["name"]: e["value"] for e in gpu["env"]}["LD_PRELOAD"] == f"{driver.libcuda} /x/own.so"
    assert cpu == {"name": "cpu"} and spec["containers"][1] == {"name": "cpu"}
    assert stub_gpu_stack.with_driver({"containers": [{"name": "cpu"}]}, driver) == {"containers": [{"name": "cpu"}]}
