"""Session fixtures: one real local cluster (etcd, kube-apiserver, kube-controller-manager,
kwok, sandbox network) for the whole integration session, torn down even when tests fail.
Component logs are copied next to the pytest run when a test failed."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dynsnap.testenv.cluster import LocalCluster

pytestmark = pytest.mark.cluster


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the integration tests need root (network namespaces, cgroups, CRIU)")


@pytest.fixture(scope="session")
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[LocalCluster]:
    _require_root()
    workdir = Path(tempfile.mkdtemp(prefix="dynsnap-testenv-"))
    c = LocalCluster(workdir / "cluster")
    await c.start()
    try:
        yield c
    finally:
        broken = c.failed_components()
        await c.stop()
        failed = request.session.testsfailed > 0 or broken
        keep = Path(os.environ.get("DYNSNAP_KEEP_LOGS", "test-logs"))
        if failed and (workdir / "cluster" / "logs").exists():
            shutil.copytree(workdir / "cluster" / "logs", keep, dirs_exist_ok=True)
            print(f"\ncomponent logs kept in {keep.resolve()}")
        shutil.rmtree(workdir, ignore_errors=True)
        if broken:
            pytest.fail("components died during the session:\n" + "\n".join(broken))
