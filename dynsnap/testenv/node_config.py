"""The real node's files: where each lives under the run's directory, and what its containerd,
kubelet and CNI configurations say (rendered from plain values; no processes here).

Layer: ``dynsnap.testenv`` (test harness only; ``node.py`` writes these and starts the parts).
Every setting says why it is what it is: this node runs on a shared machine with cgroup v1
(hybrid), no systemd, no AppArmor and no registry, beside other engineers' test sessions, and it
must leave the machine as it found it.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

# containerd's plugins that have nothing to do here: snapshotters for file systems this machine
# lacks, tracing exporters; "opt" would create /opt/containerd on the host (its path is set below
# anyway, in case another plugin asks for it).
_DISABLED_PLUGINS = (
    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
)

# The host values kubelet insists on (container_manager_linux.go setupKernelTunables): with
# protectKernelDefaults it refuses to start unless it reads them; without, it writes them host-wide
# (panic_on_oops=1 would turn any kernel oops of anyone's test into a dead machine). kubelet runs
# in a mount namespace where these files are its own copies holding these values.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
POD_PIDS_LIMIT = 4096  # kubelet's podPidsLimit (pids.max of every pod's cgroup)
# kubelet's fixed host paths, each replaced in its mount namespace by a directory of the run.
KUBELET_HOST_DIRS = ("/var/lib/kubelet", "/var/log/containers")


@dataclass(frozen=True)
class NodeLayout:
    """Every path of one real node, all under ``root`` (inside the run's directory), but containerd's
    root when ``image_store`` names one that outlives the node (node.py's image store)."""

    root: Path
    image_store: Path | None = None

    @property
    def containerd_root(self) -> Path:
        """containerd's root: its metadata, content and unpacked snapshots (the node's images)."""
        return self.image_store or self.root / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd" / "state"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd" / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd" / "config.toml"

    @property
    def runc_root(self) -> Path:
        return self.root / "containerd" / "runc"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_bin_dir(self) -> Path:
        """Debian's plugins (links) and the node's own (stub_kube_proxy): containerd 1.6 takes one directory."""
        return self.root / "cni" / "bin"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet-config.yaml"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.root / "kubelet.kubeconfig"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def shadow(self) -> Path:
        """What kubelet's mount namespace puts over host paths (KUBELET_SYSCTLS, KUBELET_HOST_DIRS)."""
        return self.root / "host-shadow"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def dirs(self) -> list[Path]:
        return [self.containerd_root, self.containerd_state, self.runc_root, self.cni_conf_dir, self.cni_bin_dir,
                self.cni_ipam_dir,
                self.kubelet_root, self.pki, self.pod_logs, self.shadow, self.logs, self.root / "opt",
                self.root / "volume-plugins"]


def _q(value: str | Path) -> str:
    """A TOML basic string (JSON's escaping is TOML's for these ASCII paths and names)."""
    return json.dumps(str(value))


def containerd_toml(layout: NodeLayout, *, pause_ref: str, runc: Path) -> str:
    """containerd 1.6's config (version 2): everything under the run, CRI with runc on cgroupfs."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join([
        "version = 2",
        f"root = {_q(layout.containerd_root)}",
        f"state = {_q(layout.containerd_state)}",
        f"disabled_plugins = [{', '.join(_q(p) for p in _DISABLED_PLUGINS)}]",
        "[grpc]",
        f"  address = {_q(layout.containerd_socket)}",
        "[debug]",
        '  level = "info"',
        '[plugins."io.containerd.internal.v1.opt"]',
        f"  path = {_q(layout.root / 'opt')}",
        f"[{cri}]",
        # Pre-imported, never pulled (node.py imports it before kubelet starts).
        f"  sandbox_image = {_q(pause_ref)}",
        # exec/attach/port-forward streams: loopback only (kubelet proxies them).
        '  stream_server_address = "127.0.0.1"',
        '  stream_server_port = "0"',
        # This machine withholds CAP_SYS_RESOURCE (even from root): no process may lower its
        # oom_score_adj, so runc fails to start the sandbox with the CRI's -998 ("can't get final
        # child's PID from pipe"). Restricted, no container's goes below containerd's own (0).
        "  restrict_oom_score_adj = true",
        # No AppArmor on this machine; SELinux neither.
        "  disable_apparmor = true",
        "  enable_selinux = false",
        # Pod network namespaces under the run's state directory, not /var/run/netns: the run's
        # teardown finds every one of them there.
        "  netns_mounts_under_state_dir = true",
        f"  [{cri}.containerd]",
        '    snapshotter = "overlayfs"',
        '    default_runtime_name = "runc"',
        f"    [{cri}.containerd.runtimes.runc]",
        '      runtime_type = "io.containerd.runc.v2"',
        f"      [{cri}.containerd.runtimes.runc.options]",
        # cgroupfs: no systemd here (kubelet's cgroupDriver must say the same).
        "        SystemdCgroup = false",
        f"        BinaryName = {_q(runc)}",
        # runc's own state (--root) under the run too, not /run/containerd/runc.
        f"        Root = {_q(layout.runc_root)}",
        f"  [{cri}.cni]",
        f"    bin_dir = {_q(layout.cni_bin_dir)}",
        f"    conf_dir = {_q(layout.cni_conf_dir)}",
        "    max_conf_num = 1",
        "",
    ])


def pod_ip_range(pod_cidr: str) -> tuple[str, str]:
    """The first and last pod IPs of a node's podCIDR (its network and broadcast addresses excluded)."""
    net = ipaddress.IPv4Network(pod_cidr)
    hosts = list(net.hosts())
    return str(hosts[0]), str(hosts[-1])


def cni_conflist(*, name: str, bridge: str, network: str, gateway: str, pod_cidr: str, ipam_dir: Path,
                 kube_proxy: Obj | None = None) -> Obj:
    """The pod network: veths on the run's bridge, pod IPs from ``pod_cidr`` with the run's whole
    ``network`` as their subnet (so pods reach the bridge's gateway address, where the API server
    listens, on the link), default route via that gateway; then ``kube_proxy`` (stub_kube_proxy's
    entry: the ``kubernetes`` Service's cluster IP rewritten to the API server in each pod's namespace).

    ``isGateway`` is off: the bridge already carries the gateway address (SandboxNetwork), and the
    plugin would otherwise also turn on IPv4 forwarding host-wide, routing pod packets off this
    machine. No ipMasq: nothing leaves. host-local's allocations live under the run.
    """
    if not ipaddress.IPv4Network(pod_cidr).subnet_of(ipaddress.IPv4Network(network)):
        raise ValueError(f"pod CIDR {pod_cidr} is not inside the run's network {network}")
    first, last = pod_ip_range(pod_cidr)
    return {
        "cniVersion": "1.0.0",
        "name": name,
        "plugins": [{
            "type": "bridge", "bridge": bridge, "isGateway": False, "isDefaultGateway": False, "ipMasq": False,
            "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                     "ranges": [[{"subnet": network, "rangeStart": first, "rangeEnd": last, "gateway": gateway}]],
                     "routes": [{"dst": "0.0.0.0/0"}]},
        }, *([kube_proxy] if kube_proxy else [])],
    }


@dataclass(frozen=True)
class KubeletSettings:
    node_ip: str
    port: int
    healthz_port: int
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    cgroup_root: str
    containerd_socket: Path


def kubelet_configuration(layout: NodeLayout, s: KubeletSettings) -> Obj:
    """kubelet's KubeletConfiguration (v1beta1)."""
    endpoint = f"unix://{s.containerd_socket}"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # Its API only on the run's bridge (the node's InternalIP, where the API server reaches it).
        "address": s.node_ip, "port": s.port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": s.healthz_port,
        "tlsCertFile": str(s.serving_cert), "tlsPrivateKeyFile": str(s.serving_key),
        "rotateCertificates": False, "serverTLSBootstrap": False,
        # As a real node: no anonymous requests; client certificates of the CA (the API server's
        # kubelet-client) and bearer tokens (TokenReview), each authorized by SubjectAccessReview.
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(s.ca_cert)}},
        "authorization": {"mode": "Webhook"},
        # cgroup v1 (hybrid), no systemd. Pods' cgroups under a root of the run's own, so that
        # nothing of another session's (or the sandboxes' dynsnap-test/) is touched.
        "cgroupDriver": "cgroupfs", "cgroupRoot": s.cgroup_root, "cgroupsPerQOS": True, "failCgroupV1": False,
        "failSwapOn": False,
        "protectKernelDefaults": True,  # read, never write, the host's sysctls (KUBELET_SYSCTLS)
        # As a cluster sets it: every container not privileged runs under the runtime's default seccomp
        # profile (containerd 1.6's) unless its pod asks otherwise.
        "seccompDefault": True,
        # No pod may fork the shared machine to death; a worker's tree is far below it (and the pids a
        # restore brings back count against it as the dumped ones did).
        "podPidsLimit": POD_PIDS_LIMIT,
        "containerRuntimeEndpoint": endpoint, "imageServiceEndpoint": endpoint,
        "podLogsDir": str(layout.pod_logs), "volumePluginDir": str(layout.root / "volume-plugins"),
        # No cluster DNS and no nameserver: a lookup in a pod fails at once instead of reaching
        # the host's resolver (the sandboxes do the same).
        "resolvConf": str(layout.root / "resolv.conf"), "clusterDomain": "cluster.local",
        # The machine is shared: its memory and disk pressure is other sessions', not this node's to
        # reclaim by evicting test pods. "0%" switches a threshold off.
        "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "nodefs.inodesFree": "0%",
                         "imagefs.available": "0%", "imagefs.inodesFree": "0%"},
        # Image GC off (100): the pre-imported images cannot be pulled again.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "registerNode": True,
        "shutdownGracePeriod": "0s",  # graceful node shutdown needs systemd-logind
    }


def kubeconfig(*, server: str, ca_cert: Path, cert: Path, key: Path, user: str) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "node",
        "clusters": [{"name": "testenv", "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "node", "context": {"cluster": "testenv", "user": user}}],
    }


# kubelet's mount namespace: private copies over the host paths it would write (its argv follows:
# "$1" the shadow directory, then kubelet's own). The root mount is made private first (nothing
# mounted here reaches the host); kubelet's root directory is a shared mount made before (node.py),
# so the volumes kubelet mounts there still reach containerd and runc in the host's namespace.
KUBELET_NS_SCRIPT = """set -eu
shadow="$1"; shift
mount --make-private /
mount --make-rprivate /proc
for f in "$shadow"/sysctl/*; do
  target="/proc/sys/$(basename "$f" | tr . /)"
  mount --bind "$f" "$target"
  mount -o remount,bind,ro "$target"
done
mount --bind "$shadow/var-lib-kubelet" /var/lib/kubelet
mount --bind "$shadow/var-log-containers" /var/log/containers
exec "$@"
"""
