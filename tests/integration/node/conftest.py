"""The suites that run on the real node with dynsnap installed by ``helm install``, sharing one
node and one install (realnodeenv.installed): started for the package's first test, torn down after
its last (which must leave nothing behind), so each module pays for its own graphs only. The
directory is a package (``__init__.py``) for that: without one pytest keeps a package-scoped fixture
for the whole session, and the chart's controller would go on acting beside later tests. Each test
deploys its graph with realnodeenv.deployed and deletes it after.

The chart values are the tests' (chart_node.chart_values) and realnodeenv.SHARED_VALUES, which the
tests read where they depend on them (the controller's wake timeout), and both components'
``otlpEndpoint``: the package's OTLP receiver (``otlp``, otlp_collector.py) on the host's address on
the run's bridge, where the chart's pods send their traces as they would to a user's collector.

The long sleep (longsleep.py, ``long_sleep``) starts with the package's first test when
node/test_long_sleep.py is selected, and that test runs last: one worker of a graph of its own sleeps
while the other suites use the node.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # controllerenv, realnodeenv, ...

from auditlog import AuditLog
from longsleep import LongSleep, sleeping
from otlp_collector import Collector, collecting
from realnodeenv import SHARED_VALUES, Env, installed

from dynsnap.testenv.cluster import LocalCluster

# The most pods asking for a GPU that one module runs at once (node/test_agent_refusals.py: its graph's
# 2 workers and 3 copies of a worker pod), and the long sleep's graph (2 workers) beside it. Kubelet
# admits a pod bound to the node only while one is free; the copies name the node themselves.
GPUS = 8
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The package's tests marked ``last_in_package`` (node/test_long_sleep.py) after its others."""
    mine = [i for i in items if HERE in i.path.parents]
    last = [i for i in mine if i.get_closest_marker("last_in_package")]
    if not last or len(last) == len(mine):
        return
    rest = [i for i in items if i not in last]
    at = max(rest.index(i) for i in mine if i not in last) + 1
    items[:] = [*rest[:at], *last, *rest[at:]]


@pytest.fixture(scope="package")
async def otlp(cluster: LocalCluster) -> AsyncIterator[Collector]:
    async with collecting(cluster.net.gateway) as c:
        yield c


@pytest.fixture(scope="package")
async def env(cluster: LocalCluster, otlp: Collector, tmp_path_factory: pytest.TempPathFactory
              ) -> AsyncIterator[Env]:
    values = {section: {**SHARED_VALUES.get(section, {}), "otlpEndpoint": otlp.endpoint}
              for section in ("controller", "agent")}
    async with installed(cluster, Path(tmp_path_factory.mktemp("real-node-suites")), gpus=GPUS,
                         values=values) as e:
        yield e


@pytest.fixture(scope="package")
async def long_sleep(env: Env, audit: AuditLog) -> AsyncIterator[LongSleep]:
    async with sleeping(env, audit) as s:
        yield s


@pytest.fixture(scope="package", autouse=True)
def _long_sleep_from_the_start(request: pytest.FixtureRequest) -> None:
    """With the package's first test, the long sleep starts when a selected test uses it (longsleep.py)."""
    if any("long_sleep" in getattr(i, "fixturenames", ()) for i in request.session.items):
        request.getfixturevalue("long_sleep")
