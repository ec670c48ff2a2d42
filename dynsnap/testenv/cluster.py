"""The whole local environment as one object: network, control plane, CRDs, kwok and its fake
nodes (the real node, node.py, joins it; pods that really run, run there).

``LocalCluster.start()`` brings everything up in dependency order and ``stop()`` tears it
all down even after a failure half-way; the pytest session fixtures and ``dynsnap demo``
both use it. Logs of every component stay in ``workdir/logs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources as pkg_resources
from pathlib import Path
from typing import Any, Protocol

import yaml

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import ApiError, Conflict
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv.controlplane import ControlPlane, free_port
from dynsnap.testenv.kwok import fake_node, kwok_process
from dynsnap.testenv.netns import SandboxNetwork
from dynsnap.testenv.process import Supervised

log = logging.getLogger(__name__)

# Fake nodes; each gets a /24 of the run's network as its podCIDR (kwok assigns pod IPs from it).
NODES = ("node-a", "node-b")
TEST_NAMESPACE = "dynamo"


class Named(Protocol):
    """A pod by name (real_graph.NodePod, a pod the real node runs)."""

    @property
    def name(self) -> str: ...

    @property
    def namespace(self) -> str: ...


class PodRef(Named, Protocol):
    """A pod by its identity (a real node's NodePod, real_graph)."""

    @property
    def uid(self) -> str: ...


async def wait_for(what: str, check: Any, *, timeout: float, interval: float = 0.1) -> Any:
    """Await ``check()`` until it returns something truthy; bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = await check()
            if value:
                return value
        except (ApiError, OSError) as e:
            last_exc = e
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last_exc})"
                                                                               if last_exc else ""))


def node_addresses(net: SandboxNetwork) -> list[tuple[str, str, str]]:
    """(node, podCIDR, node IP) for each fake node: the network's /24s after the gateway's one;
    node IPs sit in the gateway's /24 (no process listens there: kubelets are fake)."""
    subnets = net.network.subnets(new_prefix=24)
    gateway_net = next(subnets)
    hosts = list(gateway_net.hosts())
    return [(node, str(next(subnets)), str(hosts[9 + i])) for i, node in enumerate(NODES)]


@dataclass
class LocalCluster:
    workdir: Path
    net: SandboxNetwork = field(default_factory=SandboxNetwork)
    cp: ControlPlane | None = None
    kube: Kube | None = None
    kwok: Supervised | None = None
    admin_kubeconfig: Path | None = None
    apiserver_args: tuple[str, ...] = ()  # extra kube-apiserver flags (ControlPlane.apiserver_args)
    fake_nodes: bool = True  # kwok and its fake NODES; the demo runs on a real node only

    @property
    def api(self) -> Kube:
        assert self.kube is not None, "cluster not started"
        return self.kube

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True, mode=0o700)
        await self.net.up()
        self.cp = ControlPlane(self.workdir, bind_address=self.net.gateway, apiserver_args=self.apiserver_args)
        await self.cp.start(extra_identities={"kwok": ("kwok", ("system:masters",))})
        self.admin_kubeconfig = self.cp.kubeconfig_for("admin")
        self.kube = await Kube.from_kubeconfig(self.admin_kubeconfig, field_manager="testenv")
        await self._install_crds()
        await self._ensure_namespace(TEST_NAMESPACE)
        if self.fake_nodes:
            await self._start_kwok()
        # The namespace controller's "default" service account gates pod creation (ServiceAccount admission).
        await wait_for(f"serviceaccount {TEST_NAMESPACE}/default", lambda: self.api.get(
            R.SERVICE_ACCOUNTS, "default", namespace=TEST_NAMESPACE), timeout=60)

    async def _start_kwok(self) -> None:
        assert self.cp is not None
        self.kwok = kwok_process(kubeconfig=self.cp.kubeconfig_for("kwok"), logs_dir=self.cp.logs_dir,
                                 server_port=free_port())
        await self.kwok.start()
        for node, cidr, node_ip in node_addresses(self.net):
            with contextlib.suppress(Conflict):
                await self.api.create(R.NODES, fake_node(node, pod_cidr=cidr, node_ip=node_ip))
        for node in NODES:
            await wait_for(f"node {node} Ready (kwok)", lambda n=node: self._node_ready(n), timeout=60)

    async def _node_ready(self, name: str) -> bool:
        node = await self.api.get(R.NODES, name)
        conds = node.get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    async def _install_crds(self) -> None:
        crd_dir = pkg_resources.files("dynsnap.testenv") / "crds"
        for entry in sorted(crd_dir.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".yaml"):
                await self.install_crd(yaml.safe_load(entry.read_text()))

    async def install_crd(self, crd: Obj) -> None:
        await self.api.apply(R.CRDS, crd, force=True)
        name = crd["metadata"]["name"]

        async def established() -> bool:
            obj = await self.api.get(R.CRDS, name)
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in obj.get("status", {}).get("conditions") or [])
        await wait_for(f"CRD {name} Established", established, timeout=30)

    async def _ensure_namespace(self, name: str) -> None:
        with contextlib.suppress(Conflict):
            await self.api.create(R.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    # -- pods ----------------------------------------------------------------------------------

    async def wait_pod_ip(self, namespace: str, name: str, *, timeout: float = 60) -> Obj:
        async def has_ip() -> Obj | None:
            pod = await self.api.get(R.PODS, name, namespace=namespace)
            return pod if pod.get("status", {}).get("podIP") else None
        pod: Obj = await wait_for(f"pod {namespace}/{name} IP", has_ip, timeout=timeout)
        return pod

    async def wait_ready(self, namespace: str, name: str, *, ready: bool = True, timeout: float = 60) -> Obj:
        async def check() -> Obj | None:
            pod = await self.api.get(R.PODS, name, namespace=namespace)
            conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
            return pod if (conds.get("Ready") == "True") == ready else None
        pod: Obj = await wait_for(f"pod {namespace}/{name} Ready={ready}", check, timeout=timeout)
        return pod

    async def endpoint_of(self, pod: PodRef, *, label_selector: str) -> Obj | None:
        """The EndpointSlice endpoint whose targetRef is this pod (by UID), among the slices selected."""
        slices = await self.api.list(R.ENDPOINT_SLICES, namespace=pod.namespace, label_selector=label_selector)
        for s in slices.get("items", []):
            for ep in s.get("endpoints") or []:
                if ep.get("targetRef", {}).get("uid") == pod.uid:
                    return dict(ep)
        return None

    async def set_serving_gate(self, pod: Named, value: bool) -> None:
        """Set dynsnap's readiness-gate condition the way dynsnap does: its own field manager,
        server-side apply on the status subresource, no force."""
        await self.api.apply(R.PODS, {"metadata": {"name": pod.name, "namespace": pod.namespace},
                                      "status": {"conditions": [{"type": P.CONDITION_SERVING,
                                                                 "status": "True" if value else "False"}]}},
                             subresource="status", field_manager=P.FIELD_MANAGER)

    async def restart_apiserver(self, *, while_down: Callable[[], Awaitable[object]] | None = None) -> None:
        """Restart the API server in place (same flags, same port), awaiting ``while_down`` while it
        is down (ControlPlane.restart_apiserver); every client must reconnect by itself."""
        assert self.cp is not None, "cluster not started"
        await self.cp.restart_apiserver(while_down=while_down)

    async def stop(self) -> None:
        if self.kube is not None:
            with contextlib.suppress(Exception):
                await self.kube.close()
            self.kube = None
        if self.kwok is not None:
            await self.kwok.stop()
            self.kwok = None
        if self.cp is not None:
            await self.cp.stop()
        with contextlib.suppress(Exception):
            await self.net.down()

    def failed_components(self) -> list[str]:
        out = self.cp.failed_processes() if self.cp else []
        if self.kwok and not self.kwok.alive():
            out.append(f"kwok exited; log {self.kwok.log_path}:\n{self.kwok.tail()}")
        return out
