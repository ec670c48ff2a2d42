"""A real-node test module's environment: dynsnap installed on the real node by ``helm install``
(dynsnap/testenv/chart_node.py), and the graphs the tests deploy on it under the local overlay
(examples/dgd/agg.yaml; ``running`` deploys it for the whole module with the module's tier); the
chart's pods' logs printed if the module fails; everything torn down after, which must leave
nothing wrong behind.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import Conflict
from dynsnap.models import resources as R
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv.chart_node import NODE, NS, RELEASE, WORKER_COMPONENT, Env, upgrade
from dynsnap.testenv.cluster import LocalCluster

__all__ = ["NODE", "NS", "RELEASE", "SHARED_VALUES", "WORKER_COMPONENT", "Env", "component_policy", "deployed",
           "edit_dgd", "installed", "running", "upgrade"]

# The chart values of the install tests/integration/node/ shares, over the tests' chart_values: the
# controller's wake deadline short enough for a test to wait it out (test_controller_wake_deadline.py),
# long enough for any wake here (well under a second) and its verification.
SHARED_VALUES: Obj = {"controller": {"wakeTimeout": 30}}


@contextlib.asynccontextmanager
async def installed(cluster: LocalCluster, work_root: Path, *, gpus: int = 2, values: Obj | None = None
                    ) -> AsyncIterator[Env]:
    """The node with dynsnap installed (``values``: more chart values) and no graph yet (the tests deploy
    theirs: :func:`deployed`)."""
    e = await chart_node.start(cluster, work_root, gpus=gpus, values=values)
    try:
        yield e
    except BaseException:
        print(await e.dump_logs())
        raise
    finally:
        problems = await chart_node.stop(e)
        assert not problems, "\n".join(problems)


@contextlib.asynccontextmanager
async def running(cluster: LocalCluster, work_root: Path, *, tier: str) -> AsyncIterator[Env]:
    """The module's :class:`Env`, examples/dgd/agg.yaml deployed with ``dynsnap.io/tier: tier``."""
    async with installed(cluster, work_root) as e:
        await chart_node.deploy_example(e, chart_node.example_body(e, policy={"dynsnap.io/tier": tier}))
        yield e


@contextlib.asynccontextmanager
async def deployed(env: Env, body: Obj) -> AsyncIterator[real_graph.Graph]:
    """One test's graph: deployed Ready (chart_node.deploy_example), deleted with its pods after."""
    graph = await chart_node.deploy_example(env, body)
    try:
        yield graph
    finally:
        await real_graph.teardown(env.api, graph)
        env.graphs.remove(graph)


def component_policy(body: Obj, component: str, annotations: dict[str, str]) -> Obj:
    """``body`` with ``annotations`` on ``component``'s pod template (a component's own dynsnap policy,
    where Dynamo 1.6.1's v1beta1 keeps a component's metadata); returns ``body``."""
    comp = next(c for c in body["spec"]["components"] if c["name"] == component)
    comp["podTemplate"].setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)
    return body


async def edit_dgd(env: Env, graph: real_graph.Graph, change: Callable[[Obj], None]) -> None:
    """What a user's ``kubectl edit`` of the graph's DGD does: read it, ``change`` it, write it back
    (read again on a conflict, at most 10 times)."""
    name, ns = graph.dgd["metadata"]["name"], graph.dgd["metadata"]["namespace"]
    for _ in range(10):
        obj = await env.api.get(R.DGDS, name, namespace=ns)
        change(obj)
        try:
            await env.api.replace(R.DGDS, obj)
            return
        except Conflict:
            continue
    raise AssertionError("10 conflicting DGD writes in a row")
