"""The WorkerSnapshot CRD and its pydantic models are one source of truth: the committed
crds/workersnapshots.yaml is exactly what `dynsnap crd` generates from the models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from dynsnap.cli import main
from dynsnap.models.crd import workersnapshot_crd
from dynsnap.models.protocol import ConditionType, Reason
from dynsnap.models.workersnapshot import WorkerSnapshot, WorkerSnapshotSpec, set_condition, utcnow

ROOT = Path(__file__).resolve().parents[2]
UID = "0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f"


def test_committed_crd_is_the_generated_one() -> None:
    committed = yaml.safe_load((ROOT / "crds" / "workersnapshots.yaml").read_text())
    assert committed == workersnapshot_crd(), "crds/workersnapshots.yaml drifted: run `dynsnap crd > crds/...`"


def test_cli_prints_the_generated_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == workersnapshot_crd()


def _walk(node: Any, path: str = "") -> list[str]:
    """Paths of schema nodes that break Kubernetes' structural-schema rules."""
    bad = []
    if isinstance(node, dict):
        if "$ref" in node or "anyOf" in node or "$defs" in node:
            bad.append(path)
        if ("properties" in node or "items" in node or "enum" in node) and "type" not in node:
            bad.append(path + " (no type)")
        for k, v in node.get("properties", {}).items():
            bad += _walk(v, f"{path}.{k}")
        if "items" in node:
            bad += _walk(node["items"], f"{path}[]")
    return bad


def test_schema_is_structural() -> None:
    schema = workersnapshot_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    status = schema["properties"]["status"]["properties"]
    assert status["conditions"]["x-kubernetes-list-type"] == "map"
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


@pytest.mark.parametrize("bad", [
    {"podName": "../../etc", "podUID": UID, "tier": "suspend"},
    {"podName": "other-ns/pod", "podUID": UID, "tier": "suspend"},
    {"podName": "w-0", "podUID": "not-a-uid", "tier": "suspend"},
    {"podName": "w-0", "podUID": UID, "tier": "deep"},
    {"podName": "w-0", "podUID": UID, "tier": "suspend", "desiredState": "Asleep"},
    {"podName": "w-0", "podUID": UID, "tier": "suspend", "container": "Main_1"},
    {"podName": "w-0", "podUID": UID, "tier": "suspend", "extra": 1},
])
def test_model_rejects_what_the_api_server_rejects(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        WorkerSnapshotSpec.model_validate(bad)


def test_round_trip_and_defaults() -> None:
    ws = WorkerSnapshot.model_validate({"metadata": {"name": "w-0", "namespace": "d", "resourceVersion": "7"},
                                        "spec": {"podName": "w-0", "podUID": UID, "tier": "snapshot"}})
    assert ws.spec.container == "main" and ws.spec.desired_state.value == "Active"
    assert ws.spec.engine_sleep_level == 1 and ws.spec.routable is False
    assert ws.spec.wire() == {"podName": "w-0", "podUID": UID, "container": "main", "tier": "snapshot",
                              "desiredState": "Active", "engineSleepLevel": 1, "routable": False}


def test_condition_transition_time_moves_only_when_status_flips() -> None:
    t0 = utcnow()
    conds = set_condition([], ConditionType.SUSPENDED, False, Reason.ACTIVE, "", generation=1, now=t0)
    later = set_condition(conds, ConditionType.SUSPENDED, False, Reason.ACTIVE, "still", generation=2)
    assert later[0].last_transition_time == t0 and later[0].observed_generation == 2
    flipped = set_condition(later, ConditionType.SUSPENDED, True, Reason.SUSPENDED, "", generation=2)
    assert flipped[0].last_transition_time > t0 and flipped[0].status == "True"
