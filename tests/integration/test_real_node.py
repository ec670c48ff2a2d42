"""The real node (dynsnap.testenv.node): kubelet built from the control plane's release, Debian's
containerd and runc, the CNI plugins, registered with the session's API server beside the kwok
nodes, runs a pod from dynsnap's own entrypoint image (hack/lib-images.sh, imported without a
registry) and takes it down again; and the node leaves nothing on the host when it stops.

The node joins the session cluster rather than a cluster of its own: a second control plane would
cost this 2-core machine another etcd and API server for nothing the test needs, and the later
migration of the agent and controller suites puts their pods on exactly this node of that cluster.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.ids import PodUID
from dynsnap.runtime import procfs
from dynsnap.runtime.command import run_command
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster, wait_for
from dynsnap.testenv.node import RealNode, real_node_cidr
from dynsnap.testenv.node_cleanup import CGROUP_FS, bridge_veths
from dynsnap.testenv.node_config import KUBELET_SYSCTLS
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

NODE = "node-real-0"
POD = "real-node-web"
GREETING = "real-node-says-hello"
# The API server asked at the address kubelet gives every container (the kubernetes Service's
# cluster IP: stub_kube_proxy rewrites it in the pod's namespace), in plain HTTP: Go's TLS server
# answers that with a 400 of its own words. Then busybox's httpd as the container's PID 1, serving
# the file its readiness probe asks for.
APISERVER_SAYS = "Client sent an HTTP request to an HTTPS server"
SERVE = "mkdir -p /tmp/www; echo ok > /tmp/www/healthz; exec /bin/busybox httpd -f -p 8080 -h /tmp/www"
WEB = ("echo " + GREETING + "; printf 'GET /livez HTTP/1.0\\r\\n\\r\\n' "
       "| /bin/busybox nc -w 5 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT; echo; " + SERVE)


def _host_sysctls() -> dict[str, str]:
    return {k: Path("/proc/sys", k).read_text().strip() for k in KUBELET_SYSCTLS}


async def _iptables_rules() -> str:
    """The host's iptables rules, every table kubelet would touch ("" without an iptables)."""
    iptables = shutil.which("iptables", path="/usr/sbin:/sbin")
    if iptables is None:
        return ""
    out = [(await run_command([iptables, "-t", t, "-S"], timeout=30)).stdout for t in ("filter", "mangle", "nat")]
    return "".join(out)


def _entrypoint_layout() -> Path:
    images = os.environ.get("DYNSNAP_IMAGES")
    if not images or not (Path(images) / "dynsnap-entrypoint" / "index.json").is_file():
        pytest.fail("$DYNSNAP_IMAGES has no dynsnap-entrypoint layout: run `./run setup` (hack/lib-images.sh)")
    return Path(images) / "dynsnap-entrypoint"


@pytest.fixture(scope="module")
async def real_node(cluster: LocalCluster) -> AsyncIterator[RealNode]:
    assert cluster.cp is not None
    node = RealNode(name=NODE, root=cluster.workdir / "nodes" / NODE, cp=cluster.cp, net=cluster.net,
                    api=cluster.api, pod_cidr=real_node_cidr(cluster.net))
    sysctls, rules = _host_sysctls(), await _iptables_rules()
    t0 = time.monotonic()
    await node.start()
    # For docs/BENCHMARKS.md (a figure, never asserted): containerd up, pause image in, kubelet to Ready.
    print(f"\nreal node {NODE}: started and Ready in {time.monotonic() - t0:.1f} s")
    try:
        yield node
    finally:
        broken = node.failed()
        await node.stop()
        left = await node.leftovers()
        assert not broken, "node parts died during the tests:\n" + "\n".join(broken)
        assert not left, "the real node left things on the host:\n" + "\n".join(left)
        # kubelet read its sysctls from its own copies and found no iptables: the host is as it was.
        assert _host_sysctls() == sysctls
        assert await _iptables_rules() == rules
        with pytest.raises(NotFound):
            await cluster.api.get(R.NODES, NODE)


async def test_node_registered_and_ready(cluster: LocalCluster, real_node: RealNode) -> None:
    node = await cluster.api.get(R.NODES, NODE)
    conds = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conds["Ready"] == "True", conds
    info = node["status"]["nodeInfo"]
    version = (await run_command([str(real_node.bins.kubelet), "--version"], timeout=10)).stdout.split()[-1]  # type: ignore[union-attr]
    assert info["kubeletVersion"] == version
    assert info["containerRuntimeVersion"].startswith("containerd://1.6.20"), info
    assert node["spec"]["podCIDR"] == real_node.pod_cidr
    assert {"type": "InternalIP", "address": real_node.node_ip} in node["status"]["addresses"]
    assert node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"] == real_node.kubelet_port
    # kubelet's heartbeat, written with its own node identity (the Node authorizer lets it).
    lease = await cluster.api.get(R.LEASES, NODE, namespace="kube-node-lease")
    assert lease["spec"]["holderIdentity"] == NODE


async def _pod_log(cluster: LocalCluster, name: str) -> str:
    """``kubectl logs``: the API server fetches it from the node's kubelet (its kubelet-client
    certificate, the kubelet's serving certificate checked against the CA)."""
    assert cluster.cp is not None and cluster.cp.pki is not None
    admin = cluster.cp.identities["admin"].token
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(cluster.cp.pki.ca_cert)), timeout=10,
                                 headers={"Authorization": f"Bearer {admin}"}) as http:
        r = await http.get(f"{cluster.cp.url}/api/v1/namespaces/{TEST_NAMESPACE}/pods/{name}/log",
                           params={"container": "web"})
        r.raise_for_status()
        return r.text


async def test_pod_runs_on_the_real_node(cluster: LocalCluster, real_node: RealNode) -> None:
    image = await real_node.import_image(_entrypoint_layout())
    tag = image.rsplit(":", 1)[1]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": TEST_NAMESPACE},
           "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": 1, "containers": [{
               "name": "web", "image": f"dynsnap-entrypoint:{tag}", "imagePullPolicy": "Never",
               "command": ["/bin/busybox", "sh", "-c", WEB], "ports": [{"containerPort": 8080}],
               "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1}}]}}
    created = await cluster.api.create(R.PODS, pod)
    uid = PodUID(created["metadata"]["uid"])
    live = await cluster.wait_ready(TEST_NAMESPACE, POD, timeout=120)

    ip = live["status"]["podIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(real_node.pod_cidr)
    (status,) = live["status"]["containerStatuses"]
    assert status["ready"] and status["restartCount"] == 0 and "running" in status["state"]
    runtime, _, cid = status["containerID"].partition("://")
    assert runtime == "containerd" and len(cid) == 64
    # The host reaches the pod on the run's bridge, at the IP kubelet reported.
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(f"http://{ip}:8080/healthz")
    assert r.status_code == 200 and r.content == b"ok\n"
    log = await _pod_log(cluster, POD)
    assert GREETING in log
    # The Service's address reached the API server, as kube-proxy would have it.
    assert APISERVER_SAYS in log, log

    # Found the way the agent finds workers: the pod UID in /proc/<pid>/cgroup. Its container is
    # PID 1 of its own pid namespace; its cgroup is kubelet's cgroupfs layout under the node's root,
    # in every v1 hierarchy and (runc in hybrid mode) the unified one.
    pids = procfs.pod_pids(uid)
    web = [p for p in pids if procfs.exe_name(p) == "busybox"]
    assert len(web) == 1, {p: procfs.cmdline(p) for p in pids}
    assert procfs.status(web[0]).nspid[-1] == 1  # type: ignore[union-attr]
    cgroup = Path(f"/proc/{web[0]}/cgroup").read_text()
    print(f"\n/proc/{web[0]}/cgroup of the container's PID 1:\n{cgroup}")
    by_controller = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in cgroup.splitlines()}
    want = f"{real_node.cgroup_root}/kubepods/besteffort/pod{uid}/{cid}"
    for controller in ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "name=systemd", ""):
        assert by_controller.get(controller) == want, (controller, cgroup)
    # The service-account token volume kubelet mounted (in its own mount namespace) reached runc:
    # the container holds the token and the cluster's CA.
    sa = Path(f"/proc/{web[0]}/root/var/run/secrets/kubernetes.io/serviceaccount")
    assert (sa / "token").read_text().count(".") == 2  # a JWT
    assert cluster.cp is not None and cluster.cp.pki is not None
    assert (sa / "ca.crt").read_bytes() == cluster.cp.pki.ca_cert.read_bytes()

    await cluster.api.delete(R.PODS, POD, namespace=TEST_NAMESPACE, grace_period_seconds=1)

    async def gone() -> bool:
        try:
            await cluster.api.get(R.PODS, POD, namespace=TEST_NAMESPACE)
        except NotFound:
            return True
        return False
    await wait_for(f"pod {POD} deleted by its kubelet", gone, timeout=60)
    # kubelet confirmed the deletion only after stopping the container and the sandbox: no process
    # of the pod, no pod cgroup, no pod veth on the bridge, nothing running in containerd.
    assert procfs.pod_pids(uid) == []
    assert not list(CGROUP_FS.glob(f"*/{real_node.cgroup_root.strip('/')}/kubepods/*/pod{uid}"))
    assert await bridge_veths(real_node.net.bridge) == []
    tasks = (await run_command(real_node.ctr_argv("tasks", "ls"), timeout=30)).stdout
    assert "RUNNING" not in tasks, tasks


async def test_endpointslice_follows_kubelets_readiness_with_the_gate(cluster: LocalCluster,
                                                                      real_node: RealNode) -> None:
    """The real kube-controller-manager's EndpointSlice controller follows the readiness kubelet computes
    for a pod with dynsnap's readiness gate (moved from the sandbox's test_endpointslice_gc.py): a gate
    nobody set counts False (probe passing, pod not Ready, endpoint published not ready), and each flip
    of the gate, set as dynsnap sets it, moves kubelet's Ready and the endpoint with it."""
    api = cluster.api
    tag = (await real_node.import_image(_entrypoint_layout())).rsplit(":", 1)[1]
    name, labels = "real-node-gated", {"app": "real-node-gated"}
    await api.create(R.SERVICES, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": TEST_NAMESPACE},
        "spec": {"clusterIP": "None", "selector": labels, "ports": [{"name": "http", "port": 8080}]}})
    created = await api.create(R.PODS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": TEST_NAMESPACE, "labels": labels},
        "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": 1,
                 "readinessGates": [{"conditionType": P.CONDITION_SERVING}],
                 "containers": [{"name": "web", "image": f"dynsnap-entrypoint:{tag}", "imagePullPolicy": "Never",
                                 "command": ["/bin/busybox", "sh", "-c", SERVE],
                                 "ports": [{"name": "http", "containerPort": 8080}],
                                 "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"},
                                                    "periodSeconds": 1}}]}})
    live = await cluster.wait_pod_ip(TEST_NAMESPACE, name, timeout=120)
    pod = NodePod(name, TEST_NAMESPACE, created["metadata"]["uid"], live["status"]["podIP"], NODE)
    selector = f"kubernetes.io/service-name={name}"

    async def container_ready_gate_unset() -> bool:
        conds = {c["type"]: c["status"] for c in (await api.get(R.PODS, name, namespace=TEST_NAMESPACE))
                 ["status"].get("conditions") or []}
        return conds.get("ContainersReady") == "True" and conds.get("Ready") == "False"

    async def endpoint_ready(want: bool) -> bool:
        ep = await cluster.endpoint_of(pod, label_selector=selector)  # type: ignore[arg-type]  # its UID
        return ep is not None and ep["conditions"].get("ready") is want and ep["addresses"] == [pod.ip]

    try:
        await wait_for("containers ready, pod not Ready", container_ready_gate_unset, timeout=60)
        await wait_for("endpoint published not ready", lambda: endpoint_ready(False), timeout=60)
        for serving in (True, False, True):
            await cluster.set_serving_gate(pod, serving)
            await cluster.wait_ready(TEST_NAMESPACE, name, ready=serving, timeout=30)
            await wait_for(f"endpoint ready={serving}", lambda s=serving: endpoint_ready(s), timeout=60)
    finally:
        with contextlib.suppress(NotFound):
            await api.delete(R.PODS, name, namespace=TEST_NAMESPACE, grace_period_seconds=1)
        await api.delete(R.SERVICES, name, namespace=TEST_NAMESPACE)

    async def gone() -> bool:
        try:
            await api.get(R.PODS, name, namespace=TEST_NAMESPACE)
        except NotFound:
            return True
        return False
    await wait_for(f"pod {name} deleted by its kubelet", gone, timeout=60)
