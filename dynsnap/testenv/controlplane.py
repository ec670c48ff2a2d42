"""etcd + kube-apiserver + kube-controller-manager, real binaries, local addresses.

The API server serves TLS with token authentication and RBAC on (client certificates of the
environment's CA authenticate too, and the Node authorizer with NodeRestriction confines a real
node's kubelet, ``system:node:<name>``, to its own node and pods, as in a cluster); it reaches a
kubelet only at the node's InternalIP, with its own client certificate, verifying the kubelet's
serving certificate against the CA (``node.py``). The controller
manager runs the EndpointSlice controller, the garbage collector, the namespace and
service-account controllers and the root-CA publisher, each under its own service account
(``--use-service-account-credentials``), exactly as in a cluster. Identities are static
tokens; ``kubeconfig_for`` writes a kubeconfig for any of them. ``apiserver_args`` are extra
kube-apiserver flags (after the defaults: a repeated flag wins); ``restart_apiserver`` stops the API
server and starts it again with the same flags and port, as a rolled control plane does.
"""

from __future__ import annotations

import os
import secrets
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import yaml

from dynsnap.testenv.pki import Pki, make_pki
from dynsnap.testenv.process import Supervised, require_binary

# Controllers the suite relies on; most nodes are fake (kwok), so node-lifecycle stays off
# (it would taint and evict pods of nodes whose kubelet never reports), and so does node IPAM:
# every node is created with its spec.podCIDR by the harness (kwok's by cluster.py, a real
# node's by node.py before its kubelet registers it).
# The root-CA publisher puts kube-root-ca.crt into every namespace: a real kubelet needs it for the
# service-account token volume (kube-api-access-*) of every pod it runs.
KCM_CONTROLLERS = ("endpointslice-controller,garbage-collector-controller,namespace-controller,"
                   "serviceaccount-controller,root-ca-certificate-publisher-controller")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Identity:
    user: str
    groups: tuple[str, ...] = ()
    token: str = field(default_factory=lambda: secrets.token_hex(16))


@dataclass
class ControlPlane:
    workdir: Path
    bind_address: str = "127.0.0.1"
    identities: dict[str, Identity] = field(default_factory=dict)
    procs: list[Supervised] = field(default_factory=list)
    url: str = ""
    etcd_url: str = ""
    pki: Pki | None = None
    apiserver_args: tuple[str, ...] = ()
    apiserver: Supervised | None = None
    apiserver_started: datetime | None = None  # when the running API server process was started (UTC)
    # (stopped, started again or None while down) of each restart_apiserver, UTC: the windows in which a
    # client's request failing is the restart's doing, not the client's
    apiserver_restarts: list[tuple[datetime, datetime | None]] = field(default_factory=list)

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    def kubeconfig_for(self, who: str, path: Path | None = None, *, server: str | None = None) -> Path:
        """Write a kubeconfig for a known identity (``admin``, ``kcm``, ``kwok``, ...)."""
        ident = self.identities[who]
        assert self.pki is not None
        path = path or self.workdir / f"kubeconfig-{who}"
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "testenv",
            "clusters": [{"name": "testenv", "cluster": {"server": server or self.url,
                                                         "certificate-authority": str(self.pki.ca_cert)}}],
            "users": [{"name": who, "user": {"token": ident.token}}],
            "contexts": [{"name": "testenv", "context": {"cluster": "testenv", "user": who}}],
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    def add_identity(self, who: str, user: str, groups: tuple[str, ...] = ()) -> Identity:
        ident = Identity(user, groups)
        self.identities[who] = ident
        return ident

    async def start(self, *, extra_identities: dict[str, tuple[str, tuple[str, ...]]] | None = None) -> None:
        etcd_bin = require_binary(os.environ.get("DYNSNAP_ETCD"), "etcd", "DYNSNAP_ETCD")
        apiserver_bin = require_binary(os.environ.get("DYNSNAP_KUBE_APISERVER"), "kube-apiserver",
                                       "DYNSNAP_KUBE_APISERVER")
        kcm_bin = require_binary(os.environ.get("DYNSNAP_KUBE_CONTROLLER_MANAGER"), "kube-controller-manager",
                                 "DYNSNAP_KUBE_CONTROLLER_MANAGER")
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.pki = make_pki(self.workdir / "pki", ips=["127.0.0.1", self.bind_address, "10.96.0.1"],
                            dns=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"])
        self.add_identity("admin", "testenv-admin", ("system:masters",))
        self.add_identity("kcm", "system:kube-controller-manager")
        for who, (user, groups) in (extra_identities or {}).items():
            self.add_identity(who, user, groups)
        tokens = self.workdir / "tokens.csv"
        fd = os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            for ident in self.identities.values():
                f.write(f'{ident.token},{ident.user},{ident.user},"{",".join(ident.groups)}"\n')

        # etcd: loopback only, its data in the workdir.
        client_port, peer_port = free_port(), free_port()
        etcd = Supervised("etcd", [
            str(etcd_bin), "--name=testenv", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{client_port}",
            f"--advertise-client-urls=http://127.0.0.1:{client_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=testenv=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",  # test data: durability buys nothing, fsync costs seconds on a busy disk
            "--log-level=warn",
        ], log_path=self.logs_dir / "etcd.log")
        await self._start(etcd)
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        async with httpx.AsyncClient(timeout=2.0) as http:
            async def etcd_ok() -> bool:
                return (await http.get(f"http://127.0.0.1:{client_port}/health")).status_code == 200
            await etcd.wait_ready(etcd_ok, timeout=60)

        port = free_port(self.bind_address)
        self.url = f"https://{self.bind_address}:{port}"
        pki = self.pki
        apiserver = Supervised("kube-apiserver", [
            str(apiserver_bin),
            f"--etcd-servers=http://127.0.0.1:{client_port}",
            f"--bind-address={self.bind_address}", f"--secure-port={port}",
            f"--advertise-address={self.bind_address}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--token-auth-file={tokens}",
            f"--client-ca-file={pki.ca_cert}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={pki.kubelet_client_cert}",
            f"--kubelet-client-key={pki.kubelet_client_key}",
            f"--kubelet-certificate-authority={pki.ca_cert}",
            # Only the node's InternalIP: the default tries its Hostname first, a DNS lookup
            # through the host's resolver, which is no part of this environment.
            "--kubelet-preferred-address-types=InternalIP",
            "--anonymous-auth=false",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--api-audiences=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",  # one test client: APF adds nothing but latency here
            "--watch-cache=true",
            # ConfigMaps alone bypass the watch cache, so a watch from a compacted
            # resourceVersion reaches etcd and gets the real 410 (test_apiserver relies on it);
            # every other resource is cached as in a cluster.
            "--watch-cache-sizes=configmaps#0",
            "--v=1",
            *self.apiserver_args,
        ], log_path=self.logs_dir / "kube-apiserver.log")
        self.apiserver = apiserver
        self.apiserver_started = datetime.now(UTC)
        await self._start(apiserver)
        await self._apiserver_ready(timeout=180)

        kcm_kubeconfig = self.kubeconfig_for("kcm")
        kcm = Supervised("kube-controller-manager", [
            str(kcm_bin), f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}", f"--authorization-kubeconfig={kcm_kubeconfig}",
            f"--controllers={KCM_CONTROLLERS}",
            "--use-service-account-credentials=true",
            f"--root-ca-file={pki.ca_cert}",
            f"--service-account-private-key-file={pki.sa_key}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            "--concurrent-service-endpoint-syncs=5",
            # The EndpointSlice controller batches updates for this long; 0 publishes at once.
            "--endpointslice-updates-batch-period=0s",
            "--v=1",
        ], log_path=self.logs_dir / "kube-controller-manager.log")
        await self._start(kcm)

    async def _apiserver_ready(self, *, timeout: float) -> None:
        assert self.apiserver is not None and self.pki is not None
        admin = self.identities["admin"]
        async with httpx.AsyncClient(timeout=5.0, verify=ssl.create_default_context(cafile=str(self.pki.ca_cert)),
                                     headers={"Authorization": f"Bearer {admin.token}"}) as http:
            async def api_ok() -> bool:
                return (await http.get(f"{self.url}/readyz")).status_code == 200
            await self.apiserver.wait_ready(api_ok, timeout=timeout)

    async def restart_apiserver(self, *, while_down: Callable[[], Awaitable[object]] | None = None,
                                timeout: float = 180) -> None:
        """Stop the API server (SIGTERM: it closes every connection, watches included), await
        ``while_down`` if given, and start it again with the same flags on the same port, also when
        ``while_down`` raised; returns once it answers /readyz."""
        assert self.apiserver is not None, "control plane not started"
        stopped = datetime.now(UTC)
        self.apiserver_restarts.append((stopped, None))
        await self.apiserver.stop()
        try:
            if while_down is not None:
                await while_down()
        finally:
            self.apiserver_started = datetime.now(UTC)
            await self.apiserver.start()
            await self._apiserver_ready(timeout=timeout)
            self.apiserver_restarts[-1] = (stopped, datetime.now(UTC))

    def apiserver_restarted_within(self, start: datetime, end: datetime) -> bool:
        """Whether the API server was down (by restart_apiserver) at some time from ``start`` to ``end``."""
        return any(down <= end and (up is None or up >= start) for down, up in self.apiserver_restarts)

    async def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision, as the API server does every
        5 minutes; watches from an older resourceVersion then get 410 Gone. Returns the revision."""
        async with httpx.AsyncClient(base_url=self.etcd_url, timeout=10.0) as http:
            r = await http.post("/v3/kv/range", json={"key": "AA==", "limit": 1})  # any key: we want the header
            r.raise_for_status()
            rev = int(r.json()["header"]["revision"])
            r = await http.post("/v3/kv/compaction", json={"revision": rev, "physical": True})
            r.raise_for_status()
        return rev

    async def _start(self, proc: Supervised) -> None:
        self.procs.append(proc)
        await proc.start()

    def failed_processes(self) -> list[str]:
        return [f"{p.name} exited; log {p.log_path}:\n{p.tail()}" for p in self.procs if not p.alive()]

    async def stop(self) -> None:
        for proc in reversed(self.procs):
            await proc.stop()
        self.procs.clear()
