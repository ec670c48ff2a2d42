"""A real-node test module's environment: dynsnap installed on the real node by ``helm install``
(dynsnap/testenv/chart_node.py) and examples/dgd/agg.yaml deployed on it under the local overlay
with the module's tier; the chart's pods' logs printed if the module fails; everything torn down
after, which must leave nothing wrong behind.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from dynsnap.testenv import chart_node
from dynsnap.testenv.chart_node import NODE, NS, RELEASE, WORKER_COMPONENT, Env, upgrade
from dynsnap.testenv.cluster import LocalCluster

__all__ = ["NODE", "NS", "RELEASE", "WORKER_COMPONENT", "Env", "running", "upgrade"]


@contextlib.asynccontextmanager
async def running(cluster: LocalCluster, work_root: Path, *, tier: str) -> AsyncIterator[Env]:
    """The module's :class:`Env`, examples/dgd/agg.yaml deployed with ``dynsnap.io/tier: tier``."""
    e = await chart_node.start(cluster, work_root)
    try:
        await chart_node.deploy_example(e, chart_node.example_body(e, policy={"dynsnap.io/tier": tier}))
        yield e
    except BaseException:
        print(await e.dump_logs())
        raise
    finally:
        problems = await chart_node.stop(e)
        assert not problems, "\n".join(problems)
