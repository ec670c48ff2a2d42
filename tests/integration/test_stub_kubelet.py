"""The stub kubelet's liveness accounting is a real detector: a pod whose liveness probe
fails gets its restartCount raised in the API (what kubelet would restart), so the
``restarts == 0`` checks elsewhere (a sleeping worker was never killed) can fail.

Sandbox, why: it tests the stub kubelet itself, which the remaining sandbox suites still use.
"""

from __future__ import annotations

import asyncio
import sys
import uuid

import pytest

from dynsnap.models import resources as R
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster, wait_for

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize(("live_path", "expect_restarts"), [("/missing", True), ("/", False)])
async def test_liveness_failures_are_counted_as_restarts(cluster: LocalCluster, live_path: str,
                                                         expect_restarts: bool) -> None:
    name = f"live-{uuid.uuid4().hex[:6]}"
    pod = await cluster.run_pod({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": TEST_NAMESPACE},
        "spec": {"containers": [{
            "name": "main", "image": "python:stub",
            "command": [sys.executable, "-m", "http.server", "8080", "--bind", "0.0.0.0"],
            "ports": [{"name": "http", "containerPort": 8080}],
            "startupProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1, "failureThreshold": 30},
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
            "livenessProbe": {"httpGet": {"path": live_path, "port": "http"}, "periodSeconds": 1,
                              "failureThreshold": 1},
        }]},
    })
    await cluster.wait_ready(TEST_NAMESPACE, name, timeout=30)

    async def restart_count() -> int:
        obj = await cluster.api.get(R.PODS, name, namespace=TEST_NAMESPACE)
        return int(obj["status"]["containerStatuses"][0].get("restartCount", 0))

    if expect_restarts:
        await wait_for("restartCount > 0", restart_count, timeout=30)
        assert pod.kubelet.restarts > 0
    else:
        # Several liveness periods pass while the readiness probe keeps answering.
        for _ in range(4):
            await cluster.wait_ready(TEST_NAMESPACE, name, timeout=30)
            await asyncio.sleep(1.0)
        assert await restart_count() == 0 and pod.kubelet.restarts == 0
    await cluster.delete_pod(TEST_NAMESPACE, name)
