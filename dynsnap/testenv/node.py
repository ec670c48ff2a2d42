"""A real Kubernetes node of the local environment: containerd + runc + the CNI plugins + kubelet.

Layer: ``dynsnap.testenv`` (test harness only; never imported by the product).

:class:`RealNode` runs, for one test session, the parts hack/lib-node.sh installs: containerd
(its own config, root, state and socket under the node's directory; runc on cgroupfs; pod network
namespaces under its state directory) and kubelet (a KubeletConfiguration and a kubeconfig with a
client certificate for ``system:node:<name>`` in ``system:nodes``, and a serving certificate, both
signed by the environment's CA), registered as a real Node of the local API server. Pods get IPs
from the node's podCIDR (a /24 of the run's network) on the run's own bridge, where the API
server listens at the gateway, and the kubelet's API is served at that gateway address only. The
``kubernetes`` Service's address that kubelet gives every container reaches the API server through
stub_kube_proxy (the stand-in for kube-proxy, a CNI plugin chained after the bridge).
Images come from OCI layouts imported into containerd's ``k8s.io`` namespace (:meth:`import_image`);
nothing is ever pulled (containerd's only proxy is a dead loopback port). With ``image_stores`` (each a
directory that outlives the node: chart_node passes one in the local cache), containerd's root is
kept there, as a real node keeps its images across restarts of its runtime: an image imported again
unchanged costs containerd only its digests, not an unpack of every file (:func:`image_stores`). One
node at a time holds a store (a lock beside it): a node takes the first of its stores that is free
(``./run test`` runs two sessions side by side, each with a node), and keeps its own root when none is.

The control plane runs neither node IPAM nor node lifecycle (controlplane.py), so the Node is
created here, with its podCIDR, before kubelet registers it (kubelet adopts it). ``stop`` deletes
the node's pods through kubelet, stops kubelet and containerd, and then takes whatever is left off
the host (``node_cleanup``); ``leftovers`` says what, if anything, remains. Needs root.

    node = RealNode(name="node-real-0", root=workdir / "nodes" / "node-real-0", cp=cluster.cp,
                    net=cluster.net, api=cluster.api, pod_cidr=real_node_cidr(cluster.net))
    await node.start()            # returns once the Node is Ready
    ref = await node.import_image(Path(os.environ["DYNSNAP_IMAGES"]) / "dynsnap-entrypoint")
    ...                           # pods with spec.nodeName=node.name, imagePullPolicy Never
    await node.stop(); assert not await node.leftovers()
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from dynsnap.k8s.client import Kube
from dynsnap.k8s.errors import Conflict, NotFound
from dynsnap.models import resources as R
from dynsnap.runtime.command import find_tool, run_command
from dynsnap.testenv import node_cleanup as clean
from dynsnap.testenv import node_config as conf
from dynsnap.testenv import stub_kube_proxy
from dynsnap.testenv.controlplane import ControlPlane, free_port
from dynsnap.testenv.netns import SandboxNetwork
from dynsnap.testenv.pki import KUBELET_CLIENT_USER, issue_cert
from dynsnap.testenv.process import MissingBinary, Supervised, require_binary

REAL_NODE_LABEL = "dynsnap.io/real-node"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SUN_PATH_MAX = 108  # sockaddr_un.sun_path, the NUL included
# What containerd would pull through: nothing listens there, so a pull fails at once, on loopback.
_DEAD_PROXY = "http://127.0.0.1:9"


@dataclass(frozen=True)
class NodeBinaries:
    """The node's parts, as hack/lib-node.sh exports them."""

    kubelet: Path
    containerd: Path
    ctr: Path
    runc: Path
    cni_bin: Path
    pause_image: Path  # the pause image's OCI layout
    pause_ref: str

    @classmethod
    def from_env(cls) -> NodeBinaries:
        env = os.environ.get
        cni = Path(env("DYNSNAP_CNI_BIN", "/usr/lib/cni"))
        for plugin in ("bridge", "host-local", "loopback"):
            require_binary(cni / plugin, f"CNI plugin {plugin}", "DYNSNAP_CNI_BIN")
        pause = Path(env("DYNSNAP_PAUSE_IMAGE", ""))
        if not env("DYNSNAP_PAUSE_IMAGE") or not (pause / "index.json").is_file() or not env("DYNSNAP_PAUSE_REF"):
            raise MissingBinary("pause image: $DYNSNAP_PAUSE_IMAGE / $DYNSNAP_PAUSE_REF are not set or not an OCI "
                                "layout; run `./run setup` (hack/lib-node.sh builds and exports them)")
        return cls(
            kubelet=require_binary(env("DYNSNAP_KUBELET"), "kubelet", "DYNSNAP_KUBELET"),
            containerd=require_binary(env("DYNSNAP_CONTAINERD", "/usr/bin/containerd"), "containerd",
                                      "DYNSNAP_CONTAINERD"),
            ctr=require_binary(env("DYNSNAP_CTR", "/usr/bin/ctr"), "ctr", "DYNSNAP_CTR"),
            runc=require_binary(env("DYNSNAP_RUNC", "/usr/sbin/runc"), "runc", "DYNSNAP_RUNC"),
            cni_bin=cni, pause_image=pause, pause_ref=str(env("DYNSNAP_PAUSE_REF")),
        )


def real_node_cidr(net: SandboxNetwork, index: int = 0) -> str:
    """The podCIDR of real node ``index``: a /24 of the run's network far above the fake nodes'
    (cluster.node_addresses hands out its first /24s)."""
    subnets = list(net.network.subnets(new_prefix=24))
    if 200 + index >= len(subnets):
        raise ValueError(f"the run's network {net.network} has no /24 for real node {index}")
    return str(subnets[200 + index])


IMAGE_STORES = 2  # the real nodes of this machine that keep their images at once (./run test's two lanes)


def image_stores() -> tuple[Path, ...]:
    """The image stores the machine's real nodes share, each held by one node at a time: in the local
    cache (``$DYNSNAP_CACHE``, as ``./run setup`` sets it), so they also outlive the session."""
    cache = Path(os.environ.get("DYNSNAP_CACHE") or os.path.expanduser("~/.cache/dynsnap"))
    return tuple(cache / ("node-image-store" + (f"-{i}" if i else "")) for i in range(IMAGE_STORES))


def hold_store(store: Path) -> int | None:
    """The image store locked for one node: the descriptor of ``<store>.lock`` holding an exclusive
    flock (closing it, or the process's exit, releases it); None when another node holds it."""
    store.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{store}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def image_ref(name: str) -> str:
    """The name containerd's CRI looks an image up by: Docker's normalisation of what a pod says
    (``dynsnap-entrypoint:0.1.0`` -> ``docker.io/library/dynsnap-entrypoint:0.1.0``)."""
    first, sep, _ = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if sep else f"docker.io/library/{name}"


class RealNode:
    """One kubelet + containerd node. Create, :meth:`start`, and always :meth:`stop`."""

    def __init__(self, *, name: str, root: Path, cp: ControlPlane, net: SandboxNetwork, api: Kube, pod_cidr: str,
                 bins: NodeBinaries | None = None, image_stores: tuple[Path, ...] = ()) -> None:
        if not _DNS_LABEL.fullmatch(name):
            raise ValueError(f"node name {name!r} is not a DNS label (a-z, 0-9, '-', at most 63): it names the "
                             "Node, its certificates and its cgroup root")
        self.name = name
        self.layout = conf.NodeLayout(root)
        if len(str(self.layout.containerd_socket).encode()) >= _SUN_PATH_MAX:
            raise ValueError(f"{self.layout.containerd_socket}: too long for a unix socket path "
                             f"({_SUN_PATH_MAX - 1} bytes at most); give the node a shorter directory")
        self.cp = cp
        self.net = net
        self.api = api
        self.pod_cidr = pod_cidr
        self.bins = bins
        self.node_ip = net.gateway  # the host's address on the run's bridge
        self.cgroup_root = f"/dynsnap-{net.bridge}-{name}"
        self.network = f"dynsnap-{net.bridge}-{name}"
        self.kubelet_port = self.healthz_port = 0
        self.kube_proxy: dict[str, object] | None = None  # stub_kube_proxy's conflist entry (_register)
        self.containerd: Supervised | None = None
        self.kubelet: Supervised | None = None
        self.image_stores = image_stores
        self._store_lock: int | None = None  # the open, flock'ed lock file while this node holds a store

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        bins = self.bins = self.bins or NodeBinaries.from_env()
        await self._sweep_stale()
        for store in self.image_stores:  # the first free one; none free: containerd's root under the node's
            if (lock := hold_store(store)) is not None:
                self._store_lock = lock
                self.layout = conf.NodeLayout(self.layout.root, store)
                break
        for d in self.layout.dirs():
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._make_cgroup_root()
        self._write_credentials()
        await self._register()
        self._write_configs(bins)
        self.containerd = Supervised(f"containerd-{self.name}", [
            str(bins.containerd), "--config", str(self.layout.containerd_config)],
            log_path=self.layout.logs / "containerd.log",
            env={"PATH": "/usr/bin", "HTTPS_PROXY": _DEAD_PROXY, "HTTP_PROXY": _DEAD_PROXY, "NO_PROXY": ""})
        await self.containerd.start()
        await self.containerd.wait_ready(self._containerd_ok, timeout=60, what="serving its socket")
        await self.import_image(bins.pause_image, bins.pause_ref)
        await self._share_kubelet_root()
        self.kubelet = Supervised(f"kubelet-{self.name}", self._kubelet_argv(bins),
                                  log_path=self.layout.logs / "kubelet.log",
                                  # No sbin on its PATH: the iptables that Debian's CNI plugins pull in
                                  # stays out of reach, so kubelet adds no rules to the host's tables.
                                  env={"PATH": "/usr/local/bin:/usr/bin", "HOME": "/root"})
        await self.kubelet.start()
        await self.kubelet.wait_ready(self.ready, timeout=180, what="Ready (its Node's condition)")

    def _make_cgroup_root(self) -> None:
        """kubelet requires its cgroupRoot to exist in every hierarchy; cpuset's must hold CPUs and
        memory nodes before anything can join a child of it."""
        rel = self.cgroup_root.strip("/")
        for h in sorted(clean.CGROUP_FS.iterdir()):
            if (h / "cgroup.procs").exists():
                (h / rel).mkdir(exist_ok=True)
        cpuset = clean.CGROUP_FS / "cpuset"
        for f in ("cpuset.cpus", "cpuset.mems"):
            if (cpuset / f).exists():
                (cpuset / rel / f).write_text((cpuset / f).read_text())

    def _write_credentials(self) -> None:
        assert self.cp.pki is not None, "control plane not started"
        pki, d, user = self.cp.pki, self.layout.pki, f"system:node:{self.name}"
        issue_cert(pki, d / "kubelet-client.crt", d / "kubelet-client.key", cn=user, orgs=("system:nodes",),
                   client=True)
        issue_cert(pki, d / "kubelet.crt", d / "kubelet.key", cn=user, orgs=("system:nodes",),
                   ips=(self.node_ip,), dns=(self.name,), server=True)
        cfg = conf.kubeconfig(server=self.cp.url, ca_cert=pki.ca_cert, cert=d / "kubelet-client.crt",
                         key=d / "kubelet-client.key", user=user)
        self.layout.kubelet_kubeconfig.write_text(yaml.safe_dump(cfg))
        self.layout.kubelet_kubeconfig.chmod(0o600)

    def _write_configs(self, bins: NodeBinaries) -> None:
        lay = self.layout
        assert self.cp.pki is not None
        lay.containerd_config.write_text(conf.containerd_toml(lay, pause_ref=bins.pause_ref, runc=bins.runc))
        for plugin in ("bridge", "host-local", "loopback"):  # Debian's, by link; then the node's own
            (lay.cni_bin_dir / plugin).unlink(missing_ok=True)
            (lay.cni_bin_dir / plugin).symlink_to(bins.cni_bin / plugin)
        stub_kube_proxy.install(lay.cni_bin_dir)
        cni = conf.cni_conflist(name=self.network, bridge=self.net.bridge, network=str(self.net.network),
                            gateway=self.net.gateway, pod_cidr=self.pod_cidr, ipam_dir=lay.cni_ipam_dir,
                            kube_proxy=self.kube_proxy)
        (lay.cni_conf_dir / "10-dynsnap.conflist").write_text(json.dumps(cni, indent=1) + "\n")
        self.kubelet_port, self.healthz_port = free_port(self.node_ip), free_port()
        settings = conf.KubeletSettings(
            node_ip=self.node_ip, port=self.kubelet_port, healthz_port=self.healthz_port, ca_cert=self.cp.pki.ca_cert,
            serving_cert=lay.pki / "kubelet.crt", serving_key=lay.pki / "kubelet.key", cgroup_root=self.cgroup_root,
            containerd_socket=lay.containerd_socket)
        lay.kubelet_config.write_text(yaml.safe_dump(conf.kubelet_configuration(lay, settings)))
        (lay.root / "resolv.conf").write_text("# dynsnap real node: no DNS\noptions timeout:1 attempts:1\n")
        (lay.shadow / "sysctl").mkdir(exist_ok=True)
        for key, value in conf.KUBELET_SYSCTLS.items():
            (lay.shadow / "sysctl" / key.replace("/", ".")).write_text(value + "\n")
        for host_dir in conf.KUBELET_HOST_DIRS:
            # The mount points themselves (setup makes them too): empty directories of the node's layout.
            Path(host_dir).mkdir(parents=True, exist_ok=True)
            (lay.shadow / host_dir.strip("/").replace("/", "-")).mkdir(exist_ok=True)

    async def _register(self) -> None:
        """The API server's kubelet-client may use every kubelet's API (logs, exec), as kubeadm
        binds it; the Node exists, with its podCIDR, before its kubelet registers."""
        await self.api.apply(R.CLUSTER_ROLE_BINDINGS, {
            "metadata": {"name": "testenv:apiserver-kubelet-client"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:kubelet-api-admin"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": KUBELET_CLIENT_USER}],
        })
        try:
            await self.api.create(R.NODES, {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": {REAL_NODE_LABEL: "true",
                                                           "kubernetes.io/hostname": self.name}},
                "spec": {"podCIDR": self.pod_cidr, "podCIDRs": [self.pod_cidr]},
            })
        except Conflict:
            raise RuntimeError(f"a Node named {self.name} exists already in this cluster: another node's, or one "
                               "a stopped node did not delete; nothing was started") from None
        # The API server's Service, as kubelet tells every container (stub_kube_proxy stands in for kube-proxy).
        svc = await self.api.get(R.SERVICES, "kubernetes", namespace="default")
        self.kube_proxy = stub_kube_proxy.plugin_config(
            cluster_ip=svc["spec"]["clusterIP"], port=int(svc["spec"]["ports"][0]["port"]),
            endpoint=urlsplit(self.cp.url).netloc, iptables=find_tool("iptables"),
            nsenter=find_tool("nsenter"))

    async def _share_kubelet_root(self) -> None:
        """kubelet's root as a shared mount of its own, made in the host's namespace: the volumes
        kubelet mounts there (from its own mount namespace) propagate to the host, where runc
        bind-mounts them into containers."""
        mount, root = find_tool("mount"), str(self.layout.kubelet_root)
        await run_command([mount, "--bind", root, root], timeout=10)
        await run_command([mount, "--make-shared", root], timeout=10)

    def _kubelet_argv(self, bins: NodeBinaries) -> list[str]:
        lay = self.layout
        return [find_tool("unshare"), "--mount", "--propagation", "unchanged", "--",
                "/bin/sh", "-c", conf.KUBELET_NS_SCRIPT, "kubelet-mount-ns", str(lay.shadow),
                str(bins.kubelet), f"--config={lay.kubelet_config}", f"--kubeconfig={lay.kubelet_kubeconfig}",
                f"--root-dir={lay.kubelet_root}", f"--cert-dir={lay.pki}", f"--hostname-override={self.name}",
                # status_manager at 3: each status patch kubelet sends, so a pod whose status lags its
                # probes (chart_node.KUBELET_STUCK_AFTER) can be read in the log
                f"--node-ip={self.node_ip}", "--v=2", "--vmodule=status_manager=3"]

    def ctr_argv(self, *args: str) -> list[str]:
        """``ctr`` against this node's containerd, in the CRI's namespace."""
        assert self.bins is not None
        return [str(self.bins.ctr), "--address", str(self.layout.containerd_socket), "--namespace", "k8s.io", *args]

    async def _containerd_ok(self) -> bool:
        return (await run_command(self.ctr_argv("version"), timeout=5, check=False)).returncode == 0

    async def ready(self) -> bool:
        conds = (await self.api.get(R.NODES, self.name)).get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    # -- images --------------------------------------------------------------------------------

    async def import_image(self, layout: Path, ref: str | None = None, *, timeout: float = 300) -> str:
        """Import an OCI image layout (hack/oci_image.py's) into containerd's ``k8s.io`` namespace
        under ``ref`` (default: the layout's own name, normalised as the CRI looks it up), unpacked
        for the CRI's snapshotter; returns the name. Pods then use it with imagePullPolicy Never."""
        index = json.loads((layout / "index.json").read_text())
        manifests = index.get("manifests") or []
        if len(manifests) != 1:
            raise ValueError(f"{layout}: an image layout with one manifest expected, found {len(manifests)}")
        name = ref or image_ref(manifests[0].get("annotations", {}).get("io.containerd.image.name", ""))
        manifests[0].setdefault("annotations", {})["io.containerd.image.name"] = name
        archive = self.layout.root / f"import-{os.getpid()}-{layout.name}.tar"  # imports may run side by side
        await asyncio.to_thread(_write_archive, layout, index, archive)
        try:
            await run_command(self.ctr_argv("images", "import", str(archive)), timeout=timeout)
        finally:
            archive.unlink(missing_ok=True)
        listed = (await run_command(self.ctr_argv("images", "ls", "-q"), timeout=30)).stdout.split()
        if name not in listed:
            raise RuntimeError(f"containerd lists no image {name} after importing {layout} (it has: {listed})")
        return name

    def _release_store(self) -> None:
        if self._store_lock is not None:
            os.close(self._store_lock)  # closing the descriptor drops its flock
            self._store_lock = None

    # -- stop ----------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Everything of the node off the host, also when it never fully started; bounded."""
        for step in (self._delete_pods, self._stop_kubelet, self._remove_containers, self._stop_containerd,
                     self._sweep, self._delete_node):
            with contextlib.suppress(Exception):  # each step cleans what it can; leftovers() tells
                await step()
        self._release_store()  # containerd has stopped (or was killed by the sweep): the store is free
        if not clean.mounts_under(self.layout.root):
            # The bulk (image snapshots, state); configs and logs stay for the session's log copy.
            for d in (self.layout.root / "containerd", self.layout.kubelet_root, self.layout.pod_logs):
                shutil.rmtree(d, ignore_errors=True)

    async def _delete_pods(self, timeout: float = 60) -> None:
        """Pods bound here, deleted through kubelet (it stops their containers and sandboxes and
        confirms); force-deleted when kubelet is not running."""
        live = self.kubelet is not None and self.kubelet.alive()
        pods = (await self.api.list(R.PODS, field_selector=f"spec.nodeName={self.name}"))["items"]
        for pod in pods:
            meta = pod["metadata"]
            with contextlib.suppress(NotFound):
                await self.api.delete(R.PODS, meta["name"], namespace=meta["namespace"],
                                      grace_period_seconds=1 if live else 0)
        deadline = asyncio.get_running_loop().time() + timeout
        while live and pods and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
            pods = (await self.api.list(R.PODS, field_selector=f"spec.nodeName={self.name}"))["items"]
        for pod in pods:  # kubelet did not confirm in time: the rest of stop() takes them down
            meta = pod["metadata"]
            with contextlib.suppress(NotFound):
                await self.api.delete(R.PODS, meta["name"], namespace=meta["namespace"], grace_period_seconds=0)

    async def _stop_kubelet(self) -> None:
        if self.kubelet is not None:
            await self.kubelet.stop()

    async def _remove_containers(self) -> None:
        """Whatever kubelet did not remove: killed and deleted through containerd."""
        if self.containerd is None or not self.containerd.alive():
            return
        tasks = (await run_command(self.ctr_argv("tasks", "ls", "-q"), timeout=30)).stdout.split()
        for t in tasks:
            await run_command(self.ctr_argv("tasks", "kill", "-s", "SIGKILL", t), timeout=30, check=False)
        for t in tasks:
            await run_command(self.ctr_argv("tasks", "delete", "-f", t), timeout=30, check=False)
        for c in (await run_command(self.ctr_argv("containers", "ls", "-q"), timeout=30)).stdout.split():
            await run_command(self.ctr_argv("containers", "delete", c), timeout=30, check=False)

    async def _stop_containerd(self) -> None:
        if self.containerd is not None:
            await self.containerd.stop()

    async def _sweep(self) -> None:
        """Host state of the node that no process removed: processes (shims, containers), mounts
        (the pods' network namespaces among them: their veths go with them), cgroups, CNI's cache."""
        await clean.kill_and_wait(clean.pids_mentioning(f"{self.layout.root}/") | clean.cgroup_pids(self.cgroup_root))
        await clean.unmount_all(self.layout.root)
        await clean.remove_cgroup_tree(self.cgroup_root)
        clean.remove_cni_cache(self.network)
        clean.remove_shim_socket_dir()

    async def _sweep_stale(self) -> None:
        """Before starting: what a crashed run of the same bridge and node name left. Its network
        namespaces were under another run's directory, so their veths are removed from the bridge
        here (one real node per bridge: any CNI veth on it is a leftover now)."""
        await self._sweep()
        await clean.remove_veths(self.net.bridge)

    async def _delete_node(self) -> None:
        with contextlib.suppress(NotFound):
            await self.api.delete(R.NODES, self.name)

    async def leftovers(self) -> list[str]:
        """What of this node is still on the host; empty after :meth:`stop`."""
        return await clean.leftovers(root=self.layout.root, cgroup_root=self.cgroup_root, network=self.network,
                                     bridge=self.net.bridge)

    def failed(self) -> list[str]:
        return [f"{p.name} exited; log {p.log_path}:\n{p.tail()}" for p in (self.containerd, self.kubelet)
                if p is not None and p.proc is not None and not p.alive()]


def _write_archive(layout: Path, index: dict[str, object], archive: Path) -> None:
    """The layout as the archive ``ctr images import`` reads, with ``index`` as its index.json."""
    data = (json.dumps(index, indent=1) + "\n").encode()
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(layout.rglob("*")):
            rel = entry.relative_to(layout)
            if rel.as_posix() != "index.json":
                tar.add(entry, arcname=rel.as_posix(), recursive=False)
        info = tarfile.TarInfo("index.json")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
