"""/proc lookups the agent relies on, against a copy of /proc's layout: the pod UID in a cgroup path
(kubelet's cgroupfs and systemd spellings), NSpid, a process tree, what a process maps."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynsnap.models.ids import PodUID
from dynsnap.runtime import procfs

UID = "0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f"


def _proc(root: Path, pid: int, *, ppid: int, nspid: str, cgroup: str, children: str = "", maps: str = "") -> None:
    d = root / str(pid)
    (d / "task" / str(pid)).mkdir(parents=True)
    (d / "status").write_text(f"Name:\tpython\nState:\tS (sleeping)\nPPid:\t{ppid}\nNSpid:\t{nspid}\n")
    (d / "cgroup").write_text(cgroup)
    (d / "task" / str(pid) / "children").write_text(children)
    (d / "maps").write_text(maps)


@pytest.mark.parametrize("cgroup", [
    f"0::/kubepods/besteffort/pod{UID}/abc123\n",
    f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
    "cri-containerd-abc.scope\n",
    f"12:pids:/dynsnap-test/kubepods/besteffort/pod{UID}/c\n1:name=systemd:/x\n",
])
def test_pod_uid_from_either_cgroup_driver(tmp_path: Path, cgroup: str) -> None:
    _proc(tmp_path, 500, ppid=1, nspid="500 1", cgroup=cgroup)
    _proc(tmp_path, 600, ppid=1, nspid="600", cgroup="0::/system.slice/sshd.service\n")
    assert procfs.pod_uid_of(500, tmp_path) == UID
    assert procfs.pod_uid_of(600, tmp_path) is None
    assert procfs.pod_pids(PodUID(UID), tmp_path) == [500]


def test_nspid_tree_and_maps(tmp_path: Path) -> None:
    cg = f"0::/kubepods/pod{UID}/c\n"
    _proc(tmp_path, 500, ppid=1, nspid="500 1", cgroup=cg, children="501")
    _proc(tmp_path, 501, ppid=500, nspid="501 10000", cgroup=cg, children="502",
          maps="7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159\n7f02-7f03 rw-p 0 0 0 \n")
    _proc(tmp_path, 502, ppid=501, nspid="502 10001", cgroup=cg)
    st = procfs.status(501, tmp_path)
    assert st is not None and st.ns_pid == 10000 and st.ppid == 500 and st.nspid == (501, 10000)
    assert procfs.tree(500, tmp_path) == [500, 501, 502]
    assert procfs.maps_paths(501, tmp_path) == {"/usr/lib/x86_64-linux-gnu/libcuda.so.580.159"}
    assert procfs.status(999, tmp_path) is None  # gone: absent, not an error


def test_apiserver_endpoints_from_the_workers_environment(tmp_path: Path) -> None:
    from dynsnap.agent.worker import apiserver_endpoints

    cg = f"0::/kubepods/pod{UID}/c\n"
    _proc(tmp_path, 501, ppid=500, nspid="501 10000", cgroup=cg)
    root = tmp_path / "501" / "root" / "etc"
    root.mkdir(parents=True)
    (root / "kubeconfig").write_text("clusters:\n- cluster: {server: 'https://10.213.0.1:34567'}\n"
                                     "- cluster: {server: 'https://api.example.internal:6443'}\n")
    (tmp_path / "501" / "environ").write_bytes(
        b"KUBERNETES_SERVICE_HOST=10.96.0.1\0KUBERNETES_SERVICE_PORT=443\0KUBECONFIG=/etc/kubeconfig\0")
    # A hostname is skipped: a socket's peer is an address.
    assert apiserver_endpoints(501, tmp_path) == [("10.213.0.1", 34567), ("10.96.0.1", 443)]


CID = "34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376"
US = UID.replace("-", "_")


@pytest.mark.parametrize(("path", "container"), [
    # cgroupfs driver (the one this project's real node runs), cgroup v1 and v2, each QoS class
    (f"/kubepods/besteffort/pod{UID}/{CID}", CID),
    (f"/kubepods/burstable/pod{UID}/{CID}", CID),
    (f"/kubepods/pod{UID}/{CID}", CID),  # Guaranteed: no QoS level
    (f"/dynsnap-test/kubepods/besteffort/pod{UID}/{CID}", CID),  # under kubelet's --cgroup-root
    (f"/kubepods/besteffort/pod{UID}/crio-{CID}", CID),  # CRI-O under cgroupfs
    (f"/kubepods/besteffort/pod{UID}", None),  # the pod's own cgroup: no container
    # systemd driver: containerd, CRI-O, docker; each QoS class
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{US}.slice/cri-containerd-{CID}.scope", CID),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{US}.slice/crio-{CID}.scope", CID),
    (f"/kubepods.slice/kubepods-pod{US}.slice/docker-{CID}.scope", CID),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{US}.slice/crio-conmon-{CID}.scope",
     None),  # CRI-O's conmon beside the container: the pod's, but no container of it
    (f"/kubepods.slice/kubepods-pod{US}.slice/cri-containerd-{CID}.scope/init", None),  # a sub-cgroup
    (f"/kubepods.slice/kubepods-pod{US}.slice/{CID}", None),  # a bare id under a systemd slice: neither driver
    (f"/kubepods/besteffort/pod{UID}/cri-containerd-{CID}.scope", None),  # a scope under cgroupfs: neither
])
def test_a_cgroup_path_names_its_pod_and_container_under_either_driver(path: str, container: str | None) -> None:
    pc = procfs.parse_pod_cgroup(path)
    assert pc is not None and pc.pod_uid == UID and pc.container_id == container, pc


@pytest.mark.parametrize("path", [
    "/system.slice/containerd.service",
    f"/system.slice/fake-pod{UID}.service",  # a pod UID in a name that is no pod directory
    f"/user.slice/pod{UID}x/{CID}",
    f"/kubepods/besteffort/pod{UID[:-1]}/{CID}",  # a UID one digit short
    "/",
])
def test_a_path_outside_any_pod_names_none(path: str) -> None:
    assert procfs.parse_pod_cgroup(path) is None


def test_container_ids_read_every_hierarchy_of_a_hybrid_node(tmp_path: Path) -> None:
    cg = (f"12:pids:/kubepods/besteffort/pod{UID}/{CID}\n5:memory:/kubepods/besteffort/pod{UID}/{CID}\n"
          "1:name=systemd:/system.slice/containerd.service\n0::/\n")
    _proc(tmp_path, 500, ppid=1, nspid="500 1", cgroup=cg)
    _proc(tmp_path, 600, ppid=1, nspid="600", cgroup=f"0::/kubepods/besteffort/pod{UID}\n")
    assert procfs.container_ids(500, tmp_path) == {CID}
    assert procfs.container_ids(600, tmp_path) == set()
    assert procfs.pod_uid_of(600, tmp_path) == UID
