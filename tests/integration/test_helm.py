"""deploy/helm/dynsnap with the real helm (``$DYNSNAP_HELM``) against the local API server, as a
platform engineer would use it: ``helm lint``, ``helm install``, ``helm upgrade`` with changed
values, ``helm uninstall``; and what the uninstall does to a sleeping worker.

kwok runs no containers and this control plane runs no Deployment, DaemonSet or Job controller, so
what the chart's workloads would run is played by processes, each named for what it stands in for
and each under the identity the chart created (tokens from the TokenRequest API for the chart's own
service accounts, so the chart's RBAC is what they get):

- ``stand_in_controller``: the controller Deployment's pod: ``dynsnap`` with the container's args
  and its environment as the API server holds them (the downward API resolved: POD_NAME as the
  Lease identity, the release namespace as the Lease's), ``--health-port 0`` added (flags win; a
  fixed port could collide on this shared machine);
- ``AgentProc`` per fake node: the agent DaemonSet's pods (with the local environment's paths);
- ``stub_job_runner``: the Job controller and a kubelet for the uninstall hook: it runs the Job's
  container command exactly as rendered, as its own process under the Job's service account, then
  writes the Job's status as the Job controller would (Complete on exit 0, Failed otherwise).

What is asserted: the objects the API server holds after install (the CRD from the chart's crds/,
service accounts, RBAC with deploy/rbac's rules, Deployment, DaemonSet) and who may do what
(SubjectAccessReviews); the controller and the agents doing their job under the chart's RBAC (a
worker captured); the live objects after an upgrade. Then two uninstalls. The first while the
sleeping worker's node has no agent: the hook cannot get it woken, fails when its time is up, and
helm stops there, the DaemonSet and the Deployment still installed (the agent, back, wakes it). The
second, with the worker asleep again: in order, the worker woken by the agent and verified by the
controller while the DaemonSet and the Deployment still exist (helm waits on the hook), then
everything of the release gone but the CRD, and the woken worker answering requests pinned to it
with dynsnap gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from controllerenv import asleep, get_ws, policy, verified_after

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import ApiError, Conflict, NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.models.resources import Resource
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, wait_for
from dynsnap.testenv.dynsnap_parts import (
    ROOT,
    AgentProc,
    build_stub_driver,
    install_dynsnap,
    token_kubeconfig,
)
from dynsnap.testenv.process import Supervised

pytestmark = pytest.mark.cluster

CHART = ROOT / "deploy" / "helm" / "dynsnap"
RELEASE = "dynsnap-it"  # not "dynsnap": other tests install deploy/rbac's objects under those names
NS = "dynsnap-helm"
CONTROLLER, AGENT, USER, HOOK_SA = (f"{RELEASE}-{s}" for s in ("controller", "agent", "user", "uninstall"))
HOOK_JOB = f"{RELEASE}-wake-all"
CRD_NAME = f"{P.WS_PLURAL}.{P.DYNSNAP_GROUP}"
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
DAEMON_SETS = Resource("apps", "v1", "daemonsets", "DaemonSet")
JOBS = Resource("batch", "v1", "jobs", "Job")
SARS = Resource("authorization.k8s.io", "v1", "subjectaccessreviews", "SubjectAccessReview", namespaced=False)
HELM_BOUND = 180.0  # a helm command running longer than this is stuck: the test fails instead of hanging
# uninstall.timeout after the upgrade: what the hook's `dynsnap wake --all` may take. A wake and its
# verification take a few seconds here; the failing attempt waits all of it.
HOOK_TIMEOUT = 30
INSTALL_VALUES = [
    # Local timing (the defaults are for real clusters), passed the way a user would.
    "controller.scrapeInterval=1", "controller.verifyTimeout=30", "controller.quiesceTimeout=60",
    "controller.verbose=true",  # every reconcile in the stand-in's log
]


@dataclass
class Helm:
    """The helm binary with a kubeconfig (the cluster's admin: a platform engineer installs the
    chart) and helm's own directories kept under the test's work dir."""

    bin: str
    kubeconfig: Path
    home: Path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_") and k != "KUBECONFIG"}
        return env | {"KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(self.home / "cache"),
                      "HELM_CONFIG_HOME": str(self.home / "config"), "HELM_DATA_HOME": str(self.home / "data")}

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(self.bin, *args, env=self.env(), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT,
                                                    stdin=asyncio.subprocess.DEVNULL)

    @staticmethod
    async def finish(proc: asyncio.subprocess.Process, what: str, timeout: float = HELM_BOUND) -> tuple[int, str]:
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"{what} did not finish within {timeout:.0f}s") from None
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace")

    async def run(self, *args: str) -> tuple[int, str]:
        return await self.finish(await self.start(*args), "helm " + " ".join(args[:2]))


@dataclass
class StandIns:
    """The processes playing the chart's workloads (see the module docstring)."""

    work: Path
    agents: list[AgentProc] = field(default_factory=list)
    controller: Supervised | None = None

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop(grace=10)
            self.controller = None
        await asyncio.gather(*(a.stop() for a in self.agents), return_exceptions=True)
        self.agents = []

    def keep_logs(self) -> Path:
        """The stand-ins' whole logs, copied where the session keeps component logs of a failed run."""
        keep = Path(os.environ.get("DYNSNAP_KEEP_LOGS", "test-logs")) / "helm"
        keep.mkdir(parents=True, exist_ok=True)
        for log in self.work.rglob("*.log"):
            shutil.copy2(log, keep / log.name)
        return keep.resolve()


@pytest.fixture
async def helm_env(cluster: LocalCluster) -> AsyncIterator[Helm]:
    path = os.environ.get("DYNSNAP_HELM", "")
    if not path or not os.access(path, os.X_OK):
        pytest.fail("$DYNSNAP_HELM is not set or not executable: run ./run setup (it builds helm)")
    assert cluster.cp is not None
    with tempfile.TemporaryDirectory(prefix="dynsnap-helm-") as d:
        h = Helm(path, cluster.cp.kubeconfig_for("admin", Path(d) / "admin.kubeconfig"), Path(d))
        yield h
        # Whatever the test left: the release without its hooks, then its namespace.
        code, _ = await h.run("status", RELEASE, "-n", NS)
        if code == 0:
            await h.run("uninstall", RELEASE, "-n", NS, "--no-hooks", "--timeout", "60s")
        with contextlib.suppress(NotFound):
            await cluster.api.delete(R.NAMESPACES, NS)


# -- helpers -------------------------------------------------------------------------------------------------

async def exists(api: Kube, res: Resource, name: str, namespace: str | None = None) -> bool:
    try:
        await api.get(res, name, namespace=namespace)
    except NotFound:
        return False
    return True


async def can(api: Kube, sa: str, verb: str, resource: str, *, group: str = "", namespace: str | None = None,
              subresource: str = "") -> bool:
    """What `kubectl auth can-i --as system:serviceaccount:NS:sa` asks: a SubjectAccessReview."""
    attrs = {"verb": verb, "resource": resource, "group": group, "subresource": subresource}
    if namespace:
        attrs["namespace"] = namespace
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": f"system:serviceaccount:{NS}:{sa}",
                     "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NS}", "system:authenticated"],
                     "resourceAttributes": attrs}}
    res = await api.create(SARS, body)
    return bool(res["status"].get("allowed"))


def shipped_rules() -> dict[tuple[str, str], list[Obj]]:
    out = {}
    for p in sorted((ROOT / "deploy" / "rbac").glob("*.yaml")):
        for d in yaml.safe_load_all(p.read_text()):
            if d and "rules" in d:
                out[(d["kind"], d["metadata"]["name"])] = d["rules"]
    return out


def env_of(container: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def resolve_env(container: Obj, fields: dict[str, str]) -> dict[str, str]:
    """The container's environment as a kubelet would give it (downward API fields from ``fields``)."""
    out = {}
    for e in container.get("env") or []:
        # An empty value is not stored: the API server drops `value: ""`.
        out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e else e.get("value", "")
    return out


async def stand_in_controller(cluster: LocalCluster, work: Path) -> Supervised:
    """The controller Deployment's pod, from the live Deployment (see the module docstring)."""
    api = cluster.api
    dep = await api.get(DEPLOYMENTS, CONTROLLER, namespace=NS)
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["dynsnap"], c["command"]
    pod_name = f"{CONTROLLER}-standin-0"
    kc = await token_kubeconfig(cluster, namespace=NS, sa=pod["serviceAccountName"], path=work / "controller.kc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNSNAP_CONTROLLER_") and k != "KUBECONFIG"}
    env |= resolve_env(c, {"metadata.name": pod_name, "metadata.namespace": NS})
    proc = Supervised(pod_name, [sys.executable, "-m", "dynsnap", *c["args"], "--kubeconfig", str(kc),
                                 "--health-port", "0"], log_path=work / "controller.log", env=env)
    await proc.start()
    return proc


@dataclass
class HookRun:
    args: list[str]
    code: int
    out: str


async def stub_job_runner(cluster: LocalCluster, work: Path, *, timeout: float, not_uid: str = "") -> HookRun:
    """Stands in for kube-controller-manager's Job controller and a kubelet, for the uninstall hook:
    waits for the hook Job (another than ``not_uid``), runs its container's command exactly as rendered
    (``dynsnap`` as this checkout's ``python -m dynsnap``) under the Job's service account, and returns
    its exit code and output. The Job's status is written by :func:`finish_job`."""
    api = cluster.api

    async def new_job() -> Obj | None:
        job = await _get(api, JOBS, HOOK_JOB, NS)
        return job if job is not None and job["metadata"]["uid"] != not_uid else None
    job = await wait_for(f"hook Job {HOOK_JOB}", new_job, timeout=60, interval=0.2)
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["dynsnap"], c["command"]
    assert pod["serviceAccountName"] == HOOK_SA
    kc = await token_kubeconfig(cluster, namespace=NS, sa=pod["serviceAccountName"], path=work / "hook.kc")
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "dynsnap", *c["args"], "--kubeconfig", str(kc),
                                                env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
    code, out = await Helm.finish(proc, "the hook's `dynsnap wake --all`", timeout)
    return HookRun(list(c["args"]), code, out)


async def finish_job(api: Kube, code: int) -> None:
    """The Job's status as the Job controller writes it when its only pod exited with ``code``."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def cond(t: str, reason: str) -> Obj:
        return {"type": t, "status": "True", "reason": reason, "lastProbeTime": now, "lastTransitionTime": now}
    if code == 0:
        status = {"startTime": now, "completionTime": now, "succeeded": 1, "active": 0, "ready": 0,
                  "conditions": [cond("SuccessCriteriaMet", "CompletionsReached"),
                                 cond("Complete", "CompletionsReached")]}
    else:
        status = {"startTime": now, "failed": 1, "active": 0, "ready": 0,
                  "conditions": [cond("FailureTarget", "BackoffLimitExceeded"), cond("Failed", "BackoffLimitExceeded")]}
    await api.merge_patch(JOBS, HOOK_JOB, {"status": status}, namespace=NS, subresource="status")


async def _get(api: Kube, res: Resource, name: str, namespace: str | None) -> Obj | None:
    with contextlib.suppress(NotFound):
        return await api.get(res, name, namespace=namespace)
    return None


def graph_body(libcuda: str) -> Obj:
    worker = D.mocker_component("worker", replicas=2, dynsnap=True, env={"LD_PRELOAD": libcuda})
    worker["annotations"] = policy(min_active=1, verify_requests=2)
    body = D.dgd("helm-graph", [D.frontend_component(), worker])
    body["metadata"]["annotations"] = policy(enabled=True, idle_after="2s", tier="snapshot")
    return body


# -- the test ------------------------------------------------------------------------------------------------

async def test_install_upgrade_uninstall_and_no_worker_left_asleep(cluster: LocalCluster, helm_env: Helm) -> None:
    api, helm = cluster.api, helm_env
    work = helm.home

    # lint
    code, out = await helm.run("lint", "--strict", str(CHART))
    assert code == 0 and "0 chart(s) failed" in out, out

    # install: the CRD comes from the chart's crds/ (removed first if an earlier test installed it)
    if await exists(api, R.CRDS, CRD_NAME):
        await api.delete(R.CRDS, CRD_NAME)
        await wait_for("WorkerSnapshot CRD gone", lambda: _absent(api, R.CRDS, CRD_NAME), timeout=60)
    sets = [a for v in INSTALL_VALUES for a in ("--set", v)]
    code, out = await helm.run("install", RELEASE, str(CHART), "-n", NS, "--create-namespace", *sets)
    assert code == 0, out
    crd = await api.get(R.CRDS, CRD_NAME)
    chart_crd = yaml.safe_load((CHART / "crds" / "workersnapshots.yaml").read_text())
    assert crd["spec"]["versions"] == chart_crd["spec"]["versions"]
    assert any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])
    for sa in (CONTROLLER, AGENT):
        assert await exists(api, R.SERVICE_ACCOUNTS, sa, NS), sa
    rules = shipped_rules()
    for kind, res, name, shipped, ns in (
            ("ClusterRole", R.CLUSTER_ROLES, CONTROLLER, "dynsnap-controller", None),
            ("ClusterRole", R.CLUSTER_ROLES, AGENT, "dynsnap-agent", None),
            ("ClusterRole", R.CLUSTER_ROLES, USER, "dynsnap-user", None),
            ("Role", R.ROLES, f"{CONTROLLER}-leader-election", "dynsnap-controller-leader-election", NS)):
        live = await api.get(res, name, namespace=ns)
        assert live["rules"] == rules[(kind, shipped)], name
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    for res, name, ns in ((R.CLUSTER_ROLE_BINDINGS, CONTROLLER, None), (R.CLUSTER_ROLE_BINDINGS, AGENT, None),
                          (R.ROLE_BINDINGS, f"{CONTROLLER}-leader-election", NS)):
        assert await exists(api, res, name, ns), name
    dep = await api.get(DEPLOYMENTS, CONTROLLER, namespace=NS)
    ds = await api.get(DAEMON_SETS, AGENT, namespace=NS)
    assert dep["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    (ctl,) = dep["spec"]["template"]["spec"]["containers"]
    assert env_of(ctl)["DYNSNAP_CONTROLLER_VERIFY_TIMEOUT"] == "30" and ctl["args"] == ["--verbose", "controller"]
    dspod = ds["spec"]["template"]["spec"]
    assert dspod["hostPID"] is True and dspod["containers"][0]["securityContext"]["privileged"] is True
    assert not await exists(api, R.SERVICE_ACCOUNTS, HOOK_SA, NS)  # the uninstall identity exists only then

    # who may do what: the chart's least privilege, asked of the API server
    allowed = [
        (CONTROLLER, "patch", "pods", "", "status", "dynamo"), (CONTROLLER, "delete", "pods", "", "", "dynamo"),
        (CONTROLLER, "create", "workersnapshots", P.DYNSNAP_GROUP, "", "dynamo"),
        (CONTROLLER, "update", "leases", "coordination.k8s.io", "", NS),
        (CONTROLLER, "watch", "dynamographdeployments", P.DYNAMO_GROUP, "", "dynamo"),
        (AGENT, "patch", "workersnapshots", P.DYNSNAP_GROUP, "status", "dynamo"),
        (AGENT, "list", "pods", "", "", None), (AGENT, "create", "events", "events.k8s.io", "", "dynamo")]
    denied = [
        (CONTROLLER, "update", "pods", "", "", "dynamo"), (CONTROLLER, "get", "secrets", "", "", NS),
        (CONTROLLER, "update", "leases", "coordination.k8s.io", "", "dynamo"),
        (CONTROLLER, "patch", "dynamographdeployments", P.DYNAMO_GROUP, "", "dynamo"),
        (AGENT, "patch", "workersnapshots", P.DYNSNAP_GROUP, "", "dynamo"), (AGENT, "delete", "pods", "", "", "dynamo"),
        (AGENT, "get", "secrets", "", "", "dynamo"),
        (HOOK_SA, "patch", "pods", "", "", "dynamo")]  # bound only while the uninstall runs
    for sa, verb, resource, group, sub, ns in allowed:
        assert await can(api, sa, verb, resource, group=group, subresource=sub, namespace=ns), (sa, verb, resource, sub)
    for sa, verb, resource, group, sub, ns in denied:
        assert not await can(api, sa, verb, resource, group=group, subresource=sub, namespace=ns), (
            sa, verb, resource, sub)

    # the workloads' stand-ins, under the chart's service accounts; a graph whose idle worker sleeps
    driver = build_stub_driver(work / "stubcuda")
    agent_kc = await token_kubeconfig(cluster, namespace=NS, sa=dspod["serviceAccountName"], path=work / "agent.kc")
    stand = StandIns(work, agents=[AgentProc(n, agent_kc, work / n, driver) for n in NODES])
    graph: D.Graph | None = None
    fe: D.FrontendClient | None = None
    try:
        for a in stand.agents:
            await a.start()
        stand.controller = await stand_in_controller(cluster, work)
        graph = await D.deploy(cluster, graph_body(str(driver.libcuda)), wait=False)
        workers = graph.workers("worker")
        await asyncio.gather(*(cluster.wait_ready(p.namespace, p.name, timeout=120) for p in workers))
        fe = D.FrontendClient(graph.frontend)
        await fe.wait_model()

        # The Lease: in the release namespace, held under the (stand-in) pod's name.
        lease = await wait_for("the controller's Lease", lambda: _get(api, R.LEASES, CONTROLLER, NS), timeout=60)
        assert lease["spec"]["holderIdentity"] == f"{CONTROLLER}-standin-0"

        # upgrade: changed values land on the live objects (and in the hook helm runs on uninstall)
        code, out = await helm.run("upgrade", RELEASE, str(CHART), "-n", NS, "--reuse-values",
                                   "--set", "controller.verifyTimeout=45",
                                   "--set", "agent.imagesRoot=/var/lib/dynsnap/captures",
                                   "--set", f"uninstall.timeout={HOOK_TIMEOUT}")
        assert code == 0, out
        dep2 = await api.get(DEPLOYMENTS, CONTROLLER, namespace=NS)
        ds2 = await api.get(DAEMON_SETS, AGENT, namespace=NS)
        (ctl2,) = dep2["spec"]["template"]["spec"]["containers"]
        assert env_of(ctl2)["DYNSNAP_CONTROLLER_VERIFY_TIMEOUT"] == "45"
        assert env_of(ctl2)["DYNSNAP_CONTROLLER_SCRAPE_INTERVAL"] == "1"  # --reuse-values kept the install's
        pod2 = ds2["spec"]["template"]["spec"]
        assert env_of(pod2["containers"][0])["DYNSNAP_AGENT_IMAGES_ROOT"] == "/var/lib/dynsnap/captures"
        assert {v["name"]: v for v in pod2["volumes"]}["images"]["hostPath"]["path"] == "/var/lib/dynsnap/captures"
        assert {m["name"]: m["mountPath"] for m in pod2["containers"][0]["volumeMounts"]}["images"] == (
            "/var/lib/dynsnap/captures")
        assert dep2["metadata"]["generation"] > dep["metadata"]["generation"]
        assert ds2["metadata"]["generation"] > ds["metadata"]["generation"]
        code, out = await helm.run("history", RELEASE, "-n", NS, "-o", "yaml")
        assert code == 0 and [h["revision"] for h in yaml.safe_load(out)] == [1, 2], out

        async def one_asleep() -> list[str]:
            return [p.name for p in workers if asleep(await get_ws(api, p))]
        (name,) = await wait_for("one of two workers asleep", one_asleep, timeout=180, interval=0.5)
        sleeper = next(p for p in workers if p.name == name)
        ws = await get_ws(api, sleeper)
        assert ws is not None and ws["status"]["lastCapture"]["tier"] == "snapshot"
        woken_before = (ws["status"].get("lastWake") or {}).get("id")

        # uninstall while the sleeper's node has no agent (its pod lost): the hook cannot get it woken,
        # fails, and the uninstall stops there with the agents and the controller still installed.
        lost = next(a for a in stand.agents if a.node == sleeper.node)
        await lost.stop()
        uninstall = await helm.start("uninstall", RELEASE, "-n", NS, "--timeout", f"{HOOK_TIMEOUT + 60}s")
        hook = await stub_job_runner(cluster, work, timeout=HOOK_TIMEOUT + 30)
        print(hook.out)
        assert hook.args == ["wake", "--all", "--all-namespaces", "--timeout", str(HOOK_TIMEOUT)]
        assert hook.code == 3, hook.out  # not done within its timeout
        assert f"not done in {HOOK_TIMEOUT}s: {sleeper.namespace}/{sleeper.name}" in hook.out, hook.out
        await finish_job(api, hook.code)
        code, out = await Helm.finish(uninstall, "helm uninstall (hook failing)")
        assert code != 0 and f"job {HOOK_JOB} failed" in out, out
        for res, name in ((DAEMON_SETS, AGENT), (DEPLOYMENTS, CONTROLLER), (R.SERVICE_ACCOUNTS, AGENT),
                          (R.SERVICE_ACCOUNTS, CONTROLLER)):
            assert await exists(api, res, name, NS), f"{res.kind} {name} deleted although the hook failed"
        assert await exists(api, R.CLUSTER_ROLES, AGENT)
        failed = await api.get(JOBS, HOOK_JOB, namespace=NS)  # kept, for its log
        assert any(c["type"] == "Failed" for c in failed["status"]["conditions"])
        ws = await get_ws(api, sleeper)
        assert ws is not None and ws["status"]["state"] == "Suspended"  # asleep, its agent still installed
        # The release is left "uninstalling": an upgrade is refused until a rollback makes it deployed again
        # (docs/install.md says so).
        code, out = await helm.run("status", RELEASE, "-n", NS, "-o", "json")
        assert code == 0 and json.loads(out)["info"]["status"] == "uninstalling", out
        code, out = await helm.run("upgrade", RELEASE, str(CHART), "-n", NS, "--reuse-values")
        assert code != 0 and "has no deployed releases" in out, out
        code, out = await helm.run("rollback", RELEASE, "-n", NS)
        assert code == 0, out
        code, out = await helm.run("status", RELEASE, "-n", NS, "-o", "json")
        assert code == 0 and json.loads(out)["info"]["status"] == "deployed", out
        # Its agent's pod comes back and wakes it (the override the hook set stands); the controller proves it.
        await lost.start()

        async def woken_and_verified() -> Obj | None:
            got = await get_ws(api, sleeper)
            return got if verified_after(woken_before)(got) else None
        await wait_for(f"{sleeper.name} woken and verified", woken_and_verified, timeout=120, interval=0.5)
        # The person who uninstalls lifts the overrides (dynsnap manages the workers again): one goes back to sleep.
        for p in workers:
            await api.merge_patch(R.PODS, p.name, {"metadata": {"annotations": {P.ANN_DESIRED_STATE: None}}},
                                  namespace=p.namespace)
        (name,) = await wait_for("one of two workers asleep again", one_asleep, timeout=180, interval=0.5)
        sleeper = next(p for p in workers if p.name == name)
        woken_before = ((await get_ws(api, sleeper)) or {})["status"].get("lastWake", {}).get("id")

        # uninstall again: now the hook wakes the sleeper before the agents and the controller go
        uninstall = await helm.start("uninstall", RELEASE, "-n", NS, "--timeout", f"{HOOK_TIMEOUT + 60}s")
        hook = await stub_job_runner(cluster, work, timeout=HOOK_TIMEOUT + 30, not_uid=failed["metadata"]["uid"])
        print(hook.out)
        # Helm is waiting on the Job: the DaemonSet and the Deployment are still there...
        assert await exists(api, DAEMON_SETS, AGENT, NS) and await exists(api, DEPLOYMENTS, CONTROLLER, NS)
        assert uninstall.returncode is None
        assert hook.code == 0, hook.out
        assert "2 of 2 awake, 0 skipped" in hook.out, hook.out
        # ...and the sleeper is awake already: woken by the agent, that wake verified by the controller.
        ws = await get_ws(api, sleeper)
        assert ws is not None and ws["status"]["state"] == "Active" and ws["spec"]["desiredState"] == "Active"
        wake = ws["status"]["lastWake"]
        assert wake["id"] != woken_before and wake["ok"] is True and wake["tier"] == "snapshot"
        assert verified_after(woken_before)(ws), ws["status"].get("controller")
        by = {m["manager"] for m in ws["metadata"]["managedFields"] if "f:lastWake" in str(m.get("fieldsV1"))}
        assert by == {P.AGENT_FIELD_MANAGER}, by  # the agent woke it
        live = await api.get(R.PODS, sleeper.name, namespace=sleeper.namespace)
        assert live["metadata"]["uid"] == sleeper.uid
        assert live["metadata"]["annotations"][P.ANN_DESIRED_STATE] == "active"
        assert any(m["manager"] == P.CLI_FIELD_MANAGER for m in live["metadata"]["managedFields"])
        await finish_job(api, hook.code)
        code, out = await Helm.finish(uninstall, "helm uninstall")
        assert code == 0, out
        assert f'release "{RELEASE}" uninstalled' in out, out

        # Everything of the release is gone, hooks included; the CRD stays (helm never deletes crds/).
        for res, name, ns in ((DEPLOYMENTS, CONTROLLER, NS), (DAEMON_SETS, AGENT, NS), (JOBS, HOOK_JOB, NS),
                              (R.SERVICE_ACCOUNTS, CONTROLLER, NS), (R.SERVICE_ACCOUNTS, AGENT, NS),
                              (R.SERVICE_ACCOUNTS, HOOK_SA, NS), (R.CLUSTER_ROLE_BINDINGS, HOOK_SA, None),
                              (R.CLUSTER_ROLES, CONTROLLER, None), (R.CLUSTER_ROLES, AGENT, None),
                              (R.CLUSTER_ROLES, USER, None), (R.ROLES, f"{CONTROLLER}-leader-election", NS)):
            await wait_for(f"{res.kind} {name} deleted", lambda r=res, n=name, s=ns: _absent(api, r, n, s),
                           timeout=30)
        assert await exists(api, R.CRDS, CRD_NAME)
        # Their pods would be gone now: so are the stand-ins. The woken worker serves on its own.
        await stand.stop()
        iid = instance_id_from_dwm(await api.get(R.DWMS, sleeper.name, namespace=sleeper.namespace))
        await fe.wait_routable(iid, timeout=60)
        answers = [await fe.chat(f"after uninstall {i}", worker_id=iid, max_tokens=2) for i in range(3)]
        assert [(a.status, a.worker_id) for a in answers] == [(200, iid)] * 3, [a.body for a in answers]
    except BaseException:
        for p in graph.workers("worker") if graph is not None else []:
            print(f"--- {p.name} ---\n" + yaml.safe_dump(((await get_ws(api, p)) or {}).get("status")))
        print(f"stand-in logs kept in {stand.keep_logs()}")
        raise
    finally:
        if fe is not None:
            await fe.close()
        await stand.stop()
        if graph is not None:
            await D.teardown(cluster, graph)


async def _absent(api: Kube, res: Resource, name: str, namespace: str | None = None) -> bool:
    return not await exists(api, res, name, namespace)


# -- controller.watchNamespace: the controller confined to it ------------------------------------------------

WATCHED, ELSEWHERE, NS_RBAC = "dynsnap-watched", "dynsnap-elsewhere", "dynsnap-helm-ns"
RBAC_RESOURCES = {"ServiceAccount": R.SERVICE_ACCOUNTS, "Role": R.ROLES, "RoleBinding": R.ROLE_BINDINGS,
                  "ClusterRole": R.CLUSTER_ROLES, "ClusterRoleBinding": R.CLUSTER_ROLE_BINDINGS}


async def _as_controller_in(api: Kube, sa_api: Kube, namespace: str) -> dict[str, int | None]:
    """Each of the controller's writes, tried in ``namespace`` under its own token: the HTTP status of
    a refusal, None where it was allowed. The objects it writes to are made by the admin first."""
    name = "w-0"
    pod = await api.create(R.PODS, {"apiVersion": "v1", "kind": "Pod",
                                    "metadata": {"name": name, "namespace": namespace},
                                    "spec": {"containers": [{"name": "main", "image": "none"}]}})
    ws = {"apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
          "metadata": {"name": name, "namespace": namespace},
          "spec": {"podName": name, "podUID": pod["metadata"]["uid"], "tier": "suspend", "desiredState": "Active"}}
    out: dict[str, int | None] = {}

    async def attempt(what: str, call: Any) -> None:
        try:
            await call
            out[what] = None
        except ApiError as e:
            out[what] = e.status

    await attempt("list pods", sa_api.list(R.PODS, namespace=namespace))
    await attempt("patch pods/status", sa_api.apply(R.PODS, {"metadata": {"name": name, "namespace": namespace},
                                                             "status": {"conditions": [{"type": P.CONDITION_SERVING,
                                                                                        "status": "False"}]}},
                                                    subresource="status", field_manager=P.FIELD_MANAGER))
    await attempt("create workersnapshots", sa_api.create(R.WORKER_SNAPSHOTS, ws))
    if out["create workersnapshots"] is not None:  # refused: the admin makes it, to try the other writes on
        await api.create(R.WORKER_SNAPSHOTS, ws)
    await attempt("patch workersnapshots", sa_api.merge_patch(R.WORKER_SNAPSHOTS, name, {"spec": {"tier": "snapshot"}},
                                                             namespace=namespace))
    await attempt("patch workersnapshots/status", sa_api.apply(
        R.WORKER_SNAPSHOTS, {"metadata": {"name": name, "namespace": namespace},
                             "status": {"controller": {"decision": "rbac probe"}}},
        subresource="status", field_manager=P.FIELD_MANAGER, force=True))
    await attempt("delete workersnapshots", sa_api.delete(R.WORKER_SNAPSHOTS, name, namespace=namespace))
    await attempt("delete pods", sa_api.delete(R.PODS, name, namespace=namespace, uid=pod["metadata"]["uid"]))
    return out


async def test_a_watched_namespace_confines_the_controller_to_it(cluster: LocalCluster, helm_env: Helm) -> None:
    """The chart rendered with controller.watchNamespace, its RBAC applied, and the controller's own token
    (TokenRequest for the rendered service account) tried against the API server: each of its writes is
    allowed in the watched namespace and Forbidden in another one; nothing cluster-wide is granted."""
    api, helm = cluster.api, helm_env
    await install_dynsnap(cluster)  # the CRD (and deploy/rbac's cluster-wide objects, under other names)
    for ns in (WATCHED, ELSEWHERE, NS_RBAC):
        with contextlib.suppress(Conflict):
            await api.create(R.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    code, out = await helm.run("template", RELEASE, str(CHART), "-n", NS_RBAC, "--set",
                               f"controller.watchNamespace={WATCHED}")
    assert code == 0, out
    docs = [d for d in yaml.safe_load_all(out.split("\n---", 1)[1]) if d]  # helm's first line is a warning
    controller_rbac = [d for d in docs if d["kind"] in RBAC_RESOURCES and d["metadata"]["name"].startswith(CONTROLLER)]
    try:
        for d in controller_rbac:
            await api.apply(RBAC_RESOURCES[d["kind"]], d, force=True)
        kc = await token_kubeconfig(cluster, namespace=NS_RBAC, sa=CONTROLLER, path=helm.home / "ns-controller.kc")
        sa_api = await Kube.from_kubeconfig(kc)
        try:
            allowed = await _as_controller_in(api, sa_api, WATCHED)
            refused = await _as_controller_in(api, sa_api, ELSEWHERE)
            with pytest.raises(ApiError) as cluster_wide:
                await sa_api.list(R.PODS)
        finally:
            await sa_api.close()
        assert allowed == dict.fromkeys(allowed), allowed
        assert refused == dict.fromkeys(refused, 403), refused
        assert cluster_wide.value.status == 403
        assert {d["kind"] for d in controller_rbac} == {"ServiceAccount", "Role", "RoleBinding"}, controller_rbac
    finally:
        for d in controller_rbac:  # whatever was cluster-wide goes (namespaced objects go with their namespace)
            if not RBAC_RESOURCES[d["kind"]].namespaced:
                with contextlib.suppress(NotFound):
                    await api.delete(RBAC_RESOURCES[d["kind"]], d["metadata"]["name"])
        for ns in (WATCHED, ELSEWHERE, NS_RBAC):
            with contextlib.suppress(NotFound):
                await api.delete(R.NAMESPACES, ns)
