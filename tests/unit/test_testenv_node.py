"""The real node's pure parts (dynsnap.testenv.node_config, node.py's helpers, pki.issue_cert):
the configuration files say what the node needs on this machine, bad input is refused before
anything starts. tests/integration/test_real_node.py runs them for real."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dynsnap.testenv.netns import SandboxNetwork
from dynsnap.testenv.node import RealNode, hold_store, image_ref, image_stores, real_node_cidr
from dynsnap.testenv.node_config import (
    KUBELET_NS_SCRIPT,
    POD_PIDS_LIMIT,
    KubeletSettings,
    NodeLayout,
    cni_conflist,
    containerd_toml,
    kubelet_configuration,
)
from dynsnap.testenv.pki import issue_cert, make_pki
from dynsnap.testenv.stub_kube_proxy import PLUGIN, install, plugin_config


@pytest.mark.parametrize(("name", "ref"), [
    ("dynsnap-entrypoint:0.1.0", "docker.io/library/dynsnap-entrypoint:0.1.0"),
    ("ml/dynsnap-agent:1", "docker.io/ml/dynsnap-agent:1"),
    ("localhost/dynsnap-pause:abc", "localhost/dynsnap-pause:abc"),
    ("registry.example.com/ml/dynsnap-agent:1", "registry.example.com/ml/dynsnap-agent:1"),
    ("127.0.0.1:5000/x:1", "127.0.0.1:5000/x:1"),
])
def test_image_ref_is_the_name_the_cri_looks_up(name: str, ref: str) -> None:
    assert image_ref(name) == ref


def test_real_node_cidr_is_a_slash24_of_the_run_far_from_the_fake_nodes() -> None:
    net = SandboxNetwork(bridge="dsnunit0", cidr="10.225.0.0/16")
    assert real_node_cidr(net) == "10.225.200.0/24"
    assert real_node_cidr(net, 1) == "10.225.201.0/24"
    with pytest.raises(ValueError, match="no /24"):
        real_node_cidr(SandboxNetwork(bridge="dsnunit0", cidr="10.225.0.0/24"))


def test_cni_conflist_gives_pod_ips_of_the_node_on_the_runs_subnet(tmp_path: Path) -> None:
    conf = cni_conflist(name="n", bridge="dsnunit0", network="10.225.0.0/16", gateway="10.225.0.1",
                        pod_cidr="10.225.200.0/24", ipam_dir=tmp_path)
    (bridge,) = conf["plugins"]
    # No gateway address, forwarding or NAT made by the plugin: nothing routed off the machine.
    assert bridge["isGateway"] is False and bridge["ipMasq"] is False
    (rng,) = bridge["ipam"]["ranges"][0]
    assert rng == {"subnet": "10.225.0.0/16", "rangeStart": "10.225.200.1", "rangeEnd": "10.225.200.254",
                   "gateway": "10.225.0.1"}
    assert bridge["ipam"]["dataDir"] == str(tmp_path)
    # stub_kube_proxy's entry is chained after the bridge when given.
    proxy = plugin_config(cluster_ip="10.96.0.1", port=443, endpoint="10.225.0.1:6443", iptables="/usr/sbin/iptables",
                          nsenter="/usr/bin/nsenter")
    chained = cni_conflist(name="n", bridge="dsnunit0", network="10.225.0.0/16", gateway="10.225.0.1",
                           pod_cidr="10.225.200.0/24", ipam_dir=tmp_path, kube_proxy=proxy)
    assert [p["type"] for p in chained["plugins"]] == ["bridge", PLUGIN]
    assert chained["plugins"][1]["services"] == [{"name": "default/kubernetes", "clusterIP": "10.96.0.1", "port": 443,
                                                  "endpoint": "10.225.0.1:6443"}]
    with pytest.raises(ValueError, match="not inside the run's network"):
        cni_conflist(name="n", bridge="b", network="10.225.0.0/16", gateway="10.225.0.1", pod_cidr="10.226.0.0/24",
                     ipam_dir=tmp_path)


def test_containerd_config_keeps_everything_under_the_run(tmp_path: Path) -> None:
    lay = NodeLayout(tmp_path / "node")
    cfg = tomllib.loads(containerd_toml(lay, pause_ref="localhost/dynsnap-pause:x", runc=Path("/usr/sbin/runc")))
    assert cfg["root"] == str(lay.containerd_root) and cfg["state"] == str(lay.containerd_state)
    assert cfg["grpc"]["address"] == str(lay.containerd_socket)
    assert cfg["plugins"]["io.containerd.internal.v1.opt"]["path"].startswith(str(lay.root))
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "localhost/dynsnap-pause:x"
    assert cri["netns_mounts_under_state_dir"] is True and cri["restrict_oom_score_adj"] is True
    assert cri["stream_server_address"] == "127.0.0.1"
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["options"] == {"SystemdCgroup": False, "BinaryName": "/usr/sbin/runc", "Root": str(lay.runc_root)}
    assert cri["cni"]["conf_dir"] == str(lay.cni_conf_dir)
    assert cri["cni"]["bin_dir"] == str(lay.cni_bin_dir) and lay.cni_bin_dir.is_relative_to(lay.root)


def test_an_image_store_is_containerds_root_and_one_node_holds_it_at_a_time(tmp_path: Path) -> None:
    """containerd's root moves to the store (the rest of the node stays under the run); the store's lock
    is one node's at a time, and free again once its holder closes it."""
    store = tmp_path / "cache" / "node-image-store"
    lay = NodeLayout(tmp_path / "node", store)
    cfg = tomllib.loads(containerd_toml(lay, pause_ref="p", runc=Path("/usr/sbin/runc")))
    assert cfg["root"] == str(store) and cfg["state"] == str(lay.containerd_state)
    assert lay.containerd_state.is_relative_to(lay.root) and lay.containerd_socket.is_relative_to(lay.root)
    first = hold_store(store)
    assert first is not None
    try:
        assert hold_store(store) is None, "a second node got the store another holds"
    finally:
        os.close(first)
    again = hold_store(store)
    assert again is not None, "the store stayed locked after its holder let it go"
    os.close(again)


def test_the_two_lanes_nodes_each_find_a_store_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """./run test's two lanes each run a node at once: the stores are distinct directories of the cache,
    and with the first held the second is still free."""
    monkeypatch.setenv("DYNSNAP_CACHE", str(tmp_path))
    stores = image_stores()
    assert stores == (tmp_path / "node-image-store", tmp_path / "node-image-store-1")
    held = [hold_store(s) for s in stores]
    try:
        assert all(fd is not None for fd in held), "one of the two stores was not free"
    finally:
        for fd in held:
            if fd is not None:
                os.close(fd)


def test_kubelet_configuration_is_a_cgroupfs_node_that_writes_no_host_sysctl(tmp_path: Path) -> None:
    lay = NodeLayout(tmp_path)
    s = KubeletSettings(node_ip="10.225.0.1", port=10250, healthz_port=10248, ca_cert=tmp_path / "ca.crt",
                        serving_cert=tmp_path / "k.crt", serving_key=tmp_path / "k.key", cgroup_root="/dynsnap-x",
                        containerd_socket=lay.containerd_socket)
    cfg = kubelet_configuration(lay, s)
    assert cfg["cgroupDriver"] == "cgroupfs" and cfg["cgroupRoot"] == "/dynsnap-x" and cfg["failSwapOn"] is False
    assert cfg["protectKernelDefaults"] is True
    assert cfg["address"] == "10.225.0.1" and cfg["healthzBindAddress"] == "127.0.0.1" and cfg["readOnlyPort"] == 0
    assert cfg["authentication"]["anonymous"] == {"enabled": False}
    assert cfg["authorization"] == {"mode": "Webhook"}
    assert cfg["containerRuntimeEndpoint"] == f"unix://{lay.containerd_socket}"
    assert all(v == "0%" for v in cfg["evictionHard"].values())
    # As a cluster sets them: the runtime's default seccomp profile, a pids limit per pod.
    assert cfg["seccompDefault"] is True and cfg["podPidsLimit"] == POD_PIDS_LIMIT > 0


def _plugin(tmp_path: Path, command: str, stdin: str, netns: str = "") -> subprocess.CompletedProcess[str]:
    exe = install(tmp_path / "bin")
    return subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, timeout=30, check=False,
                          env={"CNI_COMMAND": command, "CNI_NETNS": netns, "PATH": "/usr/bin:/bin"})


def test_stub_kube_proxy_speaks_cni_and_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    """The plugin as containerd runs it (its installed wrapper, stdin and CNI_* env): VERSION lists the
    spec versions; DEL has nothing to undo and says nothing; a config that is no JSON, or an ADD without a
    network namespace, is a CNI error (code 999, a message) and a non-zero exit, never a silent success.
    (tests/integration/test_real_node.py runs its ADD: a pod reaches the API server at the Service's IP.)"""
    res = _plugin(tmp_path, "VERSION", "")
    assert res.returncode == 0 and "1.0.0" in json.loads(res.stdout)["supportedVersions"]
    conf = {"cniVersion": "1.0.0", "name": "n", **plugin_config(
        cluster_ip="10.96.0.1", port=443, endpoint="10.225.0.1:6443", iptables="/usr/sbin/iptables",
        nsenter="/usr/bin/nsenter"), "prevResult": {"ips": [{"address": "10.225.200.5/16"}]}}
    res = _plugin(tmp_path, "DEL", json.dumps(conf))
    assert res.returncode == 0 and res.stdout == ""
    for stdin, netns, says in (("{not json", "/run/netns/x", "not JSON"), (json.dumps(conf), "", "CNI_NETNS is empty")):
        res = _plugin(tmp_path, "ADD", stdin, netns)
        err = json.loads(res.stdout)
        assert res.returncode != 0 and err["code"] == 999 and says in err["msg"], res


def test_kubelet_mount_namespace_script_is_valid_shell() -> None:
    assert subprocess.run(["sh", "-n", "-c", KUBELET_NS_SCRIPT], check=False).returncode == 0


def test_bad_node_names_and_paths_are_refused_before_anything_starts(tmp_path: Path) -> None:
    net = SandboxNetwork(bridge="dsnunit0", cidr="10.225.0.0/16")
    kw = {"cp": None, "net": net, "api": None, "pod_cidr": "10.225.200.0/24"}
    with pytest.raises(ValueError, match="not a DNS label"):
        RealNode(name="Node_A", root=tmp_path, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="too long for a unix socket"):
        RealNode(name="n", root=tmp_path / ("x" * 100), **kw)  # type: ignore[arg-type]


def test_issue_cert_names_the_node_and_its_groups(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", ips=["127.0.0.1"], dns=["localhost"])
    issue_cert(pki, tmp_path / "c.crt", tmp_path / "c.key", cn="system:node:n", orgs=("system:nodes",),
               ips=("10.225.0.1",), dns=("n",), server=True)
    cert = x509.load_pem_x509_certificate((tmp_path / "c.crt").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:n"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.225.0.1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert oct((tmp_path / "c.key").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError, match="server or client"):
        issue_cert(pki, tmp_path / "d.crt", tmp_path / "d.key", cn="x")
