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
