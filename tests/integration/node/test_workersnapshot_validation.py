"""The API server rejects a malformed WorkerSnapshot (422, the field named) before any agent reads it,
and keeps ``spec.podUID`` immutable: the chart's CRD (crds/, installed by ``helm install`` of the
real node's package) as the API server enforces it. Moved from the sandbox suite
test_agent_refusals.py; it needs no node, only the CRD as the chart installs it.
"""

from __future__ import annotations

import pytest
from realnodeenv import NODE, Env
from refusalenv import hostile_ws

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import Invalid, NotFound
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import TEST_NAMESPACE

pytestmark = pytest.mark.cluster

VALID_UID = "0a1b2c3d-0000-4000-8000-00000000abcd"


def _valid(name: str) -> Obj:
    return hostile_ws(name=name, namespace=TEST_NAMESPACE, node=NODE, pod_name=name, pod_uid=VALID_UID,
                      tier="suspend")


MALFORMED = [  # (id, spec fields changed from a valid body, the field the error names, what it says)
    ("pod-name-parent-path", {"podName": "../x"}, "spec.podName", "should match"),
    ("pod-name-with-slash", {"podName": "a/b"}, "spec.podName", "should match"),
    ("name-is-not-the-pod-name", {"podName": "rfs-val-another"}, "spec.podName",
     "metadata.name must equal spec.podName"),
    ("malformed-pod-uid", {"podUID": "0a1b2c3d-0000-4000-8000-XYZ"}, "spec.podUID", "should match"),
    ("unknown-tier", {"tier": "hibernate"}, "spec.tier", "Unsupported value"),
    ("unknown-desired-state", {"desiredState": "Asleep"}, "spec.desiredState", "Unsupported value"),
    ("upper-case-container", {"container": "Main"}, "spec.container", "should match"),
]


async def test_api_server_rejects_malformed_worker_snapshots(env: Env) -> None:
    api = env.api
    # The valid body the malformed ones are made from is accepted: each rejection is its one change.
    ok = await api.create(R.WORKER_SNAPSHOTS, _valid("rfs-val-ok"))
    assert ok["spec"]["podName"] == "rfs-val-ok"
    try:
        for case, change, field, says in MALFORMED:
            name = f"rfs-val-{case}"
            body = _valid(name)
            body["spec"].update(change)
            with pytest.raises(Invalid) as caught:
                await api.create(R.WORKER_SNAPSHOTS, body)
            err = caught.value
            causes = err.details.get("causes") or []
            assert err.status == 422, case
            assert any(c.get("field") == field and says in c.get("message", "") for c in causes), \
                f"{case}: {err.message} / {causes}"
            with pytest.raises(NotFound):
                await api.get(R.WORKER_SNAPSHOTS, name, namespace=TEST_NAMESPACE)
        # podUID is immutable: the update is refused and the object keeps its UID.
        with pytest.raises(Invalid) as caught:
            await api.merge_patch(R.WORKER_SNAPSHOTS, "rfs-val-ok",
                                  {"spec": {"podUID": "0a1b2c3d-0000-4000-8000-00000000ffff"}},
                                  namespace=TEST_NAMESPACE)
        assert caught.value.status == 422
        assert any(c.get("field") == "spec.podUID" for c in caught.value.details.get("causes") or [])
        assert "podUID is immutable" in caught.value.message
        live = await api.get(R.WORKER_SNAPSHOTS, "rfs-val-ok", namespace=TEST_NAMESPACE)
        assert live["spec"]["podUID"] == VALID_UID
        names = {w["metadata"]["name"] for w in (await api.list(R.WORKER_SNAPSHOTS, namespace=TEST_NAMESPACE))
                 ["items"]}
        assert names & {f"rfs-val-{c[0]}" for c in MALFORMED} == set()
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, "rfs-val-ok", namespace=TEST_NAMESPACE)
