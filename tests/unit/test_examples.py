"""The example DGDs wire every worker the way dynsnap needs (entrypoint as PID 1 on its own
probe port, the serving readiness gate, the control directory), and the stub operator turns
them into pods that keep that wiring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dynsnap.models import protocol as P
from dynsnap.testenv import stub_operator

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "dgd").glob("*.yaml"))


def _workers(dgd: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in dgd["spec"]["components"] if c.get("componentType") == "worker"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_workers_run_under_the_entrypoint(path: Path) -> None:
    dgd = yaml.safe_load(path.read_text())
    assert dgd["metadata"]["annotations"]["dynsnap.io/enabled"] == "true"
    dgd["metadata"].update(namespace="ns", uid="u")
    assert _workers(dgd)
    for comp in _workers(dgd):
        for pod in stub_operator.component_pods(dgd, comp):
            spec = pod["spec"]
            c = spec["containers"][0]
            assert c["command"][0].endswith("/dynsnap-entrypoint") and c["command"][-1] == "--"
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["probe"] == P.ENTRYPOINT_PROBE_PORT
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert c[probe]["httpGet"]["port"] == "probe", probe
            assert {"conditionType": P.CONDITION_SERVING} in spec["readinessGates"]
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert P.ENTRYPOINT_CONTROL_DIR in mounts
            assert any(ic["name"] == "dynsnap-entrypoint" for ic in spec["initContainers"])


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"agg.yaml", "disagg.yaml"}
