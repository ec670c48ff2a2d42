"""deploy/helm/dynsnap with the real helm (``$DYNSNAP_HELM``) against the local API server, as a
platform engineer would use it: ``helm lint``, ``helm install``, ``helm upgrade`` with changed values,
``helm uninstall``, and what the chart grants, asked of the API server.

What is asserted: the objects the API server holds after install (the CRD from the chart's crds/,
service accounts, RBAC with deploy/rbac's rules, Deployment, DaemonSet) and who may do what
(SubjectAccessReviews under the chart's service accounts); the live objects and the uninstall hook
after an upgrade; everything of the release gone after an uninstall but the CRD; and with
``controller.watchNamespace`` the controller's own token confined to that namespace.

Sandbox, why not: nothing of the chart runs here (kwok's nodes run no containers and this control plane
no Deployment, DaemonSet or Job controller). The chart's workloads run on the real node:
test_real_node_wake.py and tests/integration/node/ install it there with helm (the controller and the
agent doing their job under the chart's RBAC), and test_real_node_faults.py runs its uninstall hook
with a worker asleep (a hook that cannot wake it stops the uninstall with everything installed; one
that can wakes and verifies it before dynsnap goes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import ApiError, Conflict, NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.resources import Resource
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.dynsnap_parts import ROOT, install_dynsnap, token_kubeconfig

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


# -- the test ------------------------------------------------------------------------------------------------

async def test_lint_install_upgrade_uninstall_and_least_privilege(cluster: LocalCluster, helm_env: Helm) -> None:
    api, helm = cluster.api, helm_env

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
    assert dspod["hostPID"] is True and dspod["containers"][0]["securityContext"]["privileged"] is False
    assert "SYS_ADMIN" in dspod["containers"][0]["securityContext"]["capabilities"]["add"]
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

    # upgrade: changed values land on the live objects (and in the hook helm runs on uninstall)
    code, out = await helm.run("upgrade", RELEASE, str(CHART), "-n", NS, "--reuse-values",
                               "--set", "controller.verifyTimeout=45",
                               "--set", "agent.imagesRoot=/var/lib/dynsnap/captures",
                               "--set", "uninstall.timeout=30")
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
    code, out = await helm.run("get", "hooks", RELEASE, "-n", NS)
    assert code == 0, out
    (job,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Job"]
    (hook,) = job["spec"]["template"]["spec"]["containers"]
    assert hook["args"] == ["wake", "--all", "--all-namespaces", "--timeout", "30"], hook["args"]

    # uninstall: everything of the release gone but the CRD (helm never deletes crds/). Its pre-delete hook
    # (the Job above) needs a Job controller and a kubelet, which this cluster's kwok nodes do not have: it
    # runs on the real node (test_real_node_faults.py: a hook that cannot wake a sleeper stops the uninstall,
    # one that can wakes it before dynsnap goes).
    code, out = await helm.run("uninstall", RELEASE, "-n", NS, "--no-hooks")
    assert code == 0 and f'release "{RELEASE}" uninstalled' in out, out
    for res, name, ns in ((DEPLOYMENTS, CONTROLLER, NS), (DAEMON_SETS, AGENT, NS), (JOBS, HOOK_JOB, NS),
                          (R.SERVICE_ACCOUNTS, CONTROLLER, NS), (R.SERVICE_ACCOUNTS, AGENT, NS),
                          (R.SERVICE_ACCOUNTS, HOOK_SA, NS), (R.CLUSTER_ROLE_BINDINGS, HOOK_SA, None),
                          (R.CLUSTER_ROLES, CONTROLLER, None), (R.CLUSTER_ROLES, AGENT, None),
                          (R.CLUSTER_ROLES, USER, None), (R.ROLES, f"{CONTROLLER}-leader-election", NS)):
        await wait_for(f"{res.kind} {name} deleted", lambda r=res, n=name, s=ns: _absent(api, r, n, s), timeout=30)
    assert await exists(api, R.CRDS, CRD_NAME)


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
