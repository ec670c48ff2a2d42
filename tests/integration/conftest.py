"""Session fixtures: one real local cluster (etcd, kube-apiserver, kube-controller-manager,
kwok, the run's bridge) for the whole integration session, torn down even when tests fail; the
real node (node.py) joins it where a test or package starts one.

When a test failed, the logs of every component are copied to ``$DYNSNAP_KEEP_LOGS`` (default
``test-logs/``). After teardown the session fails if any network namespace, bridge or process of
the harness is left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from auditlog import AuditLog, audit_policy

from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster
from dynsnap.testenv.netns import SandboxNetwork

pytestmark = pytest.mark.cluster


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the integration tests need root (network namespaces, cgroups, CRIU)")


def _leaks(cluster: LocalCluster) -> list[str]:
    out = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    prefix = cluster.net.netns_prefix
    out += [f"network namespace {line.split()[0]}" for line in netns.splitlines() if line.startswith(prefix)]
    link = subprocess.run(["ip", "link", "show", "dev", cluster.net.bridge], capture_output=True, check=False)
    if link.returncode == 0:
        out.append(f"bridge {cluster.net.bridge}")
    workdir = str(cluster.workdir)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if workdir in cmdline and int(pid) != os.getpid():
            out.append(f"process {pid}: {cmdline[:120]}")
    return out


def session_audit_path(cluster_dir: Path) -> Path:
    """Where the session's API server writes its audit log (beside the cluster's directory)."""
    return cluster_dir.parent / "audit.log"


@pytest.fixture(scope="session")
def audit(cluster: LocalCluster) -> AuditLog:
    """The session API server's audit log (watches of the Dynamo pods' service accounts)."""
    return AuditLog(session_audit_path(cluster.workdir))


@pytest.fixture(scope="session")
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[LocalCluster]:
    _require_root()
    workdir = Path(tempfile.mkdtemp(prefix="dynsnap-testenv-"))
    # Two sessions on one machine (a developer's and CI's, or parallel work) each need their own
    # bridge and /16: DYNSNAP_TEST_BRIDGE / DYNSNAP_TEST_CIDR pick another pair.
    net = SandboxNetwork(bridge=os.environ.get("DYNSNAP_TEST_BRIDGE", "dsnbr0"),
                         cidr=os.environ.get("DYNSNAP_TEST_CIDR", "10.213.0.0/16"))
    # The API server audits the watches of the real node's Dynamo pods (their service accounts' group):
    # node/test_long_sleep.py reads when the server ended a sleeping worker's watches (auditlog.py).
    policy = workdir / "audit-policy.yaml"
    policy.write_text(audit_policy(groups=[f"system:serviceaccounts:{TEST_NAMESPACE}"], verbs=["watch"]))
    c = LocalCluster(workdir / "cluster", net=net, apiserver_args=(
        f"--audit-policy-file={policy}", f"--audit-log-path={session_audit_path(workdir / 'cluster')}"))
    await c.start()
    try:
        yield c
    finally:
        broken = c.failed_components()
        await c.stop()
        leaks = _leaks(c)
        if request.session.testsfailed > 0 or broken or leaks:
            keep = Path(os.environ.get("DYNSNAP_KEEP_LOGS", "test-logs"))
            keep.mkdir(parents=True, exist_ok=True)
            for log in (workdir / "cluster").rglob("*.log"):
                if not log.is_file():  # a real node's /var/log/containers links to pods' deleted logs
                    continue
                rel = log.relative_to(workdir / "cluster")
                (keep / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(log, keep / rel)
            print(f"\ncomponent and pod logs kept in {keep.resolve()}")
        shutil.rmtree(workdir, ignore_errors=True)
        if broken:
            pytest.fail("components died during the session:\n" + "\n".join(broken))
        if leaks:
            pytest.fail("the harness left things behind:\n" + "\n".join(leaks))
