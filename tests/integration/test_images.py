"""dynsnap's images, as hack/lib-images.sh builds them from Debian packages ($DYNSNAP_IMAGES), are
what they say and do their job when run: valid OCI image layouts tagged with the package version,
the files each must (and must not) hold with the intended owners and modes, and containers made
from them under crun, Debian's OCI runtime:

- the entrypoint image, run as the worker pods' init container, copies the static entrypoint into
  an emptyDir; the workers below then run under that copy;
- the controller image runs as its non-root user with a read-only root and no capabilities, in a
  network namespace of its own on the test bridge (a pod IP), with the controller service
  account's token where in-cluster config reads it; it takes the Lease, answers /readyz, creates
  the WorkerSnapshots, quiesces an idle worker and proves its wake with pinned requests;
- the agent image runs privileged with the host's pid, network and IPC namespaces (a DaemonSet
  pod), its node directory a host path; its init container puts CRIU and dynsnap-cuda there
  (dynsnap-install-node-tools), the agent then captures the worker with that CRIU and wakes it.

Everything talks to the API server with the tokens the shipped RBAC (deploy/rbac/) gives, from
the TokenRequest API; the containers reach only the test bridge and loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import struct
import tarfile
import tempfile
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from controllerenv import Load, asleep, events_for, get_ws, policy, verified_after

from dynsnap.k8s.client import Obj
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynsnap_parts import (
    AGENT_NS,
    AGENT_SA,
    CONTROLLER_SA,
    StubDriver,
    build_stub_driver,
    install_dynsnap,
)
from dynsnap.testenv.oci import (
    SA_DIR,
    Container,
    Mount,
    OciImage,
    PodSpec,
    image_layout,
    service_account_token,
    write_service_account_dir,
)

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
NATIVE = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
CONTROLLER_UID = 65532


@pytest.fixture(scope="module")
def images() -> dict[str, OciImage]:
    return {n: OciImage.load(image_layout(f"dynsnap-{n}")) for n in ("controller", "agent", "entrypoint")}


@pytest.fixture
def work() -> Iterator[Path]:
    """A scratch directory for bundles and host paths (unpacked images: hundreds of MB), removed
    after the test; the containers' logs are printed when a test fails."""
    d = Path(tempfile.mkdtemp(prefix="dynsnap-images-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _prefix() -> str:
    """Container ids unique to this test session's bridge (other sessions run at once)."""
    return f"{os.environ.get('DYNSNAP_TEST_BRIDGE', 'dsnbr0')}-img"


def _pyver(files: dict[str, tarfile.TarInfo]) -> str:
    """The image's Python version, from its venv's lib/pythonX.Y."""
    return next(p.split("/")[3].removeprefix("python") for p in files if p.startswith("opt/dynsnap/lib/python3."))


# -- what the images are -------------------------------------------------------------------------


def test_images_are_oci_layouts_tagged_with_the_package_version(images: dict[str, OciImage]) -> None:
    for name, img in images.items():
        img.verify()  # every blob matches its digest; every layer's tar matches its diff_id
        assert img.ref_name == VERSION, name
        assert img.index["manifests"][0]["annotations"]["io.containerd.image.name"] == f"dynsnap-{name}:{VERSION}"
        assert img.labels["org.opencontainers.image.version"] == VERSION
        assert img.config["os"] == "linux" and img.config["architecture"] in ("amd64", "arm64")
        assert all(lay["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
                   for lay in img.manifest["layers"])
    # The Python images: Debian + dependencies below, dynsnap on top (the layer an edit changes).
    assert len(images["controller"].manifest["layers"]) == 2
    assert len(images["agent"].manifest["layers"]) == 2
    assert len(images["entrypoint"].manifest["layers"]) == 1


def _nothing_writable_by(files: dict[str, tarfile.TarInfo], uid: int) -> None:
    """Nothing in the image belongs to ``uid`` (or its group) and nothing is writable by others
    but sticky directories (/tmp): a process of that user cannot change what the image runs.
    (Debian's own group-writable files, /var/log/wtmp for group utmp, are not that user's.)"""
    owned = [p for p, m in files.items() if uid in (m.uid, m.gid)]
    assert not owned, owned[:10]
    world = [p for p, m in files.items() if not m.issym() and m.mode & 0o002 and not (m.isdir() and m.mode & 0o1000)]
    assert not world, world[:10]


def test_controller_image_holds_dynsnap_and_neither_the_harness_nor_cryptography(
        images: dict[str, OciImage]) -> None:
    img = images["controller"]
    assert img.entrypoint == ["/opt/dynsnap/bin/dynsnap"] and img.cmd == ["controller"]
    assert img.user == (CONTROLLER_UID, CONTROLLER_UID)
    files = img.files()
    site = f"opt/dynsnap/lib/python{_pyver(files)}/site-packages"
    script = files["opt/dynsnap/bin/dynsnap"]
    assert script.isfile() and stat.S_IMODE(script.mode) == 0o755
    assert img.read("opt/dynsnap/bin/dynsnap").startswith(b"#!/opt/dynsnap/bin/python")
    for module in ("cli.py", "controller/main.py", "agent/main.py", "k8s/client.py", "runtime/leader.py"):
        assert f"{site}/dynsnap/{module}" in files, module
    # The controller image needs neither the local test environment nor its certificate library.
    assert not [p for p in files if p.startswith((f"{site}/dynsnap/testenv", f"{site}/dynsnap/demo.py"))]
    for absent in ("cryptography", "pytest", "mypy", "ruff", "pip", "matplotlib"):
        assert not [p for p in files if p.startswith(f"{site}/{absent}")], absent
    assert any(p.startswith(f"{site}/kubernetes_asyncio/") for p in files)
    passwd = img.read("etc/passwd").decode()
    assert f"dynsnap:x:{CONTROLLER_UID}:{CONTROLLER_UID}:" in passwd
    assert img.read("etc/resolv.conf") == b""  # the build machine's resolver is no part of an image
    _nothing_writable_by(files, CONTROLLER_UID)


def test_agent_image_carries_criu_its_cuda_plugin_and_dynsnap_cuda(images: dict[str, OciImage]) -> None:
    img = images["agent"]
    assert img.entrypoint == ["/opt/dynsnap/bin/dynsnap"] and img.cmd == ["agent"]
    assert img.user == (0, 0)  # CRIU and nsenter into workers: root, in a privileged pod
    files = img.files()
    for path, want in (("usr/local/sbin/criu", Path(os.environ["DYNSNAP_CRIU"])),
                       ("usr/local/bin/dynsnap-cuda", NATIVE / "dynsnap-cuda"),
                       ("usr/local/lib/criu/cuda_plugin.so",
                        Path(os.environ["DYNSNAP_CRIU"]).parents[1] / "lib" / "criu" / "cuda_plugin.so")):
        assert stat.S_IMODE(files[path].mode) == 0o755, path
        assert img.read(path) == want.read_bytes(), path  # the very binaries the tests prove
    link = files["usr/local/bin/cuda-checkpoint"]
    assert link.issym() and link.linkname == "dynsnap-cuda"  # what CRIU's CUDA plugin execs
    assert stat.S_IMODE(files["usr/local/bin/dynsnap-install-node-tools"].mode) == 0o755
    assert "usr/bin/ss" in files and "usr/bin/nsenter" in files
    env = img.env
    assert env["DYNSNAP_AGENT_CRIU"] == "/var/lib/dynsnap/bin/criu"
    assert env["DYNSNAP_AGENT_CRIU_LIBDIR"] == "/var/lib/dynsnap/lib/criu"
    assert env["DYNSNAP_AGENT_CUDA_HELPER"] == "/var/lib/dynsnap/bin/dynsnap-cuda"
    assert not [p for p in files if "/dynsnap/testenv" in p or "/cryptography" in p]
    _nothing_writable_by(files, CONTROLLER_UID)


def _is_static_elf(data: bytes) -> bool:
    """An ELF executable without a PT_INTERP program header (no dynamic loader needed)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2  # 64-bit
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return all(struct.unpack_from("<I", data, phoff + i * phentsize)[0] != 3 for i in range(phnum))


def test_entrypoint_image_is_busybox_and_the_static_entrypoint(images: dict[str, OciImage]) -> None:
    img = images["entrypoint"]
    assert img.cmd == ["cp", "/usr/local/bin/dynsnap-entrypoint", "/dynsnap/bin/dynsnap-entrypoint"]
    assert img.user == (CONTROLLER_UID, CONTROLLER_UID)
    files = img.files()
    regular = {p for p, m in files.items() if m.isfile()}
    assert regular == {"bin/busybox", "usr/local/bin/dynsnap-entrypoint", "usr/local/bin/libdynsnap-thp.so",
                       "etc/passwd", "etc/group", "usr/share/doc/busybox-static/copyright"}, regular
    ep = img.read("usr/local/bin/dynsnap-entrypoint")
    assert ep == (NATIVE / "dynsnap-entrypoint").read_bytes() and _is_static_elf(ep)
    assert stat.S_IMODE(files["usr/local/bin/dynsnap-entrypoint"].mode) == 0o755
    # What the examples' second init container (dynsnap-thp) copies out: the library the entrypoint preloads.
    assert img.read("usr/local/bin/libdynsnap-thp.so") == (NATIVE / "libdynsnap-thp.so").read_bytes()
    assert stat.S_IMODE(files["usr/local/bin/libdynsnap-thp.so"].mode) == 0o644
    assert files["bin/cp"].issym() and files["bin/cp"].linkname == "busybox"
    _nothing_writable_by(files, CONTROLLER_UID)


def test_dynamo_image_is_debian_python_with_the_dynamo_venv_and_the_model() -> None:
    """dynsnap-dynamo (the local stand-in for NVIDIA's Dynamo runtime images): Debian's python3 with a venv
    whose site-packages are the local Dynamo venv's (the same files, the same CPython minor), pip left
    out, the tokenizer-only model directory, and `python3` on its PATH the venv's. (It runs as the
    worker and frontend pods of tests/integration/test_real_node_wake.py.)"""
    img = OciImage.load(image_layout("dynsnap-dynamo"))
    img.verify()
    pins = dict(line.split("#")[0].strip().split("=", 1) for line in (ROOT / "hack" / "versions.env").read_text()
                .splitlines() if "=" in line.split("#")[0])
    assert img.ref_name == pins["DYNAMO_VERSION"]  # tagged with Dynamo's version
    assert img.env["PATH"].split(":")[0] == "/opt/dynamo/bin" and img.user == (0, 0)
    files = img.files()
    venv = Path(os.environ["DYNSNAP_DYNAMO_VENV"])
    (site,) = sorted(venv.glob("lib/python3.*/site-packages"))
    pyver = site.parent.name  # python3.11: the wheels' compiled modules are for it
    assert f"usr/bin/{pyver}" in files and files["opt/dynamo/bin/python3"].issym()
    img_site = f"opt/dynamo/lib/{pyver}/site-packages"
    for rel in ("dynamo/frontend/__init__.py", "dynamo/mocker/__init__.py", "tokenizers/__init__.py"):
        assert img.read(f"{img_site}/{rel}") == (site / rel).read_bytes(), rel
    assert [p for p in files if p.startswith(f"{img_site}/ai_dynamo_runtime-")], "no ai-dynamo-runtime"
    assert not [p for p in files if p.startswith(f"{img_site}/pip/")]
    assert any(p.startswith("usr/lib/") and "/libstdc++.so.6" in p for p in files)  # Dynamo's runtime links it
    model = Path(os.environ["DYNSNAP_MODEL_DIR"])
    for f in sorted(model.glob("*.json")):
        assert img.read(f"opt/dynamo/model/{f.name}") == f.read_bytes(), f.name


# -- the images run --------------------------------------------------------------------------------


async def test_controller_image_runs_as_its_user_without_the_harness(images: dict[str, OciImage],
                                                                    work: Path) -> None:
    """Python in the image imports the controller and the agent (their whole import graph) as uid
    65532 with a read-only root and no capabilities; the harness and cryptography are not there."""
    probe = ("import os, importlib.util as u, dynsnap.cli, dynsnap.controller.main, dynsnap.agent.main; "
             "print(os.getuid(), os.getgid(), u.find_spec('cryptography') is None, "
             "u.find_spec('dynsnap.testenv') is None)")
    c = Container(f"{_prefix()}-ctl-probe", images["controller"],
                  PodSpec("ctl-probe", command=["/opt/dynsnap/bin/python", "-c", probe], args=[],
                          readonly_root=True, drop_all_caps=True),
                  bundle=work / "probe", state_root=work / "crun")
    rc = await c.run_to_completion(timeout=120)
    assert rc == 0, c.tail()
    assert c.tail(1).split() == [str(CONTROLLER_UID), str(CONTROLLER_UID), "True", "True"], c.tail()


@dataclass
class Node:
    """A fake node's host paths for its agent, laid out as deploy/helm/dynsnap's DaemonSet has them
    (each mounted at the same path in the agent: CRIU, run in a worker's mount namespace, must find
    them there too; the workers here share the node's file system)."""

    root: Path

    @property
    def tools(self) -> Path:  # agent.nodeToolsDir (/var/lib/dynsnap)
        return self.root / "var-lib-dynsnap"

    @property
    def images(self) -> Path:  # agent.imagesRoot (/var/lib/dynsnap/images)
        return self.tools / "images"

    @property
    def cuda_state(self) -> Path:  # agent.stateDir (/run/dynsnap-cuda)
        return self.root / "run-dynsnap-cuda"


async def _agent_init_containers(img: OciImage, rootfs: Path, node: Node, work: Path, name: str) -> str:
    """The DaemonSet pod's two init containers, with the chart's security context (root, every
    capability dropped but FOWNER, no privilege escalation): the private images directory, then
    dynsnap-install-node-tools (CRIU, its plugin and dynsnap-cuda onto the node). Their output."""
    node.tools.mkdir(parents=True, exist_ok=True)
    node.images.mkdir(exist_ok=True)
    node.cuda_state.mkdir(exist_ok=True)
    out = []
    for step, cmd, mounts in (
            ("host-dirs", ["install", "-d", "-m", "0700", str(node.images), str(node.cuda_state)],
             [Mount(node.images, str(node.images)), Mount(node.cuda_state, str(node.cuda_state))]),
            ("node-tools", ["dynsnap-install-node-tools", str(node.tools)], [Mount(node.tools, str(node.tools))])):
        init = Container(f"{_prefix()}-{name}-{step}", img,
                         PodSpec(f"dynsnap-agent-{name}", command=cmd, args=[], mounts=mounts, user=(0, 0),
                                 readonly_root=True, drop_all_caps=True, caps_add=("FOWNER",)),
                         bundle=work / f"{name}-{step}", state_root=work / "crun", rootfs=rootfs)
        rc = await init.run_to_completion(timeout=120)
        assert rc == 0, f"{step}: {init.tail()}"
        out.append(init.tail())
    return "\n".join(out)


async def test_agent_image_init_containers_put_criu_on_the_node(images: dict[str, OciImage], work: Path) -> None:
    img = images["agent"]
    rootfs = work / "agent-rootfs"
    await img.unpack(rootfs)
    node = Node(work / "node")
    out = await _agent_init_containers(img, rootfs, node, work, "probe")
    assert "Version: 4.2.1" in out, out
    assert stat.S_IMODE(node.images.stat().st_mode) == 0o700  # images hold the workers' secrets
    assert (node.tools / "bin" / "criu").read_bytes() == img.read("usr/local/sbin/criu")
    assert (node.tools / "lib" / "criu" / "cuda_plugin.so").read_bytes() == img.read(
        "usr/local/lib/criu/cuda_plugin.so")
    assert (node.tools / "bin" / "dynsnap-cuda").read_bytes() == img.read("usr/local/bin/dynsnap-cuda")
    assert os.readlink(node.tools / "bin" / "cuda-checkpoint") == "dynsnap-cuda"
    assert stat.S_IMODE((node.tools / "bin" / "criu").stat().st_mode) == 0o755
    # CRIU from the node tools finds what it needs in the agent's container (privileged, the host's
    # pid namespace, a writable root: the chart's agent).
    check = Container(f"{_prefix()}-criu-check", img,
                      PodSpec("criu-check", command=[str(node.tools / "bin" / "criu")], args=["check"],
                              mounts=[Mount(node.tools, str(node.tools), readonly=True)], privileged=True,
                              host_namespaces=("pid",)),
                      bundle=work / "criu-check", state_root=work / "crun", rootfs=rootfs)
    rc = await check.run_to_completion(timeout=120)
    assert rc == 0 and "Looks good." in check.tail(), check.tail()


async def test_entrypoint_image_as_init_container_copies_the_entrypoint(images: dict[str, OciImage],
                                                                       work: Path) -> None:
    bindir = work / "dynsnap-bin"
    bindir.mkdir()
    bindir.chmod(0o777)  # an emptyDir: writable by the init container's non-root user
    init = Container(f"{_prefix()}-ep-init", images["entrypoint"],
                     PodSpec("ep-init", mounts=[Mount(bindir, "/dynsnap/bin")], readonly_root=True, drop_all_caps=True),
                     bundle=work / "ep-init", state_root=work / "crun")
    rc = await init.run_to_completion(timeout=60)
    assert rc == 0, init.tail()
    copied = bindir / "dynsnap-entrypoint"
    assert copied.read_bytes() == (NATIVE / "dynsnap-entrypoint").read_bytes()
    assert copied.stat().st_uid == CONTROLLER_UID and copied.stat().st_mode & 0o111 == 0o111


# -- the controller and the agents from the images, one capture and one verified wake ---------------


def _sa_mount(work: Path, name: str, token: str, cluster: LocalCluster, namespace: str) -> Mount:
    assert cluster.cp is not None and cluster.cp.pki is not None
    d = write_service_account_dir(work / f"sa-{name}", token=token, ca_pem=cluster.cp.pki.ca_cert.read_bytes(),
                                  namespace=namespace)
    return Mount(d, SA_DIR, readonly=True)


def _apiserver_env(cluster: LocalCluster) -> dict[str, str]:
    """The Service env kubelet gives every container; the API server listens on the bridge's gateway."""
    assert cluster.cp is not None
    port = urlsplit(cluster.cp.url).port
    return {"KUBERNETES_SERVICE_HOST": cluster.net.gateway, "KUBERNETES_SERVICE_PORT": str(port)}


def _graph(driver: StubDriver, entrypoint: Path) -> Obj:
    worker = D.mocker_component("worker", replicas=2, dynsnap=True, speedup_ratio=1,
                                env={"LD_PRELOAD": str(driver.libcuda)})
    main = worker["extraPodSpec"]["mainContainer"]
    assert main["command"][0] == D.entrypoint_binary()
    main["command"][0] = str(entrypoint)  # the copy the entrypoint image's init container made
    worker["annotations"] = policy(min_active=1, verify_requests=3)
    body = D.dgd("img-graph", [D.frontend_component(), worker])
    body["metadata"]["annotations"] = policy(enabled=True, idle_after="3s", tier="snapshot", wake_at_inflight=1)
    return body


async def _http_ok(url: str) -> bool:
    async with httpx.AsyncClient(timeout=3.0) as http:
        try:
            return (await http.get(url)).status_code == 200
        except httpx.HTTPError:  # not listening yet
            return False


async def _attach(cluster: LocalCluster, name: str, host_index: int) -> tuple[str, str]:
    """A pod network namespace on the test bridge for a container: (netns, pod IP). The IPs are
    in the gateway's /24, which kwok never assigns (its pod CIDRs are the /24s after it)."""
    ip = str(list(next(cluster.net.network.subnets(new_prefix=24)).hosts())[host_index])
    netns = cluster.net.netns_name(namespace=AGENT_NS, name=name, uid=str(uuid.uuid4()))
    await cluster.net.attach(netns, ip, hostname=name)
    return netns, ip


async def test_controller_and_agents_from_images_capture_and_wake_a_worker_verified(
        cluster: LocalCluster, images: dict[str, OciImage], work: Path) -> None:
    driver = build_stub_driver(work / "stubcuda")
    await install_dynsnap(cluster)
    api = cluster.api
    k8s_env = _apiserver_env(cluster)
    crun_state = work / "crun"
    containers: list[Container] = []
    netnss: list[str] = []
    graph: D.Graph | None = None
    loads: list[Load] = []
    fe: D.FrontendClient | None = None
    try:
        # The workers' init container: the entrypoint from its image into their emptyDir.
        bindir = work / "dynsnap-bin"
        bindir.mkdir()
        bindir.chmod(0o777)
        ep_init = Container(f"{_prefix()}-ep", images["entrypoint"],
                            PodSpec("ep-init", mounts=[Mount(bindir, "/dynsnap/bin")], readonly_root=True,
                                    drop_all_caps=True), bundle=work / "ep", state_root=crun_state)
        assert await ep_init.run_to_completion(timeout=60) == 0, ep_init.tail()

        # One agent per fake node, each a pod of deploy/helm/dynsnap's DaemonSet: its init
        # containers, then the agent privileged in the host's pid namespace, with a pod IP of its
        # own, the node's host paths and the agent's token.
        agent_img = images["agent"]
        init_rootfs = work / "agent-init-rootfs"  # the init containers' (read-only) root
        await agent_img.unpack(init_rootfs)
        agent_token = await service_account_token(cluster, namespace=AGENT_NS, sa=AGENT_SA)
        agent_sa = _sa_mount(work, "agent", agent_token, cluster, AGENT_NS)
        nodes: dict[str, Node] = {}
        agent_ips: dict[str, str] = {}
        for i, name in enumerate(NODES):
            node = nodes[name] = Node(work / name)
            await _agent_init_containers(agent_img, init_rootfs, node, work, name)
            netns, agent_ips[name] = await _attach(cluster, f"dynsnap-agent-{name}", 201 + i)
            netnss.append(netns)
            args = ["--verbose", "agent"]
            for k, v in driver.env().items():
                args += ["--cuda-env", f"{k}={v}"]
            pod = PodSpec(
                f"dynsnap-agent-{name}", command=["dynsnap"], args=args,
                env={**k8s_env, "DYNSNAP_AGENT_NODE_NAME": name,  # the downward API's spec.nodeName
                     "DYNSNAP_AGENT_IMAGES_ROOT": str(node.images), "DYNSNAP_AGENT_STATE_DIR": str(node.cuda_state),
                     "DYNSNAP_AGENT_CRIU": str(node.tools / "bin" / "criu"),
                     "DYNSNAP_AGENT_CRIU_LIBDIR": str(node.tools / "lib" / "criu"),
                     "DYNSNAP_AGENT_CUDA_HELPER": str(node.tools / "bin" / "dynsnap-cuda"),
                     "DYNSNAP_AGENT_FAILURE_BACKOFF": "2", "DYNSNAP_AGENT_SCRAPE_INTERVAL": "1",
                     "DYNSNAP_AGENT_ACTIVITY_GRANULARITY": "0"},
                mounts=[agent_sa, Mount(node.images, str(node.images)), Mount(node.cuda_state, str(node.cuda_state)),
                        Mount(node.tools, str(node.tools), readonly=True),
                        # the stub driver stands in for the NVIDIA driver the container toolkit mounts
                        Mount(driver.dir, str(driver.dir))],
                # A cgroup namespace of its own, as on a cgroup v2 node (on this v1 machine containerd
                # would give none): the harder case for CRIU, which must work in the worker's.
                host_namespaces=("pid",), netns=netns, cgroupns=True, privileged=True)  # a writable root
            agent = Container(f"{_prefix()}-agent-{name}", agent_img, pod, bundle=work / f"agent-{name}",
                              state_root=crun_state, pod_ip=agent_ips[name])
            containers.append(agent)
            await agent.start()

        # The controller, a pod of the chart's Deployment: non-root, read-only root with an emptyDir
        # on /tmp, no capabilities, a pod IP, the controller's token; settings from the environment.
        ctl_netns, ctl_ip = await _attach(cluster, "dynsnap-controller", 200)
        netnss.append(ctl_netns)
        ctl_token = await service_account_token(cluster, namespace=AGENT_NS, sa=CONTROLLER_SA)
        identity = "dynsnap-controller-img-0"
        (work / "ctl-tmp").mkdir()
        (work / "ctl-tmp").chmod(0o1777)
        ctl = Container(f"{_prefix()}-controller", images["controller"], PodSpec(
            "dynsnap-controller", command=["dynsnap"], args=["--verbose", "controller"],
            env={**k8s_env, "DYNSNAP_CONTROLLER_IDENTITY": identity,  # POD_NAME
                 "DYNSNAP_CONTROLLER_LEASE_NAMESPACE": AGENT_NS,  # POD_NAMESPACE
                 "DYNSNAP_CONTROLLER_SCRAPE_INTERVAL": "0.5", "DYNSNAP_CONTROLLER_VERIFY_TIMEOUT": "30",
                 "DYNSNAP_CONTROLLER_QUIESCE_TIMEOUT": "60"},
            mounts=[_sa_mount(work, "controller", ctl_token, cluster, AGENT_NS), Mount(work / "ctl-tmp", "/tmp")],
            netns=ctl_netns, readonly_root=True, drop_all_caps=True),
            bundle=work / "controller", state_root=crun_state, pod_ip=ctl_ip)
        containers.append(ctl)
        await ctl.start()
        for name in NODES:  # their readiness probes (port 8090, the agent's default)
            await wait_for(f"agent {name} (container) /readyz 200", lambda n=name: _http_ok(
                f"http://{agent_ips[n]}:8090/readyz"), timeout=120, interval=0.5)
        await wait_for("controller (container) /readyz 200", lambda: _http_ok(f"http://{ctl_ip}:8080/readyz"),
                       timeout=120, interval=0.5)
        lease = await api.get(R.LEASES, "dynsnap-controller", namespace=AGENT_NS)
        assert lease["spec"]["holderIdentity"] == identity

        # They run from their images (not from this checkout), the controller as its own user with
        # no capability at all.
        for c in containers:
            pid = await c.pid()
            assert pid is not None, c.tail()
            assert (Path(f"/proc/{pid}/root") / "opt/dynsnap/bin/dynsnap").is_file()
            status = Path(f"/proc/{pid}/status").read_text()
            if c is ctl:
                assert f"Uid:\t{CONTROLLER_UID}\t" in status and "CapEff:\t0000000000000000" in status, status
                assert "NoNewPrivs:\t1" in status
        assert not Path("/opt/dynsnap").exists()

        # A graph of two workers opted in, min-active 1: the controller creates the WorkerSnapshots
        # and sets the serving gates; one worker is captured, one keeps serving.
        graph = await D.deploy(cluster, _graph(driver, bindir / "dynsnap-entrypoint"), wait=False)
        workers = graph.workers("worker")
        await asyncio.gather(*(cluster.wait_ready(p.namespace, p.name, timeout=120) for p in workers))
        for p in workers:  # the worker runs under the entrypoint the init container copied
            assert Path(f"/proc/{p.sandbox.pid}/exe").resolve() == (bindir / "dynsnap-entrypoint").resolve()
        fe = D.FrontendClient(graph.frontend)
        await fe.wait_model()
        trickle = Load(fe, concurrency=1, pause=2.5, max_tokens=2)
        loads.append(trickle)
        trickle.start()

        async def one_asleep() -> RunningPod | None:
            for p in workers:
                if asleep(await get_ws(api, p)):
                    return p
            return None
        try:
            sleeper: RunningPod = await wait_for("one of two workers asleep", one_asleep, timeout=240, interval=0.5)
        except TimeoutError:
            for p in workers:
                print(f"{p.name} status:", yaml.safe_dump(((await get_ws(api, p)) or {}).get("status")))
            raise
        ws = await get_ws(api, sleeper)
        assert ws is not None and ws["spec"]["tier"] == "snapshot"
        assert ws["status"]["controller"]["quiesce"]["ok"] is True
        assert ws["status"]["lastCapture"]["ok"] is True, ws["status"]
        # The capture was made by the image's CRIU, which the init container put on that node.
        dumps = list(nodes[sleeper.node].images.rglob("dump.log"))
        assert dumps, list(nodes[sleeper.node].images.rglob("*"))[:20]
        log = dumps[0].read_text(errors="replace")
        assert "Version: 4.2.1" in log and "Dumping finished successfully" in log
        before = (ws["status"].get("lastWake") or {}).get("id")

        # Load above one worker's share: the controller wakes the sleeper, its agent restores it,
        # and the controller proves the wake with requests pinned to it.
        burst = Load(fe, concurrency=6, max_tokens=60)
        loads.append(burst)
        burst.start()

        async def verified() -> Obj | None:
            w = await get_ws(api, sleeper)
            return w if verified_after(before)(w) else None
        ws = await wait_for(f"{sleeper.name} woken and verified", verified, timeout=240, interval=0.5)
        await burst.stop()
        v = ws["status"]["controller"]["verification"]
        dwm = await api.get(R.DWMS, sleeper.name, namespace=sleeper.namespace)
        assert v["requests"] == 3 and v["answered"] == 3 and v["workerId"] == instance_id_from_dwm(dwm), v
        assert ws["status"]["lastWake"]["tier"] == "snapshot" and ws["status"]["lastWake"]["ok"] is True
        cond = next(c for c in ws["status"]["conditions"] if c["type"] == "Verified")
        assert cond["status"] == "True" and cond["reason"] == "Verified"
        live = await api.get(R.PODS, sleeper.name, namespace=sleeper.namespace)
        assert live["metadata"]["uid"] == sleeper.uid  # woken in place, not recreated
        # ... and into the pod's own namespaces, though the agent's container has IPC, UTS and cgroup
        # namespaces other than the pod's (CRIU must not make new ones for the restored worker).
        ep = sleeper.sandbox.pid
        children = Path(f"/proc/{ep}/task/{ep}/children").read_text().split()
        assert children, f"no worker under the entrypoint {ep}"
        for ns in ("ipc", "uts", "net", "mnt", "pid", "cgroup"):
            assert os.readlink(f"/proc/{children[0]}/ns/{ns}") == os.readlink(f"/proc/{ep}/ns/{ns}"), ns
        await trickle.stop()
        failures = trickle.failures() + burst.failures()
        assert not failures, failures[:5]
        reasons = {e["reason"] for e in await events_for(api, sleeper.namespace, sleeper.name)}
        assert {"Quiescing", "CaptureRequested", "WakeRequested", "Verified"} <= reasons, reasons
        for c in containers:
            assert c.alive(), f"{c.id} exited:\n{c.tail()}"
    except BaseException:
        for c in containers:
            print(f"--- {c.id} ---\n{c.tail(80)}")
        raise
    finally:
        for load in loads:
            await load.stop()
        if fe is not None:
            await fe.close()
        for c in reversed(containers):
            with contextlib.suppress(Exception):
                await c.stop()
        for netns in netnss:
            await cluster.net.detach(netns)
        if graph is not None:
            await D.teardown(cluster, graph)
