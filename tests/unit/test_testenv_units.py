"""Pure pieces of the harness: kubelet's Ready rule, the stub operator's
objects, REST paths, and reading worker ids from Dynamo's answers and DWMs."""

from __future__ import annotations

import pytest

from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm, worker_ids_from
from dynsnap.testenv import stub_operator
from dynsnap.testenv.ready_rule import compute_ready


def _pod(conds: dict[str, str], gates: list[str]) -> dict[str, object]:
    return {"spec": {"readinessGates": [{"conditionType": g} for g in gates]},
            "status": {"conditions": [{"type": t, "status": s} for t, s in conds.items()]}}


@pytest.mark.parametrize(("containers", "conds", "gates", "ready"), [
    (True, {}, [], True),
    (False, {}, [], False),
    (True, {}, [P.CONDITION_SERVING], False),  # a gate nobody set counts as False
    (True, {P.CONDITION_SERVING: "False"}, [P.CONDITION_SERVING], False),
    (True, {P.CONDITION_SERVING: "True"}, [P.CONDITION_SERVING], True),
    (False, {P.CONDITION_SERVING: "True"}, [P.CONDITION_SERVING], False),
    (True, {P.CONDITION_SERVING: "True", "other": "False"}, [P.CONDITION_SERVING, "other"], False),
])
def test_ready_is_containers_ready_and_every_gate(containers: bool, conds: dict[str, str], gates: list[str],
                                                  ready: bool) -> None:
    assert compute_ready(_pod(conds, gates), containers) is ready


def test_stub_operator_creates_discovery_service_and_labelled_owned_pods() -> None:
    dgd = {"metadata": {"name": "g", "namespace": "ns", "uid": "dgd-uid"},
           "spec": {"components": [{"name": "Dec", "componentType": "worker", "subComponentType": "decode",
                                    "replicas": 2, "envs": [{"name": "X", "value": 3}],
                                    "extraPodSpec": {"readinessGates": [{"conditionType": P.CONDITION_SERVING}],
                                                     "mainContainer": {"command": ["run"]}}}]}}
    comp = stub_operator.components(dgd)[0]
    svc = stub_operator.component_service(dgd, comp)
    assert svc["metadata"]["labels"][P.LABEL_DISCOVERY_BACKEND] == "kubernetes"
    assert svc["metadata"]["labels"][P.LABEL_DISCOVERY_ENABLED] == "true"
    pods = stub_operator.component_pods(dgd, comp)
    assert [p["metadata"]["name"] for p in pods] == ["g-dec-0", "g-dec-1"]
    for p in pods:
        assert all(p["metadata"]["labels"][k] == v for k, v in svc["spec"]["selector"].items())
        assert p["metadata"]["labels"][P.LABEL_SUB_COMPONENT_TYPE] == "decode"
        assert p["metadata"]["ownerReferences"][0]["uid"] == "dgd-uid"
        assert p["spec"]["readinessGates"] == [{"conditionType": P.CONDITION_SERVING}]
        c = p["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["DYN_DISCOVERY_BACKEND"]["value"] == "kubernetes" and env["X"]["value"] == "3"
        assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
        assert c["livenessProbe"]["periodSeconds"] == 5 and c["livenessProbe"]["failureThreshold"] == 1


def test_rest_paths() -> None:
    assert R.PODS.path(namespace="ns", name="p", subresource="status") == "/api/v1/namespaces/ns/pods/p/status"
    assert R.DWMS.path(namespace="ns") == "/apis/nvidia.com/v1alpha1/namespaces/ns/dynamoworkermetadatas"
    assert R.NODES.path(name="n") == "/api/v1/nodes/n"
    with pytest.raises(ValueError):
        R.PODS.path(name="p")


def test_worker_ids_from_answers() -> None:
    assert worker_ids_from({"nvext": {"worker_id": {"prefill_worker_id": 1, "decode_worker_id": 2}}}) == (2, 1)
    assert worker_ids_from({"nvext": {"worker_id": 7}}) == (7, None)
    assert worker_ids_from({"error": "x"}) == (None, None)
    assert worker_ids_from(None) == (None, None)


def test_instance_id_is_the_generate_endpoint_of_the_dwm() -> None:
    ep = {"type": "Endpoint", "endpoint": "generate", "instance_id": 42}
    other = {"type": "Endpoint", "endpoint": "clear_kv_blocks", "instance_id": 42}
    dwm = {"metadata": {"name": "w"}, "spec": {"data": {"endpoints": {"a": ep, "b": other},
                                                         "event_channels": {"c": {"instance_id": 99}}}}}
    assert instance_id_from_dwm(dwm) == 42
    with pytest.raises(ValueError):
        instance_id_from_dwm({"metadata": {"name": "w"}, "spec": {"data": {}}})


def test_a_log_that_repeats_one_line_is_told_once_with_its_count() -> None:
    from dynsnap.testenv.chart_node import collapsed
    log = "\n".join(["t0 starting", *(f"t{i} list returning 0 instances" for i in range(1, 50)), "t50 ready"])
    assert collapsed(log).splitlines() == ["t0 starting", "t1 list returning 0 instances",
                                           "    (the line above 48 more times)", "t50 ready"]
    assert len(collapsed("\n".join(f"t line {i}" for i in range(100)), head=5).splitlines()) == 5
