"""The controller's serving gate reaches the pod it was decided for, and no other (issue 39): a pod deleted and
recreated under its name (a new UID) between the controller's read and its write never receives the earlier
pod's gate; the write names the UID, which the real API server holds to the stored pod's. Pods of a kwok node:
nothing runs them, the API server is the party that decides."""

from __future__ import annotations

import contextlib
import uuid
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dynsnap.controller.writes import Ctx
from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, LocalCluster

pytestmark = pytest.mark.cluster


def _pod(name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": TEST_NAMESPACE},
            "spec": {"nodeName": NODES[1], "readinessGates": [{"conditionType": P.CONDITION_SERVING}],
                     "containers": [{"name": "main", "image": "dynsnap.local/none:0"}]}}


def _gate(pod: Obj) -> str | None:
    return next((c["status"] for c in (pod.get("status") or {}).get("conditions") or []
                 if c["type"] == P.CONDITION_SERVING), None)


async def test_the_gate_of_a_pod_replaced_under_its_name_is_never_written_to_the_new_one(
        cluster: LocalCluster) -> None:
    api = cluster.api
    ctx = cast(Any, SimpleNamespace(kube=api))
    name = f"gate-uid-{uuid.uuid4().hex[:6]}"
    old = await api.create(R.PODS, _pod(name))
    try:
        assert await Ctx.gate(ctx, old, False) is True
        assert _gate(await api.get(R.PODS, name, namespace=TEST_NAMESPACE)) == "False"
        await api.delete(R.PODS, name, namespace=TEST_NAMESPACE, grace_period_seconds=0)
        new = await api.create(R.PODS, _pod(name))
        assert new["metadata"]["uid"] != old["metadata"]["uid"]
        # The controller decided for the old pod (its copy): the write does not land on the new one.
        assert await Ctx.gate(ctx, old, True) is False
        assert _gate(await api.get(R.PODS, name, namespace=TEST_NAMESPACE)) is None, "the new pod got the old gate"
        assert await Ctx.gate(ctx, new, True) is True
        assert _gate(await api.get(R.PODS, name, namespace=TEST_NAMESPACE)) == "True"
        await api.delete(R.PODS, name, namespace=TEST_NAMESPACE, grace_period_seconds=0)
        assert await Ctx.gate(ctx, new, False) is False  # gone: nothing written, nothing raised
    finally:
        with contextlib.suppress(NotFound):
            await api.delete(R.PODS, name, namespace=TEST_NAMESPACE, grace_period_seconds=0)
