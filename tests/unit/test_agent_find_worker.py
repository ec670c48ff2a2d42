"""Which process is a pod's worker: the agent looks for the pod container's dynsnap-entrypoint (its
pid namespace's PID 1) among the pod's processes, in the container the runtime reports when it does
(``containerStatuses[].containerID``), matched by the id its cgroup path names under either cgroup
driver. Against a copy of /proc's layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynsnap.agent import worker as W
from dynsnap.models.ids import PodUID

UID = "0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f"
MAIN = "a" * 64  # the worker's container
SIDE = "b" * 64  # a sidecar of the same pod
SYSTEMD = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/{p}-{c}.scope"


def _proc(root: Path, pid: int, *, nspid: str, cgroup: str, exe: str) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\t{exe[:15]}\nState:\tS (sleeping)\nPPid:\t1\nNSpid:\t{nspid}\n")
    (d / "cgroup").write_text(cgroup)
    (d / "exe").symlink_to(f"/usr/local/bin/{exe}")


def _cgroupfs(c: str) -> str:
    return f"12:pids:/kubepods/burstable/pod{UID}/{c}\n0::/kubepods/burstable/pod{UID}/{c}\n"


def _systemd(c: str, prefix: str) -> str:
    return "0::" + SYSTEMD.format(u=UID.replace("-", "_"), p=prefix, c=c) + "\n"


@pytest.mark.parametrize(("layout", "status_id"), [
    ("cgroupfs", f"containerd://{MAIN}"),
    ("systemd-containerd", f"containerd://{MAIN}"),
    ("systemd-crio", f"cri-o://{MAIN}"),
])
def test_the_reported_container_is_the_one_found_when_two_run_the_entrypoint(tmp_path: Path, layout: str,
                                                                             status_id: str) -> None:
    def cg(c: str) -> str:
        return _cgroupfs(c) if layout == "cgroupfs" else _systemd(c, "crio" if "crio" in layout else "cri-containerd")
    _proc(tmp_path, 500, nspid="500 1", cgroup=cg(MAIN), exe="dynsnap-entrypoint")
    _proc(tmp_path, 600, nspid="600 1", cgroup=cg(SIDE), exe="dynsnap-entrypoint")  # a sidecar calling itself that
    _proc(tmp_path, 700, nspid="700 1", cgroup=cg("c" * 64), exe="pause")
    assert W.find_entrypoint(PodUID(UID), container_id=status_id, proc=tmp_path) == 500
    with pytest.raises(W.NotUnderEntrypoint, match="2 containers run dynsnap-entrypoint"):
        W.find_entrypoint(PodUID(UID), proc=tmp_path)  # no container named: which one is not guessed


def test_a_reported_container_with_no_process_here_is_not_found_not_guessed(tmp_path: Path) -> None:
    # The pod's status names a container none of whose processes runs here (restarted, its new id not
    # yet reported): not found for now (the agent looks again), never the sidecar that calls itself so.
    _proc(tmp_path, 600, nspid="600 1", cgroup=_cgroupfs(SIDE), exe="dynsnap-entrypoint")
    with pytest.raises(W.WorkerNotFound, match=f"no process runs in container {MAIN[:12]}.*{SIDE[:12]}"):
        W.find_entrypoint(PodUID(UID), container_id=f"containerd://{MAIN}", proc=tmp_path)


def test_crio_conmon_beside_the_container_is_not_taken_for_it(tmp_path: Path) -> None:
    conmon = "0::" + SYSTEMD.format(u=UID.replace("-", "_"), p="crio-conmon", c=MAIN) + "\n"
    _proc(tmp_path, 400, nspid="400 1", cgroup=conmon, exe="dynsnap-entrypoint")
    _proc(tmp_path, 500, nspid="500 1", cgroup=_systemd(MAIN, "crio"), exe="dynsnap-entrypoint")
    assert W.find_entrypoint(PodUID(UID), container_id=f"cri-o://{MAIN}", proc=tmp_path) == 500


def test_a_layout_that_names_no_container_leaves_the_entrypoint_check_to_decide(tmp_path: Path) -> None:
    # The stub sandboxes' (and any unknown runtime's) cgroups name no 64-hex container: not narrowed.
    _proc(tmp_path, 500, nspid="500 1", cgroup=f"0::/kubepods/besteffort/pod{UID}/main\n", exe="dynsnap-entrypoint")
    assert W.find_entrypoint(PodUID(UID), container_id=f"containerd://{MAIN}", proc=tmp_path) == 500
