"""deploy/helm/dynsnap rendered by the real helm (``$DYNSNAP_HELM``, built by setup), no cluster:

- one source for the CRD and the RBAC: the chart's crds/ links to crds/workersnapshots.yaml, byte for
  byte what ``dynsnap crd`` prints, and every Role/ClusterRole (and binding, and service account) the
  chart renders is the one in deploy/rbac/*.yaml, rules included, and none other (so they never drift);
- the controller Deployment and the agent DaemonSet carry what each needs (leader election
  through the Lease under the pod's name in its namespace, probes on /healthz and /readyz, the OTLP
  endpoint; privileged, hostPID, GPU nodes, the host paths, the node name from the downward API), every
  environment variable they set is a real setting, and the chart's defaults are the programs' own (but
  for where CRIU and dynsnap-cuda are: the copies the chart installs on the node);
- the uninstall hook runs a command the CLI accepts, under a service account bound only to the user
  role, before anything is deleted;
- values.schema.json (and the chart's own checks) reject bad values, naming them, in both ``helm lint``
  and ``helm template``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynsnap.agent.settings import AgentSettings
from dynsnap.cli import build_parser
from dynsnap.controller.settings import ControllerSettings
from dynsnap.models.crd import workersnapshot_crd

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dynsnap"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
Obj = dict[str, Any]


def helm_bin() -> str:
    path = os.environ.get("DYNSNAP_HELM", "")
    if not path or not os.access(path, os.X_OK):
        pytest.fail("$DYNSNAP_HELM is not set or not executable: run ./run setup (it builds helm)")
    return path


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    return subprocess.run([helm_bin(), *args], capture_output=True, text=True, timeout=60, env=env, check=False)


def render(*sets: str, release: str = "dynsnap", namespace: str = "dynsnap-system") -> list[Obj]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    res = helm(*args)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def one(docs: list[Obj], kind: str, name: str) -> Obj:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} rendered"
    return found[0]


def container_env(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container["env"]}


def resolved(env: dict[str, Obj], fields: dict[str, str]) -> dict[str, str]:
    """The values a kubelet would give, with the downward API fields in ``fields``."""
    out = {}
    for name, e in env.items():
        if "value" in e:
            out[name] = e["value"]
        else:
            out[name] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def hooks(obj: Obj) -> str | None:
    return ((obj["metadata"].get("annotations")) or {}).get("helm.sh/hook")


# -- one source -------------------------------------------------------------------------------------------

def test_chart_crd_is_what_dynsnap_crd_prints() -> None:
    """The chart's CRD is a link to crds/workersnapshots.yaml (helm reads through it, and `helm package`
    stores the content), so regenerating that one file updates the chart too."""
    link = CHART / "crds" / "workersnapshots.yaml"
    assert link.is_symlink() and link.resolve() == (ROOT / "crds" / "workersnapshots.yaml").resolve()
    assert link.read_text() == yaml.safe_dump(workersnapshot_crd(), sort_keys=False), (
        "crds/workersnapshots.yaml drifted: run `dynsnap crd > crds/workersnapshots.yaml`")


def shipped_rbac() -> list[Obj]:
    return [d for p in sorted((ROOT / "deploy" / "rbac").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
            if d]


def test_the_chart_renders_exactly_the_shipped_rbac() -> None:
    """Released as "dynsnap" in dynsnap-system, the chart's RBAC objects (hooks aside) are deploy/rbac's:
    same kinds, names, namespaces, rules, role references and subjects; none missing, none more."""
    docs = [d for d in render() if d["kind"] in RBAC_KINDS and hooks(d) is None]
    shipped = shipped_rbac()

    def key(d: Obj) -> tuple[str, str, str | None]:
        return d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")

    assert sorted(map(key, docs)) == sorted(map(key, shipped))
    by_key = {key(d): d for d in docs}
    for want in shipped:
        got = by_key[key(want)]
        for field in ("rules", "roleRef", "subjects"):
            assert got.get(field) == want.get(field), f"{key(want)} {field}: {got.get(field)} != {want.get(field)}"


def test_another_release_has_the_same_rules_under_its_own_names() -> None:
    docs = render(release="ml", namespace="ops")
    shipped = {(d["kind"], d["metadata"]["name"]): d for d in shipped_rbac()}
    for kind, suffix in (("ClusterRole", "controller"), ("ClusterRole", "agent"), ("ClusterRole", "user"),
                         ("Role", "controller-leader-election")):
        got = one(docs, kind, f"ml-dynsnap-{suffix}")
        assert got["rules"] == shipped[(kind, f"dynsnap-{suffix}")]["rules"]
    binding = one(docs, "RoleBinding", "ml-dynsnap-controller-leader-election")
    assert binding["metadata"]["namespace"] == "ops"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ml-dynsnap-controller", "namespace": "ops"}]
    # Every Role or ClusterRole the chart can render (hooks included) is one of the shipped ones.
    rules = [d["rules"] for d in shipped.values() if "rules" in d]
    for d in render("controller.watchNamespace=models", release="ml", namespace="ops"):
        if d["kind"] in ("Role", "ClusterRole"):
            assert d["rules"] in rules, d["metadata"]["name"]


def test_a_watched_namespace_gets_the_controller_a_role_there_and_nothing_cluster_wide() -> None:
    """controller.watchNamespace: the controller's rules as a Role and RoleBinding in that namespace only
    (it reads no cluster-scoped object), its Lease's Role where it was; no ClusterRole or
    ClusterRoleBinding of the controller's at all (tests/integration/test_helm.py tries its token)."""
    docs = render("controller.watchNamespace=models", namespace="ops")
    shipped = {(d["kind"], d["metadata"]["name"]): d for d in shipped_rbac()}
    role = one(docs, "Role", "dynsnap-controller")
    assert role["metadata"]["namespace"] == "models"
    assert role["rules"] == shipped[("ClusterRole", "dynsnap-controller")]["rules"]
    binding = one(docs, "RoleBinding", "dynsnap-controller")
    assert binding["metadata"]["namespace"] == "models"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dynsnap-controller"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dynsnap-controller", "namespace": "ops"}]
    assert one(docs, "Role", "dynsnap-controller-leader-election")["metadata"]["namespace"] == "ops"
    cluster_wide = [d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")
                    and "controller" in d["metadata"]["name"]]
    assert cluster_wide == []


# -- the controller Deployment ---------------------------------------------------------------------------

def test_controller_deployment_elects_through_the_lease_and_probes_health() -> None:
    dep = one(render("controller.otlpEndpoint=http://otel-collector.obs:4318/v1/traces"), "Deployment",
              "dynsnap-controller")
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # only the leader is Ready: see the template
    assert dep["spec"]["replicas"] == 1
    assert spec["serviceAccountName"] == "dynsnap-controller"
    (c,) = spec["containers"]
    assert c["command"] == ["dynsnap"] and c["args"] == ["controller"]
    env = container_env(c)
    assert env["DYNSNAP_CONTROLLER_IDENTITY"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["DYNSNAP_CONTROLLER_LEASE_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["DYNSNAP_CONTROLLER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.obs:4318/v1/traces"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 8080} and env["DYNSNAP_CONTROLLER_HEALTH_PORT"]["value"] == "8080"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and spec["securityContext"]["runAsNonRoot"] is True


def test_controller_env_is_real_settings_with_the_programs_defaults() -> None:
    """Every DYNSNAP_CONTROLLER_* the chart sets is a setting, and what the process would read from the
    default chart is ControllerSettings' defaults, but for the Lease's identity, namespace and name."""
    (c,) = one(render(release="dynsnap", namespace="ops"), "Deployment",
               "dynsnap-controller")["spec"]["template"]["spec"]["containers"]
    env = resolved(container_env(c), {"metadata.name": "dynsnap-controller-7d9f-x2", "metadata.namespace": "ops"})
    fields = {"DYNSNAP_CONTROLLER_" + n.upper() for n in ControllerSettings.model_fields}
    assert set(env) <= fields, set(env) - fields
    got = ControllerSettings.from_env(environ=env)
    assert got.identity == "dynsnap-controller-7d9f-x2" and got.lease_namespace == "ops"
    assert got.lease_name == "dynsnap-controller"
    assert got.model_copy(update={"identity": "", "lease_namespace": "dynsnap-system"}) == ControllerSettings()


def test_controller_settings_follow_values() -> None:
    (c,) = one(render("controller.verifyTimeout=45", "controller.workers=3", "controller.verbose=true",
                      "controller.watchNamespace=models"), "Deployment",
               "dynsnap-controller")["spec"]["template"]["spec"]["containers"]
    got = ControllerSettings.from_env(environ=resolved(container_env(c), {"metadata.name": "p",
                                                                          "metadata.namespace": "n"}))
    assert (got.verify_timeout, got.workers, got.namespace) == (45.0, 3, "models")
    assert c["args"] == ["--verbose", "controller"]
    assert build_parser().parse_args(c["args"]).command == "controller"


# -- the agent DaemonSet ---------------------------------------------------------------------------------

AGENT_CAPABILITIES = {"CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP", "SETFCAP",
                      "NET_BIND_SERVICE", "NET_RAW", "SYS_CHROOT", "MKNOD", "AUDIT_WRITE", "SYS_ADMIN", "SYS_PTRACE",
                      "CHECKPOINT_RESTORE", "NET_ADMIN", "DAC_READ_SEARCH", "SYS_TIME", "IPC_LOCK"}


def test_agent_extra_capabilities_are_added_and_privileged_is_an_explicit_choice() -> None:
    (c,) = one(render("agent.extraCapabilities={SYS_RESOURCE,IPC_LOCK}"), "DaemonSet",
               "dynsnap-agent")["spec"]["template"]["spec"]["containers"]
    assert set(c["securityContext"]["capabilities"]["add"]) == AGENT_CAPABILITIES | {"SYS_RESOURCE"}
    (c,) = one(render("agent.privileged=true"), "DaemonSet",
               "dynsnap-agent")["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"] == {"privileged": True}


def test_agent_daemonset_holds_criu_capabilities_on_gpu_nodes_with_its_host_paths() -> None:
    ds = one(render(), "DaemonSet", "dynsnap-agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["serviceAccountName"] == "dynsnap-agent"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    (c,) = spec["containers"]
    sc = c["securityContext"]
    # Not privileged: the runtime's default set a worker holds (CRIU gives it back at a restore) and what
    # the agent and CRIU use themselves, nothing else (docs/install.md, "The agent's credentials").
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == AGENT_CAPABILITIES
    dropped = {"SYS_RESOURCE", "SYS_MODULE", "SYS_RAWIO", "SYS_BOOT", "BPF", "PERFMON"}
    assert not dropped & set(sc["capabilities"]["add"])
    # /tmp, which CRIU uses too, a memory volume: its tmpfs outlives the agent's container in CRIU's mount
    # namespace (the container's file system does not).
    assert {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}} in spec["volumes"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    # A restored task inherits its restorer's seccomp filters and AppArmor label.
    assert sc["seccompProfile"] == sc["appArmorProfile"] == {"type": "Unconfined"}
    assert c["args"] == ["agent"]
    env = container_env(c)
    assert env["DYNSNAP_AGENT_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for name, path in (("images", "/var/lib/dynsnap/images"), ("cuda-state", "/run/dynsnap-cuda"),
                       ("node-tools", "/var/lib/dynsnap")):
        assert vols[name]["hostPath"] == {"path": path, "type": "DirectoryOrCreate"}
        assert mounts[name] == path  # the same path as on the node, and so in a worker's mount namespace
    assert env["DYNSNAP_AGENT_IMAGES_ROOT"]["value"] == "/var/lib/dynsnap/images"
    # The images directory is made private before the agent starts; the node tools are installed where
    # the agent's settings say CRIU and dynsnap-cuda are.
    dirs, tools = spec["initContainers"]
    assert dirs["command"][:4] == ["install", "-d", "-m", "0700"] and "/var/lib/dynsnap/images" in dirs["command"]
    assert {m["mountPath"] for m in dirs["volumeMounts"]} == {"/var/lib/dynsnap/images", "/run/dynsnap-cuda"}
    assert tools["command"] == ["dynsnap-install-node-tools", "/var/lib/dynsnap"]
    assert [m["mountPath"] for m in tools["volumeMounts"]] == ["/var/lib/dynsnap"]
    assert (env["DYNSNAP_AGENT_CRIU"]["value"], env["DYNSNAP_AGENT_CRIU_LIBDIR"]["value"],
            env["DYNSNAP_AGENT_CUDA_HELPER"]["value"]) == (
        "/var/lib/dynsnap/bin/criu", "/var/lib/dynsnap/lib/criu", "/var/lib/dynsnap/bin/dynsnap-cuda")
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_agent_env_is_real_settings_with_the_programs_defaults() -> None:
    (c,) = one(render(), "DaemonSet", "dynsnap-agent")["spec"]["template"]["spec"]["containers"]
    env = resolved(container_env(c), {"spec.nodeName": "gpu-node-7"})
    # The NVIDIA container runtime's own variables: every GPU for dynsnap-cuda, no dynsnap setting.
    assert (env.pop("NVIDIA_VISIBLE_DEVICES"), env.pop("NVIDIA_DRIVER_CAPABILITIES")) == ("all", "compute,utility")
    fields = {"DYNSNAP_AGENT_" + n.upper() for n in AgentSettings.model_fields}
    assert set(env) <= fields, set(env) - fields
    got = AgentSettings.from_env(environ=env)
    assert got.node_name == "gpu-node-7"
    # CRIU and dynsnap-cuda: the copies on the node (the program's defaults find them on PATH).
    assert (got.criu, got.criu_libdir, got.cuda_helper) == (
        "/var/lib/dynsnap/bin/criu", "/var/lib/dynsnap/lib/criu", "/var/lib/dynsnap/bin/dynsnap-cuda")
    defaults = AgentSettings()
    assert got.model_copy(update={"node_name": "", "criu": defaults.criu, "criu_libdir": defaults.criu_libdir,
                                  "cuda_helper": defaults.cuda_helper}) == defaults


def test_agent_images_root_moves_env_volume_and_mount_together() -> None:
    spec = one(render("agent.imagesRoot=/data/dynsnap", "agent.imagesBudgetBytes=1099511627776"), "DaemonSet",
               "dynsnap-agent")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    got = AgentSettings.from_env(environ=resolved(container_env(c), {"spec.nodeName": "n"}))
    assert str(got.images_root) == "/data/dynsnap" and got.images_budget_bytes == 2**40
    assert {v["name"]: v for v in spec["volumes"]}["images"]["hostPath"]["path"] == "/data/dynsnap"
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["images"] == "/data/dynsnap"
    assert "/data/dynsnap" in spec["initContainers"][0]["command"]


def test_agent_node_tools_dir_moves_the_tools_and_the_settings_together() -> None:
    spec = one(render("agent.nodeToolsDir=/opt/dynsnap-node", "agent.runtimeClassName=nvidia"), "DaemonSet",
               "dynsnap-agent")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    got = AgentSettings.from_env(environ=resolved(container_env(c), {"spec.nodeName": "n"}))
    assert (got.criu, got.criu_libdir, got.cuda_helper) == (
        "/opt/dynsnap-node/bin/criu", "/opt/dynsnap-node/lib/criu", "/opt/dynsnap-node/bin/dynsnap-cuda")
    assert spec["initContainers"][1]["command"] == ["dynsnap-install-node-tools", "/opt/dynsnap-node"]
    assert {v["name"]: v for v in spec["volumes"]}["node-tools"]["hostPath"]["path"] == "/opt/dynsnap-node"
    assert spec["runtimeClassName"] == "nvidia"


def test_agent_extra_volumes_reach_the_pod_and_the_agent_container() -> None:
    """agent.extraVolumes / extraVolumeMounts (a driver's libraries from a host path, where no NVIDIA
    container runtime mounts them), with extraEnv naming the library dynsnap-cuda loads; the chart's
    own volumes and mounts stay as they are."""
    spec = one(render("agent.extraVolumes[0].name=nvidia-driver",
                      "agent.extraVolumes[0].hostPath.path=/home/kubernetes/bin/nvidia",
                      "agent.extraVolumes[0].hostPath.type=Directory",
                      "agent.extraVolumeMounts[0].name=nvidia-driver",
                      "agent.extraVolumeMounts[0].mountPath=/usr/local/nvidia",
                      "agent.extraVolumeMounts[0].readOnly=true",
                      "agent.extraEnv[0].name=DYNSNAP_LIBCUDA",
                      "agent.extraEnv[0].value=/usr/local/nvidia/lib64/libcuda.so.1"),
               "DaemonSet", "dynsnap-agent")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert set(vols) == {"images", "cuda-state", "node-tools", "tmp", "nvidia-driver"}
    assert vols["nvidia-driver"] == {"name": "nvidia-driver",
                                     "hostPath": {"path": "/home/kubernetes/bin/nvidia", "type": "Directory"}}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert set(mounts) == {"images", "cuda-state", "node-tools", "tmp", "nvidia-driver"}
    assert mounts["nvidia-driver"] == {"name": "nvidia-driver", "mountPath": "/usr/local/nvidia", "readOnly": True}
    assert container_env(c)["DYNSNAP_LIBCUDA"]["value"] == "/usr/local/nvidia/lib64/libcuda.so.1"
    # Only the agent's container: the init containers see the chart's own host paths alone.
    for init in spec["initContainers"]:
        assert "nvidia-driver" not in {m["name"] for m in init["volumeMounts"]}
    # None by default.
    default = one(render(), "DaemonSet", "dynsnap-agent")["spec"]["template"]["spec"]
    assert {v["name"] for v in default["volumes"]} == {"images", "cuda-state", "node-tools", "tmp"}


# -- uninstall ---------------------------------------------------------------------------------------------

def test_uninstall_hook_wakes_everything_first_under_the_user_role_only() -> None:
    docs = render()
    hook = [d for d in docs if hooks(d) is not None]
    assert {(d["kind"], d["metadata"]["name"]) for d in hook} == {
        ("ServiceAccount", "dynsnap-uninstall"), ("ClusterRoleBinding", "dynsnap-uninstall"),
        ("Job", "dynsnap-wake-all")}
    for d in hook:
        ann = d["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == "pre-delete"
        assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    weight = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hook}
    assert weight["ServiceAccount"] < weight["Job"] and weight["ClusterRoleBinding"] < weight["Job"]
    binding = one(hook, "ClusterRoleBinding", "dynsnap-uninstall")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "dynsnap-user"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dynsnap-uninstall",
                                    "namespace": "dynsnap-system"}]
    job = one(hook, "Job", "dynsnap-wake-all")
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "dynsnap-uninstall" and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["command"] == ["dynsnap"]
    assert c["args"] == ["wake", "--all", "--all-namespaces", "--timeout", "240"]
    args = build_parser().parse_args(c["args"])  # the command the CLI really takes
    assert (args.command, args.all, args.all_namespaces, args.timeout, args.pod) == ("wake", True, True, 240.0, None)
    assert job["spec"]["activeDeadlineSeconds"] > 240


def test_uninstall_hook_follows_the_watch_namespace_and_can_be_turned_off() -> None:
    docs = render("controller.watchNamespace=models", "uninstall.timeout=100")
    binding = one(docs, "RoleBinding", "dynsnap-uninstall")
    assert binding["metadata"]["namespace"] == "models" and binding["roleRef"]["name"] == "dynsnap-user"
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "dynsnap-uninstall"]
    (c,) = one(docs, "Job", "dynsnap-wake-all")["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["wake", "--all", "--namespace", "models", "--timeout", "100"]
    off = render("uninstall.wakeAll=false")
    assert not [d for d in off if hooks(d) is not None]


# -- values ------------------------------------------------------------------------------------------------

def test_default_values_lint_clean() -> None:
    res = helm("lint", "--strict", str(CHART))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in res.stdout


BAD_VALUES = [
    # (--set, what the error must name)
    ("controller.verifyTimout=60", "verifyTimout"),  # a typo is not ignored
    ("controller.verifyTimeout=0", "/controller/verifyTimeout"),
    ("controller.replicas=0", "/controller/replicas"),
    ("controller.workers=100", "/controller/workers"),
    ("controller.watchNamespace=Models_A", "/controller/watchNamespace"),
    ("controller.otlpEndpoint=otel-collector:4318", "/controller/otlpEndpoint"),
    ("controller.healthPort=70000", "/controller/healthPort"),
    ("controller.leaderElection.renewDeadline=15", "renewDeadline (15) must be less than leaseDuration (15)"),
    ("agent.imagesRoot=images", "/agent/imagesRoot"),
    ("agent.imagesBudgetBytes=-1", "/agent/imagesBudgetBytes"),
    ("agent.nodeSelector.nvidia\\.com/gpu\\.present=true", "/agent/nodeSelector/nvidia.com~1gpu.present"),
    ("agent.criuCudaPlugin=yes", "/agent/criuCudaPlugin"),
    ("agent.criuReadThreads=17", "/agent/criuReadThreads"),
    ("agent.nodeToolsDir=/", "/agent/nodeToolsDir"),
    ("agent.failureBackoff=900", "agent.failureBackoff (900) must not exceed agent.failureBackoffMax (600)"),
    ("agent.extraVolumes[0].name=driver", "/agent/extraVolumes/0': minProperties"),  # a volume of no source
    ("agent.extraVolumes[0].name=Driver_Libs", "/agent/extraVolumes/0/name"),
    ("agent.extraVolumeMounts[0].name=driver", "/agent/extraVolumeMounts/0': missing property 'mountPath'"),
    ("agent.extraVolumeMounts[0].mountPath=usr/lib", "/agent/extraVolumeMounts/0/mountPath"),
    ("agent.extraCapabilities={CAP_SYS_RESOURCE}", "/agent/extraCapabilities/0"),  # the runtime's names: no CAP_
    ("agent.extraCapabilities={sys_time}", "/agent/extraCapabilities/0"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("uninstall.timeout=0", "/uninstall/timeout"),
]


@pytest.mark.parametrize(("setting", "named"), BAD_VALUES, ids=[b[0].split("=")[0] for b in BAD_VALUES])
def test_bad_values_are_refused_naming_them(setting: str, named: str) -> None:
    """The schema's refusals fail ``helm lint`` and ``helm template`` (and so install and upgrade). The
    two checks across values are the templates' ``fail``: helm lint renders leniently and only reports
    a ``fail`` (as INFO, exit 0), so for those the refusal is template's, and lint must still say why."""
    across = not named.startswith("/") and named != "verifyTimout"
    for cmd in (["lint", str(CHART)], ["template", "x", str(CHART)]):
        res = helm(*cmd, "--set", setting)
        out = res.stdout + res.stderr
        if not (across and cmd[0] == "lint"):
            assert res.returncode != 0, f"helm {cmd[0]} accepted {setting}"
        assert named in out, f"helm {cmd[0]} --set {setting}: the error does not name {named!r}:\n{out}"
