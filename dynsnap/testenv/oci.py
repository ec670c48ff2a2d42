"""dynsnap's images run as containers in the local environment: an OCI image layout read back
(index, manifest, config, layer blobs, each checked against its digest), its layers unpacked into
a bundle's root filesystem, a runtime config made from ``crun spec`` plus what the image says
(entrypoint, cmd, env, user) and what a pod spec would add (the service-account token where
in-cluster config looks for it, ``KUBERNETES_SERVICE_HOST``/``_PORT``, host namespaces, host
paths, a privileged security context), and the container run under crun, the OCI runtime from
Debian. This stands in for kubelet + containerd on a node: the image, the runtime and the
container's view of the node are real; the pod around it is what :class:`PodSpec` says.

Layer: ``dynsnap.testenv``. Needs root, ``crun`` (``$DYNSNAP_CRUN``) and GNU tar. Containers run
without a cgroup manager (``--cgroup-manager=disabled``): they stay in the test process's cgroups,
so the harness's own limits keep applying and no cgroup is left behind.
"""

from __future__ import annotations

import asyncio
import copy
import gzip
import hashlib
import json
import os
import resource
import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynsnap.runtime.command import run_command
from dynsnap.testenv.cluster import LocalCluster
from dynsnap.testenv.process import Supervised, require_binary

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where in-cluster config reads (k8s/config.py)

# Every capability of kernel 6.x, in the order of their numbers.
ALL_CAPS = [f"CAP_{c}" for c in (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE")]


def privileged_caps() -> list[str]:
    """What a privileged container gets: every capability the runtime itself may grant (this
    process's bounding set; where the test machine withholds one, no container can have it)."""
    status = Path("/proc/self/status").read_text()
    bounding = int(status.split("CapBnd:", 1)[1].split()[0], 16)
    return [c for i, c in enumerate(ALL_CAPS) if bounding >> i & 1]


def crun_binary() -> Path:
    return require_binary(os.environ.get("DYNSNAP_CRUN") or shutil.which("crun"), "crun", "DYNSNAP_CRUN")


def _hybrid_cgroup_workaround() -> list[str]:
    """What crun must run under on a host with hybrid cgroups (v1 hierarchies and a v2 one with
    controllers, as this machine has): crun refuses such a host before it looks at its cgroup
    manager, even ``disabled``. In a private mount namespace without the v2 mount it sees a
    v1-only host; the host's mounts are untouched, and with no cgroup manager crun uses neither."""
    try:
        controllers = Path("/sys/fs/cgroup/unified/cgroup.controllers").read_text().strip()
    except OSError:
        return []
    if not controllers:
        return []
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'umount -l /sys/fs/cgroup/unified && exec "$0" "$@"']


def image_layout(name: str) -> Path:
    """The OCI layout of one of dynsnap's images as setup built it (``$DYNSNAP_IMAGES/<name>``)."""
    root = os.environ.get("DYNSNAP_IMAGES")
    if not root or not (Path(root) / ".complete").is_file():
        raise FileNotFoundError("DYNSNAP_IMAGES is not set or not complete; run `./run setup` (hack/lib-images.sh)")
    return Path(root) / name


def _sha256_file(path: Path, *, gunzip: bool = False) -> str:
    h = hashlib.sha256()
    with (gzip.open(path, "rb") if gunzip else open(path, "rb")) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


@dataclass(frozen=True)
class OciImage:
    """One image of an OCI image layout (its index names exactly one manifest)."""

    layout: Path
    index: dict[str, Any]
    manifest: dict[str, Any]
    config: dict[str, Any]

    @classmethod
    def load(cls, layout: Path) -> OciImage:
        index = json.loads((layout / "index.json").read_text())
        if len(index["manifests"]) != 1:
            raise ValueError(f"{layout}: expected one manifest, found {len(index['manifests'])}")
        manifest = json.loads(cls._blob_path(layout, index["manifests"][0]["digest"]).read_text())
        config = json.loads(cls._blob_path(layout, manifest["config"]["digest"]).read_text())
        return cls(layout, index, manifest, config)

    @staticmethod
    def _blob_path(layout: Path, digest: str) -> Path:
        algo, hexd = digest.split(":", 1)
        return layout / "blobs" / algo / hexd

    @property
    def ref_name(self) -> str:
        return str(self.index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])

    @property
    def image_config(self) -> dict[str, Any]:
        return dict(self.config.get("config") or {})

    @property
    def entrypoint(self) -> list[str]:
        return list(self.image_config.get("Entrypoint") or [])

    @property
    def cmd(self) -> list[str]:
        return list(self.image_config.get("Cmd") or [])

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.image_config.get("Env") or [])

    @property
    def user(self) -> tuple[int, int]:
        """The numeric uid:gid the image runs as (dynsnap's images name numbers, not names)."""
        u = str(self.image_config.get("User") or "0:0")
        uid, _, gid = u.partition(":")
        return int(uid), int(gid or uid)

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.image_config.get("Labels") or {})

    def layer_paths(self) -> list[Path]:
        return [self._blob_path(self.layout, lay["digest"]) for lay in self.manifest["layers"]]

    def verify(self) -> None:
        """Every blob's bytes match its digest and size, and each layer's uncompressed bytes match
        the config's diff_id (what a registry or a runtime checks before trusting an image)."""
        man_desc = self.index["manifests"][0]
        for desc in [man_desc, self.manifest["config"], *self.manifest["layers"]]:
            p = self._blob_path(self.layout, desc["digest"])
            if _sha256_file(p) != desc["digest"] or p.stat().st_size != desc["size"]:
                raise ValueError(f"{p}: bytes do not match descriptor {desc['digest']} ({desc['size']} bytes)")
        diff_ids = self.config["rootfs"]["diff_ids"]
        if len(diff_ids) != len(self.manifest["layers"]):
            raise ValueError(f"{self.layout}: {len(diff_ids)} diff_ids for {len(self.manifest['layers'])} layers")
        for p, diff_id in zip(self.layer_paths(), diff_ids, strict=True):
            if _sha256_file(p, gunzip=True) != diff_id:
                raise ValueError(f"{p}: uncompressed bytes do not match diff_id {diff_id}")

    def members(self) -> Iterator[tarfile.TarInfo]:
        """Every entry of every layer, lowest layer first (later entries of a path win)."""
        for p in self.layer_paths():
            with tarfile.open(p, "r:gz") as tf:
                yield from tf

    def files(self) -> dict[str, tarfile.TarInfo]:
        """The image's file system as the runtime sees it: path (no leading ./) -> its top entry."""
        out: dict[str, tarfile.TarInfo] = {}
        for m in self.members():
            name = m.name[2:] if m.name.startswith("./") else m.name
            if os.path.basename(name).startswith(".wh."):
                raise ValueError(f"{self.layout}: whiteout {name}: dynsnap's images never delete in a layer")
            out[name.rstrip("/") or "."] = m
        return out

    def read(self, path: str) -> bytes:
        """The bytes of a regular file of the image (its top layer's copy)."""
        data: bytes | None = None
        for p in self.layer_paths():
            with tarfile.open(p, "r:gz") as tf:
                for m in tf:
                    if m.name in (f"./{path}", path) and m.isfile():
                        f = tf.extractfile(m)
                        assert f is not None
                        data = f.read()
        if data is None:
            raise FileNotFoundError(f"{path} is not a regular file in {self.layout}")
        return data

    async def unpack(self, rootfs: Path) -> None:
        """The layers, in order, into ``rootfs`` (owners, modes and times kept: we are root)."""
        os.makedirs(rootfs, exist_ok=True)
        for p in self.layer_paths():
            await run_command(["tar", "--numeric-owner", "-xpzf", str(p), "-C", str(rootfs)], timeout=300)


async def service_account_token(cluster: LocalCluster, *, namespace: str, sa: str, seconds: int = 7200) -> str:
    """A token for ``sa`` from the TokenRequest API, as kubelet's projected volume gets one."""
    res = await cluster.api.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
              "spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": seconds}})
    return str(res["status"]["token"])


def write_service_account_dir(path: Path, *, token: str, ca_pem: bytes, namespace: str) -> Path:
    """The files of the kube-api-access projected volume (mode 0644, its defaultMode)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, data in (("token", token.encode()), ("ca.crt", ca_pem), ("namespace", namespace.encode())):
        (path / name).write_bytes(data)
        (path / name).chmod(0o644)
    return path


@dataclass
class Mount:
    """A host path in the container (a hostPath or a kubelet-managed volume)."""

    source: Path
    destination: str
    readonly: bool = False


@dataclass
class PodSpec:
    """What a pod spec says about one container, in the terms of the runtime config."""

    name: str
    args: list[str] | None = None                  # the container's args (override the image's Cmd)
    command: list[str] | None = None               # the container's command (overrides the Entrypoint)
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    host_namespaces: tuple[str, ...] = ()          # of pid, network, ipc, uts (hostPID, hostNetwork, hostIPC)
    netns: str | None = None                       # a named network namespace (/run/netns/<netns>): the pod's
    cgroupns: bool = False                         # a cgroup namespace of its own (a cgroup v2 node's default)
    privileged: bool = False
    readonly_root: bool = False                    # readOnlyRootFilesystem
    drop_all_caps: bool = False                    # capabilities: drop: [ALL] (and no privilege escalation)
    caps_add: tuple[str, ...] = ()                 # with drop_all_caps: capabilities: add: [...] (FOWNER)
    user: tuple[int, int] | None = None            # runAsUser/runAsGroup (default: the image's)


def runtime_config(base: dict[str, Any], image: OciImage, pod: PodSpec, *, rootfs: Path,
                   etc_files: dict[str, Path]) -> dict[str, Any]:
    """``crun spec``'s config edited into this container's (see the module docstring)."""
    cfg = copy.deepcopy(base)
    proc = cfg["process"]
    proc["terminal"] = False
    proc["args"] = (pod.command if pod.command is not None else image.entrypoint) + (
        pod.args if pod.args is not None else image.cmd)
    if not proc["args"]:
        raise ValueError(f"{pod.name}: nothing to run (no command and the image has no Entrypoint/Cmd)")
    env = {**image.env, **pod.env}
    proc["env"] = [f"{k}={v}" for k, v in env.items()]
    uid, gid = pod.user or image.user
    proc["user"] = {"uid": uid, "gid": gid}
    proc["cwd"] = image.image_config.get("WorkingDir") or "/"
    # containerd's default (a node agent and CRIU open many files), within what this kernel allows.
    nofile = min(1048576, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    proc["rlimits"] = [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}]
    cfg["root"] = {"path": str(rootfs), "readonly": pod.readonly_root}
    cfg["hostname"] = pod.name
    linux = cfg["linux"]
    # crun spec's pid, network, ipc, uts and mount namespaces; a cgroup namespace when asked for
    # (containerd gives every container one on a cgroup v2 node, none on a v1 node like this one).
    namespaces = [ns for ns in linux["namespaces"] if ns["type"] not in pod.host_namespaces]
    if pod.cgroupns:
        namespaces.append({"type": "cgroup"})
    if pod.netns:
        namespaces = [ns for ns in namespaces if ns["type"] != "network"]
        namespaces.append({"type": "network", "path": f"/run/netns/{pod.netns}"})
    linux["namespaces"] = namespaces
    linux.pop("resources", None)  # no cgroup manager: nothing would apply them
    if "uts" in pod.host_namespaces:
        cfg.pop("hostname", None)  # the node's own host name (hostNetwork)
    if pod.privileged:
        caps = privileged_caps()
        proc["capabilities"] = {k: list(caps) for k in ("bounding", "effective", "permitted")}
        proc["noNewPrivileges"] = False
        linux["maskedPaths"], linux["readonlyPaths"] = [], []
        for m in cfg["mounts"]:
            if m["destination"] in ("/sys", "/sys/fs/cgroup"):
                m["options"] = [o for o in m.get("options", []) if o != "ro"]
    elif pod.drop_all_caps:
        added = [f"CAP_{c}" for c in pod.caps_add]
        proc["capabilities"] = {k: list(added) for k in ("bounding", "effective", "permitted")}
        proc["capabilities"] |= {"inheritable": [], "ambient": []}
        proc["noNewPrivileges"] = True  # allowPrivilegeEscalation: false
    mounts: list[dict[str, Any]] = list(cfg["mounts"])
    for dest, src in etc_files.items():
        mounts.append({"destination": dest, "type": "bind", "source": str(src), "options": ["bind", "ro"]})
    # Parents before children (a volume inside another volume's path), as containerd orders them.
    for m in sorted(pod.mounts, key=lambda m: len(Path(m.destination).parts)):
        mounts.append({"destination": m.destination, "type": "bind", "source": str(m.source),
                       "options": ["rbind", "ro" if m.readonly else "rw"]})
    cfg["mounts"] = mounts
    return cfg


@dataclass
class Container:
    """One container of ``image`` under crun, with its bundle (config.json + rootfs) in ``bundle``.
    ``rootfs`` may be shared by several containers of one image when their roots are read-only."""

    id: str
    image: OciImage
    pod: PodSpec
    bundle: Path
    state_root: Path
    rootfs: Path | None = None
    pod_ip: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    proc: Supervised | None = None

    @property
    def log_path(self) -> Path:
        return self.bundle / "container.log"

    async def prepare(self) -> None:
        self.bundle.mkdir(parents=True, exist_ok=True)
        if self.rootfs is None:
            self.rootfs = self.bundle / "rootfs"
            await self.image.unpack(self.rootfs)
        crun = str(crun_binary())
        spec = self.bundle / "crun-spec.json"
        spec.unlink(missing_ok=True)
        await run_command([crun, "spec", "-b", str(self.bundle), "-f", str(spec)], timeout=30)
        base = json.loads(spec.read_text())
        # What kubelet puts over /etc: no nameserver (nothing outside the test network may be
        # contacted; a lookup fails at once), the pod's own name and address.
        etc = self.bundle / "etc"
        etc.mkdir(exist_ok=True)
        (etc / "resolv.conf").write_text("# dynsnap test container: no DNS\noptions timeout:1 attempts:1\n")
        (etc / "hostname").write_text(self.pod.name + "\n")
        (etc / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost\n" +
                                   (f"{self.pod_ip}\t{self.pod.name}\n" if self.pod_ip else ""))
        etc_files = {f"/etc/{n}": etc / n for n in ("resolv.conf", "hostname", "hosts")}
        self.config = runtime_config(base, self.image, self.pod, rootfs=self.rootfs, etc_files=etc_files)
        (self.bundle / "config.json").write_text(json.dumps(self.config, indent=1))

    def _crun(self, *args: str) -> list[str]:
        return [*_hybrid_cgroup_workaround(), str(crun_binary()), f"--root={self.state_root}",
                "--cgroup-manager=disabled", *args]

    async def start(self) -> None:
        """``crun run`` in the foreground, its output (the container's) to :attr:`log_path`."""
        if not self.config:
            await self.prepare()
        self.state_root.mkdir(parents=True, exist_ok=True)
        await self.delete()  # a container of this id left by an interrupted run
        self.proc = Supervised(self.id, self._crun("run", "--bundle", str(self.bundle), self.id),
                               log_path=self.log_path)
        await self.proc.start()

    async def run_to_completion(self, *, timeout: float) -> int:
        """Start it and wait for it to exit (an init container); its exit status."""
        await self.start()
        assert self.proc is not None and self.proc.proc is not None
        try:
            async with asyncio.timeout(timeout):
                rc = await self.proc.proc.wait()
        finally:
            await self.stop()
        return rc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    async def pid(self) -> int | None:
        """The container's init process as the host sees it."""
        res = await run_command(self._crun("state", self.id), timeout=10, check=False)
        if res.returncode != 0:
            return None
        state = json.loads(res.stdout)
        return int(state["pid"]) if state.get("status") == "running" and state.get("pid") else None

    async def kill(self, signal: str = "KILL") -> None:
        await run_command(self._crun("kill", self.id, signal), timeout=10, check=False)

    async def stop(self, *, grace: float = 10.0) -> None:
        """SIGTERM (as kubelet does), SIGKILL after ``grace``, then the container is deleted."""
        if self.proc is not None and self.proc.alive():
            await self.kill("TERM")
            assert self.proc.proc is not None
            try:
                async with asyncio.timeout(grace):
                    await self.proc.proc.wait()
            except TimeoutError:
                await self.kill("KILL")
            await self.proc.stop(grace=5.0)
        await self.delete()

    async def delete(self) -> None:
        await run_command(self._crun("delete", "--force", self.id), timeout=30, check=False)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

