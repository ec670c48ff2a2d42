"""The agent's trust boundary with a container (dynsnap/agent/container.py, issue 18): paths resolved
from a container's root refuse symlinks and ``..`` with a named reason and never reach a file outside
it; reads are bounded and only of regular files; a replacement's temp file is created exclusively,
never through a symlink, under a name nobody can plant anything at; a process's environment is read
with a bound and only the keys the agent uses come out, validated.

The "container" is a directory of this machine opened as the root, its "host" files beside it, so a
path that escaped would land on a file the test holds and compares byte for byte. Each resolution
test runs twice: through openat2(2), and through the component walk that stands in for it on a
kernel without it (forced by answering ENOSYS).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynsnap.agent import container as C
from dynsnap.agent.worker import apiserver_endpoints

HOST_BYTES = b"the node's own file\n"


@pytest.fixture(params=["openat2", "walk"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "walk":
        def no_openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
            raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), path)
        monkeypatch.setattr(C, "_openat2", no_openat2)
    return str(request.param)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(container root, host dir): the root holds /run/dynsnap/entrypoint.json; the host dir a file."""
    root, host = tmp_path / "root", tmp_path / "host"
    (root / "run" / "dynsnap").mkdir(parents=True)
    (root / "run" / "dynsnap" / "entrypoint.json").write_text('{"format": 1}')
    host.mkdir()
    (host / "secret").write_bytes(HOST_BYTES)
    yield root, host
    assert (host / "secret").read_bytes() == HOST_BYTES, "a host file changed"
    assert sorted(os.listdir(host)) == ["secret"], f"files appeared in the host dir: {os.listdir(host)}"


def test_paths_the_agent_does_not_resolve_are_refused_with_the_rule_they_break() -> None:
    assert C.components("/run//dynsnap/./x/") == ("run", "dynsnap", "x")
    assert C.components("/") == ()
    for path, says in [("run/dynsnap", "not absolute"), ("/run/dynsnap/../../etc", r"'\.\.' component"),
                       ("/run/\0x", "NUL"), ("/" + "a/" * 2100, "longer than 4096"),
                       ("/run/" + "x" * 256, "component longer than 255")]:
        with pytest.raises(C.UnsafeContainerPath, match=says):
            C.components(path)


def test_a_symlinked_directory_to_a_host_directory_is_refused_and_named(world: tuple[Path, Path], impl: str) -> None:
    root, host = world
    (root / "run" / "dynsnap" / "ctl").symlink_to(host)  # absolute: would resolve against the agent's root
    with C.ContainerRoot(root) as r:
        with pytest.raises(C.UnsafeContainerPath, match=r"/run/dynsnap/ctl is a symlink"):
            r.read("/run/dynsnap/ctl/secret", limit=1024)
        with pytest.raises(C.UnsafeContainerPath, match=r"/run/dynsnap/ctl is a symlink"), \
                r.directory("/run/dynsnap/ctl") as d:
            d.replace("state-request", b"1 suspending\n")


def test_a_relative_symlink_and_a_symlinked_file_are_refused(world: tuple[Path, Path], impl: str) -> None:
    root, host = world
    (root / "run" / "dynsnap" / "up").symlink_to("../..")
    (root / "run" / "dynsnap" / "f").symlink_to(host / "secret")
    with C.ContainerRoot(root) as r:
        with pytest.raises(C.UnsafeContainerPath, match="/run/dynsnap/up is a symlink"):
            r.read("/run/dynsnap/up/run/dynsnap/entrypoint.json", limit=1024)
        with pytest.raises(C.UnsafeContainerPath, match="symlink"):
            r.read("/run/dynsnap/f", limit=1024)
        with r.directory("/run/dynsnap") as d, pytest.raises(C.UnsafeContainerPath, match="is a symlink"):
            d.read("f", limit=1024)


def test_a_dotdot_path_is_refused_before_anything_is_opened(world: tuple[Path, Path], impl: str) -> None:
    root, _ = world
    with C.ContainerRoot(root) as r, pytest.raises(C.UnsafeContainerPath, match=r"'\.\.' component"):
        r.read("/run/dynsnap/../../../host/secret", limit=1024)


def test_reads_are_bounded_and_only_of_regular_files(world: tuple[Path, Path], impl: str) -> None:
    root, _ = world
    d = root / "run" / "dynsnap"
    (d / "big").write_bytes(b"x" * 4097)
    os.mkfifo(d / "fifo")  # opened for reading, it would block the agent until a writer came
    with C.ContainerRoot(root) as r:
        assert r.read("/run/dynsnap/entrypoint.json", limit=13) == b'{"format": 1}'
        with pytest.raises(C.ContainerFileTooLarge, match="larger than 4096 bytes"):
            r.read("/run/dynsnap/big", limit=4096)
        with pytest.raises(C.UnsafeContainerPath, match="not a regular file"):
            r.read("/run/dynsnap/fifo", limit=4096)
        with pytest.raises(C.UnsafeContainerPath, match="not a regular file"):
            r.read("/run/dynsnap", limit=4096)
        with r.directory("/run/dynsnap") as cd, pytest.raises(C.UnsafeContainerPath, match="not a regular file"):
            cd.read("fifo", limit=4096)


def test_following_symlinks_stays_inside_the_root(world: tuple[Path, Path], impl: str) -> None:
    """symlinks=True (a kubeconfig from a Secret volume): an absolute symlink resolves against the
    container's root, never the node's; the walk cannot do that safely and refuses it instead."""
    root, host = world
    (root / "etc").mkdir()
    (root / str(host).lstrip("/")).mkdir(parents=True)
    (root / str(host).lstrip("/") / "secret").write_bytes(b"the container's own\n")
    (root / "etc" / "kubeconfig").symlink_to(host / "secret")
    with C.ContainerRoot(root) as r:
        if impl == "openat2":
            assert r.read("/etc/kubeconfig", limit=1024, symlinks=True) == b"the container's own\n"
        else:
            with pytest.raises(C.UnsafeContainerPath, match="/etc/kubeconfig is a symlink"):
                r.read("/etc/kubeconfig", limit=1024, symlinks=True)


def test_replace_writes_through_a_fresh_temp_file_and_leaves_nothing_else(world: tuple[Path, Path]) -> None:
    root, host = world
    d = root / "run" / "dynsnap"
    # the names an attacker could have guessed before (the agent's pid), and the target itself
    (d / f".state-request.{os.getpid()}").symlink_to(host / "secret")
    (d / "state-request").symlink_to(host / "secret")
    with C.ContainerRoot(root) as r, r.directory("/run/dynsnap") as cd:
        cd.replace("state-request", b"7 suspending\n")
    assert (d / "state-request").read_bytes() == b"7 suspending\n" and not (d / "state-request").is_symlink()
    assert sorted(os.listdir(d)) == sorted([".state-request." + str(os.getpid()), "entrypoint.json",
                                            "state-request"])


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
def test_a_temp_name_planted_in_advance_is_never_opened(world: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                                        plant: str) -> None:
    """Had the name been guessed, O_EXCL | O_NOFOLLOW still refuses whatever sits there: a symlink to a
    host file, a hard link to another file of the container, a FIFO (an open for writing would block)."""
    root, host = world
    d = root / "run" / "dynsnap"
    victim = d / "victim"
    victim.write_bytes(b"another file of the container\n")
    monkeypatch.setattr("dynsnap.agent.container.secrets.token_hex", lambda n: "guessed")
    tmp = d / ".state-request.guessed"
    if plant == "symlink":
        tmp.symlink_to(host / "secret")
    elif plant == "hardlink":
        os.link(victim, tmp)
    else:
        os.mkfifo(tmp)
    with C.ContainerRoot(root) as r, r.directory("/run/dynsnap") as cd, pytest.raises(FileExistsError):
        cd.replace("state-request", b"7 suspending\n")
    assert victim.read_bytes() == b"another file of the container\n"
    assert not (d / "state-request").exists()


def test_a_failed_replace_removes_its_temp_file(world: tuple[Path, Path]) -> None:
    root, _ = world
    d = root / "run" / "dynsnap"
    (d / "state-request").mkdir()  # a directory where the file goes: the rename fails
    with C.ContainerRoot(root) as r, r.directory("/run/dynsnap") as cd, pytest.raises(IsADirectoryError):
        cd.replace("state-request", b"7 suspending\n")
    assert sorted(os.listdir(d)) == ["entrypoint.json", "state-request"]
    for bad in ("../x", "a/b", "..", ""):
        with C.ContainerRoot(root) as r, r.directory("/run/dynsnap") as cd, \
                pytest.raises(C.UnsafeContainerPath, match="not a single file name"):
            cd.replace(bad, b"x")


def _environ(proc: Path, pid: int, data: bytes) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "environ").write_bytes(data)


def test_the_environment_is_read_with_a_bound_and_only_valid_keys_come_out(tmp_path: Path) -> None:
    _environ(tmp_path, 7, b"NCCL_P2P_DISABLE=1\0NCCL_CUMEM_ENABLE=0; rm -rf /\0NCCL_P2P_DISABLE=0\0"
             b"KUBERNETES_SERVICE_HOST=10.0.0.1 or dst 0/0\0KUBERNETES_SERVICE_PORT=70000\0"
             b"KUBECONFIG=relative/path:/etc/other\0HF_TOKEN=not read\0")
    env = C.worker_env(7, proc=tmp_path)
    # the first of a repeated key, as the worker's getenv finds it
    assert env.nccl == {"NCCL_P2P_DISABLE": "1"}
    assert env.service_host is None and env.service_port is None and env.kubeconfig is None
    assert set(env.invalid) == {"NCCL_CUMEM_ENABLE", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT",
                                "KUBECONFIG"}
    _environ(tmp_path, 8, b"KUBERNETES_SERVICE_HOST=fd00::1\0KUBERNETES_SERVICE_PORT=443\0KUBECONFIG=/k:/x\0")
    env = C.worker_env(8, proc=tmp_path)
    assert (str(env.service_host), env.service_port, env.kubeconfig, env.invalid) == ("fd00::1", 443, "/k", ())
    for port in (b"0", b"-1", b"65536", b"\xd9\xa1"):  # the last: an Arabic-Indic digit, str.isdigit() says yes
        _environ(tmp_path, 9, b"KUBERNETES_SERVICE_HOST=10.0.0.1\0KUBERNETES_SERVICE_PORT=" + port + b"\0")
        assert C.worker_env(9, proc=tmp_path).service_port is None, port
    _environ(tmp_path, 10, b"A=" + b"x" * (2 * 1024 * 1024) + b"\0")
    with pytest.raises(C.ContainerFileTooLarge, match="environ of process 10 is larger than 2097152 bytes"):
        C.worker_env(10, proc=tmp_path)
    assert C.worker_env(11, proc=tmp_path).nccl == {}  # a process gone meanwhile: nothing


def test_only_ip_addresses_and_ports_reach_the_connection_reset(tmp_path: Path) -> None:
    """KUBERNETES_SERVICE_HOST/_PORT and a kubeconfig's server become ``ss -K`` arguments: anything
    but an IP address and a port 1-65535 is left out; the kubeconfig is read inside the worker's root."""
    (tmp_path / "501" / "root" / "etc").mkdir(parents=True)
    (tmp_path / "host-kubeconfig").write_text("clusters:\n- cluster: {server: 'https://10.9.9.9:1'}\n")
    (tmp_path / "501" / "root" / "etc" / "kubeconfig").write_text(
        "clusters:\n- cluster: {server: 'https://10.213.0.1:34567'}\n- cluster: {server: 'https://10.0.0.2:0'}\n"
        "- cluster: {server: 'https://dst:6443'}\n")
    _environ(tmp_path, 501, b"KUBERNETES_SERVICE_HOST=0.0.0.0/0\0KUBERNETES_SERVICE_PORT=443\0"
             b"KUBECONFIG=/etc/kubeconfig\0")
    assert apiserver_endpoints(501, tmp_path) == [("10.213.0.1", 34567)]
    # a kubeconfig path leaving the root is never read
    _environ(tmp_path, 501, b"KUBECONFIG=/etc/../../../host-kubeconfig\0")
    assert apiserver_endpoints(501, tmp_path) == []
    (tmp_path / "501" / "root" / "etc" / "kubeconfig").write_bytes(b"clusters: []\n" + b"#" * (1 << 20))
    _environ(tmp_path, 501, b"KUBERNETES_SERVICE_HOST=[fd00::1]\0KUBERNETES_SERVICE_PORT=6443\0"
             b"KUBECONFIG=/etc/kubeconfig\0")
    assert apiserver_endpoints(501, tmp_path) == [("fd00::1", 6443)]  # the oversized kubeconfig is skipped
