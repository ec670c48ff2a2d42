"""dynsnap's images, as hack/lib-images.sh builds them from Debian packages ($DYNSNAP_IMAGES), are
what they say: valid OCI image layouts tagged with the package version, the files each must (and must
not) hold with the intended owners and modes: the controller's Python without the harness or
cryptography, the agent's patched CRIU, its CUDA plugin and dynsnap-cuda (the very binaries the tests
prove), the entrypoint's static binary and busybox, the Dynamo stand-in's venv and model.

That they do their job when run is shown on the real node, where kubelet and containerd run them as
the chart's and the example's pods (test_real_node_wake.py: the controller as its own user with no
capability on a read-only root, the agent's init container putting these node tools on the node, the
entrypoint image's init container copying the entrypoint the worker runs under; tests/integration/node:
every capture and wake, made by the agent's image with that CRIU). No cluster is needed here."""

from __future__ import annotations

import os
import stat
import struct
import tarfile
import tomllib
from pathlib import Path

import pytest

from dynsnap.testenv.oci import OciImage, image_layout

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
NATIVE = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
CONTROLLER_UID = 65532


@pytest.fixture(scope="module")
def images() -> dict[str, OciImage]:
    return {n: OciImage.load(image_layout(f"dynsnap-{n}")) for n in ("controller", "agent", "entrypoint")}


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
    assert img.user == (0, 0)  # CRIU into workers' namespaces: root, in a privileged pod
    files = img.files()
    for path, want in (("usr/local/sbin/criu", Path(os.environ["DYNSNAP_CRIU"])),
                       ("usr/local/bin/dynsnap-cuda", NATIVE / "dynsnap-cuda"),
                       ("usr/local/bin/dynsnap-nsexec", NATIVE / "dynsnap-nsexec"),
                       ("usr/local/lib/criu/cuda_plugin.so",
                        Path(os.environ["DYNSNAP_CRIU"]).parents[1] / "lib" / "criu" / "cuda_plugin.so")):
        assert stat.S_IMODE(files[path].mode) == 0o755, path
        assert img.read(path) == want.read_bytes(), path  # the very binaries the tests prove
    link = files["usr/local/bin/cuda-checkpoint"]
    assert link.issym() and link.linkname == "dynsnap-cuda"  # what CRIU's CUDA plugin execs
    assert stat.S_IMODE(files["usr/local/bin/dynsnap-install-node-tools"].mode) == 0o755
    assert "usr/bin/ss" in files and "usr/sbin/nft" in files  # ss -K; nft for a cut-off dump's network lock
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
