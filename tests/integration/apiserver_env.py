"""What the API-server rows of the agent's fault matrix (test_agent_apiserver.py) need beyond
agentenv.py: a local cluster of their own (its API server is restarted, and it keeps an audit log,
read back by auditlog.py), the API server's own end of a pod's connections, the agent's helpers found
by what they are (helperprocs.py), and a CRIU that restores TCP connections closed (the real CRIU
with fake_slow_criu linked in, its restores given a configuration of ``tcp-close``).

The cluster has its own bridge and /16 (``dsnapi0``, 10.217.0.0/16; ``DYNSNAP_TEST_APISERVER_BRIDGE``
and ``DYNSNAP_TEST_APISERVER_CIDR`` pick another pair), so it runs beside the session's cluster.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from auditlog import AuditLog, audit_policy
from helperprocs import Helper, helpers_of
from restart_faults import FAKE_SLOW_CRIU_ENV, build_slow_criu

from dynsnap.testenv.cluster import DYNAMO_USER, LocalCluster, RunningPod
from dynsnap.testenv.netns import SandboxNetwork


def apiserver_cluster(workdir: Path) -> tuple[LocalCluster, AuditLog]:
    """A local cluster (not started) whose API server writes the audit log returned with it."""
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "audit-policy.yaml"
    policy.write_text(audit_policy(users=[DYNAMO_USER]))
    audit = AuditLog(workdir / "audit.log")
    net = SandboxNetwork(bridge=os.environ.get("DYNSNAP_TEST_APISERVER_BRIDGE", "dsnapi0"),
                         cidr=os.environ.get("DYNSNAP_TEST_APISERVER_CIDR", "10.217.0.0/16"))
    cluster = LocalCluster(workdir / "cluster", net=net,
                           apiserver_args=(f"--audit-policy-file={policy}", f"--audit-log-path={audit.path}"))
    return cluster, audit


def helpers(pod: RunningPod, op: str) -> list[Helper]:
    """The agent's helpers (dynsnap-cuda, CRIU) running for the pod's ``op`` (save, resume, criu...),
    found by what they are (helperprocs.py)."""
    return [h for h in helpers_of(pod) if h.op == op]


def server_ends(conns: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Of a pod's connections (local, remote as agentenv.established gives them), those whose other
    end is ESTABLISHED in the host's network namespace, where the API server runs. A connection the
    pod holds and the server does not is half-open: nothing will ever arrive on it."""
    host = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[3] == "01":
            host.add((parts[2], parts[1]))  # seen from the pod: (pod side, server side)
    return conns & host


def leftovers(cluster: LocalCluster) -> list[str]:
    """What a stopped cluster left behind: its network namespaces, its bridge, processes of its workdir
    (the session's conftest checks the same of the session's cluster)."""
    out = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    out += [f"network namespace {line.split()[0]}" for line in netns.splitlines()
            if line.startswith(cluster.net.netns_prefix)]
    link = subprocess.run(["ip", "link", "show", "dev", cluster.net.bridge], capture_output=True, check=False)
    if link.returncode == 0:
        out.append(f"bridge {cluster.net.bridge}")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(cluster.workdir) in cmdline and int(pid) != os.getpid():
            out.append(f"process {pid}: {cmdline[:120]}")
    return out


def keep_logs(workdir: Path, name: str) -> Path:
    """Copy every log under ``workdir`` to ``$DYNSNAP_KEEP_LOGS/<name>`` (default test-logs/)."""
    keep = Path(os.environ.get("DYNSNAP_KEEP_LOGS", "test-logs")) / name
    for log in workdir.rglob("*.log"):
        dest = keep / log.relative_to(workdir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, dest)
    return keep


def tcp_close_criu(workdir: Path) -> tuple[Path, dict[str, str]]:
    """A CRIU that restores every TCP connection closed instead of established (CRIU's ``--tcp-close``,
    for connections that cannot come back) and dumps as the real one: restart_faults.build_slow_criu's
    copy with a ``restore.conf`` of ``tcp-close``. Its path (an agent's ``--criu``) and the environment
    its agent needs (the sandboxes share the node's files, so the directory is the node's)."""
    criu = build_slow_criu(workdir)
    conf = workdir / "fake-slow-criu"
    conf.mkdir(mode=0o700, exist_ok=True)
    (conf / "restore.conf").write_text("tcp-close\n")
    return criu, {FAKE_SLOW_CRIU_ENV: str(conf)}
