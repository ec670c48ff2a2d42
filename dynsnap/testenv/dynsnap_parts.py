"""dynsnap's own parts in the local environment: its CRD and the agent's shipped RBAC installed in
the local cluster, a service-account token for the agent from the TokenRequest API, the node agent
started as a process of its own (where a test plays the node's agent itself), and the stub CUDA driver
the agent's dynsnap-cuda loads (``stub_libcuda`` and ``stub_nvml``: no GPU here; they stand in for the
NVIDIA driver) and the workers map (so the agent finds GPU processes the way it does on a node: by
what they map).

Layer: ``dynsnap.testenv``. The agent runs as ``python -m dynsnap agent``: nothing here imports it.
Runs from a checkout (the stub driver's C sources are under tests/native/).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import yaml

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Conflict
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.crd import workersnapshot_crd
from dynsnap.runtime import procfs
from dynsnap.testenv.cluster import LocalCluster, PodRef
from dynsnap.testenv.process import Supervised

ROOT = Path(__file__).resolve().parents[2]  # the checkout
STUB_SRC = ROOT / "tests" / "native" / "stub_libcuda" / "stub_libcuda.c"
STUB_SRCS = [STUB_SRC, STUB_SRC.parent / "stub_process.c"]  # the checkpoint API; a process's own calls
NVML_SRC = ROOT / "tests" / "native" / "stub_nvml" / "stub_nvml.c"
AGENT_NS = "dynsnap-system"
AGENT_SA = "dynsnap-agent"


def _cuda_include() -> str:
    cands = [os.environ.get("DYNSNAP_CUDA_INCLUDE", "")]
    cache = os.environ.get("DYNSNAP_CACHE", os.path.expanduser("~/.cache/dynsnap"))
    cands += sorted(glob.glob(f"{cache}/cuda-headers-*/include"), reverse=True)
    for c in cands:
        if c and (Path(c) / "cuda.h").is_file():
            return c
    raise FileNotFoundError("no CUDA 13 cuda.h: run ./run setup")


NSKEY_SHIFT = 22  # stub_libcuda's nskey: a process's key is (pid namespace inode << 22) | pid in it


@dataclass(frozen=True)
class StubDriver:
    """stub_libcuda + stub_nvml built as libcuda.so.1 / libnvidia-ml.so.1 (stands in for the NVIDIA
    driver), with a state directory keyed by pid namespace (``nskey``), so a process's checkpoint
    state survives an in-place CRIU restore as the real driver's (kept inside the process) does."""

    dir: Path

    @property
    def libcuda(self) -> Path:
        return self.dir / "lib" / "libcuda.so.1"

    @property
    def libnvml(self) -> Path:
        return self.dir / "lib" / "libnvidia-ml.so.1"

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"

    def env(self) -> dict[str, str]:
        return {"DYNSNAP_LIBCUDA": str(self.libcuda), "DYNSNAP_LIBNVML": str(self.libnvml),
                "DYNSNAP_STUB_DIR": str(self.state_dir)}

    def control_lines(self) -> list[str]:
        f = self.state_dir / "control"
        return f.read_text().splitlines() if f.exists() else []

    def set_control(self, lines: list[str]) -> None:
        """Replace the control file whole (a rename): the stub reads it on every call, from other
        processes while a test changes it, and a truncated file read mid-write would drop ``nskey 0``
        (a process's state then looked up under its host pid: a lock seen as never taken)."""
        f = self.state_dir / "control"
        tmp = f.with_name(f".control.{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, f)

    def control(self, line: str) -> None:
        self.set_control([*self.control_lines(), line])

    def clear_faults(self) -> None:
        self.set_control(["nskey 0"])

    def states(self) -> dict[int, int]:
        f = self.state_dir / "state"
        if not f.exists():
            return {}
        return {int(k): int(v) for k, v in (line.split() for line in f.read_text().splitlines() if line.strip())}

    def queries(self) -> list[tuple[int, int]]:
        """Every answered ``cuCheckpointProcessGetState``, in order: (pid, state), the state as in
        :meth:`states` (0 running, 1 locked, 2 checkpointed, 3 failed)."""
        f = self.state_dir / "queries"
        if not f.exists():
            return []
        out = []
        for line in f.read_text().splitlines():
            kv = dict(x.split("=", 1) for x in line.split()[1:])
            out.append((int(kv["pid"]), int(kv["state"])))
        return out

    def calls(self) -> list[str]:
        f = self.state_dir / "log"
        return f.read_text().splitlines() if f.exists() else []

    def key_of(self, host_pid: int) -> int:
        """The key the stub keeps a process's state and memory under (``nskey``): its pid namespace's
        inode and its pid there."""
        nspid = next(int(line.split()[-1]) for line in Path(f"/proc/{host_pid}/status").read_text().splitlines()
                     if line.startswith("NSpid:"))
        return (os.stat(f"/proc/{host_pid}/ns/pid").st_ino << NSKEY_SHIFT) | nspid

    def holds(self) -> list[str]:
        """The stub's holds log: ``hold <call> key=<key> state=<state>`` when a process's own call
        starts waiting for its locked or checkpointed state, ``release <call> key=... ms=... rc=...``
        when it returns (stub_libcuda.c, "The hold")."""
        f = self.state_dir / "holds"
        return f.read_text().splitlines() if f.exists() else []

    def allocations(self) -> dict[int, tuple[int, int, bool]]:
        """Device memory processes allocated themselves: key -> (device, bytes, on the device)
        (a checkpointed process's is not)."""
        f = self.state_dir / "alloc"
        if not f.exists():
            return {}
        out = {}
        for line in f.read_text().splitlines():
            key, dev, n, resident = (int(v) for v in line.split())
            out[key] = (dev, n, bool(resident))
        return out

    def free_bytes(self, device: int = 0) -> int:
        """The fake device's free memory (80 GiB of 80 until anything was allocated)."""
        f = self.state_dir / "devices"
        if not f.exists():
            return 80 << 30
        return int(f.read_text().splitlines()[device].split()[1])

    def forget_pid_namespace(self, inode: int) -> int:
        """Drop the state of every process of the pid namespace ``inode`` (``nskey`` keys), as the
        stub's lock serialises it, and give back the device memory they held (the real driver frees
        a dead process's); returns how many states. Call it when that namespace's pod is gone: its
        processes can never be restored, and the real driver's state (inside the process) went with
        them. Kept, it would be inherited by a later pod whose pid namespace gets the same inode number
        (the kernel reuses them) and whose GPU process has the same pid in it, which would then look
        checkpointed to the agent from its first moment."""
        f = self.state_dir / "state"
        with open(self.state_dir / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._forget_allocations(inode)
            if not f.exists():
                return 0
            lines = [line for line in f.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if int(line.split()[0]) >> NSKEY_SHIFT != inode]
            f.write_text("".join(f"{line}\n" for line in kept))
            return len(lines) - len(kept)

    def forget_dead_namespaces(self) -> list[int]:
        """:meth:`forget_pid_namespace` for every pid namespace the state or the allocations name that
        no process is in any more (its pod is gone); returns them, sorted. chart_node.deploy_example
        calls it before a graph's pods exist, so no pod inherits a deleted pod's state."""
        named = {k >> NSKEY_SHIFT for k in self.states()}
        alloc = self.state_dir / "alloc"
        if alloc.exists():
            named |= {int(line.split()[0]) >> NSKEY_SHIFT for line in alloc.read_text().splitlines() if line.strip()}
        live = {procfs.pid_ns(pid) for pid in procfs.pids()}
        dead = sorted(named - live)
        for inode in dead:
            self.forget_pid_namespace(inode)
        return dead

    def _forget_allocations(self, inode: int) -> None:
        """Under the lock: the namespace's allocations leave the alloc file, and what was on a device
        (not checkpointed) goes back to its free bytes."""
        f, devf = self.state_dir / "alloc", self.state_dir / "devices"
        if not f.exists() or not devf.exists():
            return
        lines = [line.split() for line in f.read_text().splitlines() if line.strip()]
        gone = [x for x in lines if int(x[0]) >> NSKEY_SHIFT == inode]
        if not gone:
            return
        devs = [line.split() for line in devf.read_text().splitlines() if line.strip()]
        for _, dev, n, resident in gone:
            if resident == "1" and 0 <= int(dev) < len(devs):
                devs[int(dev)][1] = str(int(devs[int(dev)][1]) + int(n))
        # stage then rename, as the stub writes them: its readers take no lock
        for path, rows in ((devf, devs), (f, [x for x in lines if x not in gone])):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(" ".join(x) + "\n" for x in rows))
            os.replace(tmp, path)


def build_stub_driver(out: Path) -> StubDriver:
    (out / "lib").mkdir(parents=True, exist_ok=True)
    (out / "state").mkdir(parents=True, exist_ok=True)
    inc = _cuda_include()
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{inc}", "-o",
                    str(out / "lib" / "libcuda.so.1"), *map(str, STUB_SRCS)], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{STUB_SRC.parent}", "-o",
                    str(out / "lib" / "libnvidia-ml.so.1"), str(NVML_SRC)], check=True)
    d = StubDriver(out)
    d.clear_faults()
    return d


async def install_dynsnap(cluster: LocalCluster) -> None:
    """dynsnap's CRD (generated from the models) and the shipped RBAC of the agent, the controller
    and the CLI's user from deploy/rbac/ (idempotent)."""
    await cluster.install_crd(workersnapshot_crd())
    with contextlib.suppress(Conflict):
        await cluster.api.create(R.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": AGENT_NS}})
    kinds = {"ServiceAccount": R.SERVICE_ACCOUNTS, "ClusterRole": R.CLUSTER_ROLES,
             "ClusterRoleBinding": R.CLUSTER_ROLE_BINDINGS, "Role": R.ROLES, "RoleBinding": R.ROLE_BINDINGS}
    for path in sorted((ROOT / "deploy" / "rbac").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                await cluster.api.apply(kinds[doc["kind"]], doc, force=True)


async def token_kubeconfig(cluster: LocalCluster, *, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig for ``sa`` with a token from the TokenRequest API (as a projected token would be)."""
    assert cluster.cp is not None and cluster.cp.pki is not None
    res = await cluster.api.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
              "spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 7200}})
    token = res["status"]["token"]
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "sa",
           "clusters": [{"name": "c", "cluster": {"server": cluster.cp.url,
                                                  "certificate-authority": str(cluster.cp.pki.ca_cert)}}],
           "users": [{"name": sa, "user": {"token": token}}],
           "contexts": [{"name": "sa", "context": {"cluster": "c", "user": sa}}]}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


@dataclass
class AgentProc:
    """``dynsnap agent`` for one node, as its own process under the agent's service account (a fake
    node's; or the real node's in place of the chart's agent pod, with that pod's host directories)."""

    node: str
    kubeconfig: Path
    workdir: Path
    driver: StubDriver
    extra: list[str] = field(default_factory=list)
    proc: Supervised | None = None
    env: dict[str, str] = field(default_factory=dict)  # more environment for the agent process
    images: Path | None = None  # --images-root; None: under workdir
    cuda_state: Path | None = None  # --state-dir; None: under workdir

    @property
    def images_root(self) -> Path:
        return self.images or self.workdir / "images"

    @property
    def state_dir(self) -> Path:
        return self.cuda_state or self.workdir / "cuda-state"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"agent-{self.node}.log"

    def argv(self) -> list[str]:
        native = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
        args = [sys.executable, "-m", "dynsnap", "-v", "agent", "--kubeconfig", str(self.kubeconfig),
                "--node-name", self.node, "--images-root", str(self.images_root), "--state-dir", str(self.state_dir),
                "--cuda-helper", str(native / "dynsnap-cuda"), "--criu", os.environ["DYNSNAP_CRIU"],
                "--nsexec", str(native / "dynsnap-nsexec"), "--health-port", "0", "--failure-backoff", "2",
                "--scrape-interval", "1", "--activity-granularity", "0"]
        for k, v in self.driver.env().items():
            args += ["--cuda-env", f"{k}={v}"]
        return args + self.extra

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DYNSNAP_AGENT_")}
        env.update(self.env)
        self.proc = Supervised(f"agent-{self.node}", self.argv(), log_path=self.log_path, env=env)
        await self.proc.start()

    async def stop(self, *, grace: float = 10.0) -> None:
        if self.proc is not None:
            await self.proc.stop(grace=grace)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a node losing its agent pod would (no cleanup of any kind)."""
        assert self.proc is not None and self.proc.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)

    def tail(self, n: int = 60) -> str:
        return self.proc.tail(n) if self.proc else "(not started)"


CONTROLLER_SA = "dynsnap-controller"


class PodOnNode(PodRef, Protocol):
    """A pod by its identity, and its node."""

    @property
    def node(self) -> str: ...


def ws_body(pod: PodOnNode, *, tier: str, desired: str = "Active", container: str = "main") -> Obj:
    """The WorkerSnapshot the controller would make for ``pod`` (for tests that play the controller)."""
    return {"apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
            "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": {P.LABEL_NODE: pod.node},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod.name, "uid": pod.uid,
                                              "blockOwnerDeletion": False}]},
            "spec": {"podName": pod.name, "podUID": pod.uid, "container": container, "tier": tier,
                     "desiredState": desired}}


async def set_desired(api: Kube, pod: PodOnNode, desired: str) -> None:
    await api.merge_patch(R.WORKER_SNAPSHOTS, pod.name, {"spec": {"desiredState": desired}}, namespace=pod.namespace)


