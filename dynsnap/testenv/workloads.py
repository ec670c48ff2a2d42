"""The control plane's parts that a real node's workloads need and the session's control plane
leaves off: kube-scheduler and kube-controller-manager's workload controllers (Deployment,
ReplicaSet, DaemonSet, Job), the real binaries of the control plane's release.

Layer: ``dynsnap.testenv`` (test harness only). Started by the tests that run workloads as pods of
a real node (a Helm chart's Deployment and DaemonSet, its hook's Job), for as long as they need
them, and stopped after; the session's own controller-manager keeps only the controllers every
test relies on (controlplane.py): with these on for the whole session, the charts other tests
install with kwok's fake nodes and the stand-ins for their pods would get pods of their own.

The scheduler authenticates as ``system:kube-scheduler`` with a client certificate of the
environment's CA (the bootstrap RBAC's scheduler role, nothing more); the controllers run as
``system:kube-controller-manager``, each under its own service account
(``--use-service-account-credentials``), as in a cluster. Neither elects a leader (one of each).
Pods with a ``spec.nodeName`` (the kwok nodes' and the sandboxes') are not the scheduler's: it
binds only pods that name no node, which the tests pin to the real node with a nodeSelector.

    work = Workloads(cluster.cp, cluster.workdir / "workloads")
    await work.start()   # returns once both answer /healthz
    await lift_not_ready_taint(cluster.api, node.name)  # the node lifecycle controller's one step
    ...
    await work.stop()
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import httpx
import yaml

from dynsnap.k8s.client import Kube
from dynsnap.models import resources as R
from dynsnap.testenv.controlplane import ControlPlane, free_port
from dynsnap.testenv.pki import issue_cert
from dynsnap.testenv.process import Supervised, require_binary

WORKLOAD_CONTROLLERS = "deployment-controller,replicaset-controller,daemonset-controller,job-controller"
SCHEDULER_USER = "system:kube-scheduler"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


async def lift_not_ready_taint(api: Kube, node: str) -> None:
    """What the node lifecycle controller does for a node that is Ready: take away the not-ready taint
    its kubelet registered it with (no pod that does not tolerate it is scheduled there). The session's
    control plane runs no node lifecycle controller (controlplane.py: it would evict the pods of kwok's
    nodes), so a real node that is to run scheduled pods gets this one step of it."""
    live = await api.get(R.NODES, node)
    if not any(c["type"] == "Ready" and c["status"] == "True" for c in live["status"].get("conditions") or []):
        raise RuntimeError(f"node {node} is not Ready: its not-ready taint stays")
    taints = live["spec"].get("taints") or []
    kept = [t for t in taints if t.get("key") != NOT_READY_TAINT]
    if kept != taints:
        await api.merge_patch(R.NODES, node, {"spec": {"taints": kept or None}})


class Workloads:
    """kube-scheduler + the workload controllers for one control plane."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp = cp
        self.workdir = workdir
        self.procs: list[Supervised] = []

    def _scheduler_kubeconfig(self) -> Path:
        assert self.cp.pki is not None, "control plane not started"
        crt, key = self.workdir / "kube-scheduler.crt", self.workdir / "kube-scheduler.key"
        issue_cert(self.cp.pki, crt, key, cn=SCHEDULER_USER, client=True)
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "testenv",
               "clusters": [{"name": "testenv", "cluster": {"server": self.cp.url,
                                                            "certificate-authority": str(self.cp.pki.ca_cert)}}],
               "users": [{"name": SCHEDULER_USER, "user": {"client-certificate": str(crt), "client-key": str(key)}}],
               "contexts": [{"name": "testenv", "context": {"cluster": "testenv", "user": SCHEDULER_USER}}]}
        path = self.workdir / "kube-scheduler.kubeconfig"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    async def start(self, *, timeout: float = 120) -> None:
        try:
            await self._start(timeout)
        except BaseException:
            await self.stop()
            raise

    async def _start(self, timeout: float) -> None:
        assert self.cp.pki is not None, "control plane not started"
        sched_bin = require_binary(os.environ.get("DYNSNAP_KUBE_SCHEDULER"), "kube-scheduler", "DYNSNAP_KUBE_SCHEDULER")
        kcm_bin = require_binary(os.environ.get("DYNSNAP_KUBE_CONTROLLER_MANAGER"), "kube-controller-manager",
                                 "DYNSNAP_KUBE_CONTROLLER_MANAGER")
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        sched_cfg = self._scheduler_kubeconfig()
        kcm_cfg = self.cp.kubeconfig_for("kcm", self.workdir / "kcm-workloads.kubeconfig")
        sched_port, kcm_port = free_port(), free_port()
        sched = Supervised("kube-scheduler", [
            str(sched_bin), f"--kubeconfig={sched_cfg}", f"--authentication-kubeconfig={sched_cfg}",
            f"--authorization-kubeconfig={sched_cfg}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={sched_port}", "--v=1",
        ], log_path=self.workdir / "kube-scheduler.log")
        kcm = Supervised("kube-controller-manager-workloads", [
            str(kcm_bin), f"--kubeconfig={kcm_cfg}", f"--authentication-kubeconfig={kcm_cfg}",
            f"--authorization-kubeconfig={kcm_cfg}", f"--controllers={WORKLOAD_CONTROLLERS}",
            "--use-service-account-credentials=true", f"--root-ca-file={self.cp.pki.ca_cert}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={kcm_port}", "--v=1",
        ], log_path=self.workdir / "kube-controller-manager-workloads.log")
        # /healthz of both is open to anyone (their default --authorization-always-allow-paths).
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE  # their own self-signed serving certs
        async with httpx.AsyncClient(verify=insecure, timeout=3) as http:
            for proc, port in ((sched, sched_port), (kcm, kcm_port)):
                self.procs.append(proc)
                await proc.start()

                async def healthy(port: int = port) -> bool:
                    return (await http.get(f"https://127.0.0.1:{port}/healthz")).status_code == 200
                await proc.wait_ready(healthy, timeout=timeout, what="answering /healthz")

    def failed(self) -> list[str]:
        return [f"{p.name} exited; log {p.log_path}:\n{p.tail()}" for p in self.procs if not p.alive()]

    async def stop(self) -> None:
        for proc in reversed(self.procs):
            await proc.stop()
        self.procs.clear()
