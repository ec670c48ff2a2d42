"""`dynsnap status`, `dynsnap suspend POD` and `dynsnap wake POD` against the real API server, run as
a person would run them: ``python -m dynsnap ...`` as its own process, with a kubeconfig for a service
account bound to the ClusterRole of deploy/rbac/user.yaml (a token from the TokenRequest API), so a
request that role does not allow fails the test.

No Dynamo and no agent here: the pods are API objects on kwok's fake nodes, and the test plays the
agent and the controller by writing the WorkerSnapshot's status as each does (server-side apply of
status under the agent's field manager for its part, under the controller's for ``status.controller``
and ``Verified``). What is asserted is what the commands print, the exit code they end with, and
what they changed (the WorkerSnapshot's ``dynsnap.io/override``, under the CLI's field manager) or did not;
the pod is never written (the role has no ``pods: patch`` since the override left the pod annotation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, LocalCluster
from dynsnap.testenv.dynsnap_parts import ROOT, install_dynsnap, token_kubeconfig

pytestmark = pytest.mark.cluster

NS = TEST_NAMESPACE
GRAPH = "graph-cli"
USER_SA = "cli-user"  # bound cluster-wide (ClusterRoleBinding)
NS_USER_SA = "cli-user-ns"  # bound in NS only (RoleBinding), as deploy/rbac/user.yaml recommends
CLI_BOUND = 120.0  # a CLI run that takes longer than this is stuck: the test fails instead of hanging


@dataclass
class Users:
    kubeconfig: Path  # cluster-wide binding
    ns_kubeconfig: Path  # namespace binding


@pytest.fixture(scope="module")
async def users(cluster: LocalCluster) -> AsyncIterator[Users]:
    api = cluster.api
    await install_dynsnap(cluster)
    (role,) = list(yaml.safe_load_all((ROOT / "deploy" / "rbac" / "user.yaml").read_text()))
    assert role["kind"] == "ClusterRole" and role["metadata"]["name"] == "dynsnap-user"
    await api.apply(R.CLUSTER_ROLES, role, force=True)
    ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "dynsnap-user"}
    for sa in (USER_SA, NS_USER_SA):
        await api.apply(R.SERVICE_ACCOUNTS, {"metadata": {"name": sa, "namespace": NS}}, force=True)
    await api.apply(R.CLUSTER_ROLE_BINDINGS, {"metadata": {"name": f"test:{USER_SA}"}, "roleRef": ref,
                                              "subjects": [{"kind": "ServiceAccount", "name": USER_SA,
                                                            "namespace": NS}]}, force=True)
    await api.apply(R.ROLE_BINDINGS, {"metadata": {"name": f"test:{NS_USER_SA}", "namespace": NS}, "roleRef": ref,
                                      "subjects": [{"kind": "ServiceAccount", "name": NS_USER_SA,
                                                    "namespace": NS}]}, force=True)
    with tempfile.TemporaryDirectory(prefix="dynsnap-cli-") as d:
        yield Users(kubeconfig=await token_kubeconfig(cluster, namespace=NS, sa=USER_SA, path=Path(d) / "user"),
                    ns_kubeconfig=await token_kubeconfig(cluster, namespace=NS, sa=NS_USER_SA,
                                                         path=Path(d) / "ns-user"))


# -- the cluster side: pods, WorkerSnapshots, and the status the agent and the controller write ----------

def ts(seconds_ago: float = 0.0) -> str:
    return (datetime.now(UTC) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def cond(ctype: str, status: str, reason: str, message: str = "") -> Obj:
    return {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": ts()}


def op(op_id: str, steps: list[tuple[str, float]], *, tier: str = "suspend", done: bool = False,
       started: float = 5.0) -> Obj:
    rec: Obj = {"id": op_id, "tier": tier, "started": ts(started),
                "steps": [{"name": n, "seconds": s} for n, s in steps]}
    if done:
        rec.update(finished=ts(), ok=True)
    return rec


def verification(wake_id: str, *, ok: bool | None, answered: int, requests: int = 3, reason: str = "Verified",
                 message: str = "", fallback: str | None = None) -> Obj:
    v: Obj = {"wakeId": wake_id, "reason": reason, "message": message, "started": ts(2), "requests": requests,
              "answered": answered, "workerId": 4242, "headers": [P.HEADER_WORKER_INSTANCE_ID]}
    if ok is not None:
        v.update(ok=ok, finished=ts())
    if fallback is not None:
        v["fallback"] = fallback
    return v


@dataclass
class Worker:
    """A worker pod (an API object on a kwok node) and its WorkerSnapshot, written as admin."""

    api: Kube
    name: str
    uid: str = ""
    agent_status: Obj = field(default_factory=dict)

    async def pod(self) -> Obj:
        return await self.api.get(R.PODS, self.name, namespace=NS)

    async def override(self) -> str | None:
        """The WorkerSnapshot's dynsnap.io/override (what `dynsnap suspend|wake` writes)."""
        ws = await self.api.get(R.WORKER_SNAPSHOTS, self.name, namespace=NS)
        value: str | None = (ws["metadata"].get("annotations") or {}).get(P.ANN_OVERRIDE)
        return value

    async def agent(self, **status: Any) -> None:
        """Write status as the agent does: its whole part, every time (SSA drops what it stops sending)."""
        self.agent_status.update(status)
        await self.api.apply(R.WORKER_SNAPSHOTS, {"metadata": {"name": self.name, "namespace": NS},
                                                  "status": self.agent_status},
                             subresource="status", field_manager=P.AGENT_FIELD_MANAGER, force=True)

    async def controller(self, record: Obj, *, verified: Obj | None = None) -> None:
        """Write the controller's part of status (its record and the Verified condition)."""
        status: Obj = {"controller": record}
        if verified is not None:
            status["conditions"] = [verified]
        await self.api.apply(R.WORKER_SNAPSHOTS, {"metadata": {"name": self.name, "namespace": NS},
                                                  "status": status},
                             subresource="status", field_manager=P.FIELD_MANAGER, force=True)

    async def desire(self, state: str) -> None:
        """Set spec.desiredState as the controller does when it honours the override."""
        await self.api.merge_patch(R.WORKER_SNAPSHOTS, self.name, {"spec": {"desiredState": state}}, namespace=NS)


async def make_worker(cluster: LocalCluster, name: str, *, component: str = "decode", tier: str = "suspend",
                      desired: str | None = "Active") -> Worker:
    """The pod, and (``desired`` not None) its WorkerSnapshot, owned by it, as the controller creates it."""
    labels = {P.LABEL_DGD_NAME: GRAPH, P.LABEL_COMPONENT: component, P.LABEL_COMPONENT_TYPE: "worker"}
    pod = await cluster.api.create(R.PODS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"nodeName": NODES[0], "containers": [{"name": "main", "image": "dynamo-worker:test"}]}})
    w = Worker(cluster.api, name, pod["metadata"]["uid"])
    if desired is not None:
        await cluster.api.create(R.WORKER_SNAPSHOTS, {
            "apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
            "metadata": {"name": name, "namespace": NS, "labels": {P.LABEL_NODE: NODES[0]},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": w.uid}]},
            "spec": {"podName": name, "podUID": w.uid, "tier": tier, "desiredState": desired}})
    return w


@pytest.fixture
async def workers(cluster: LocalCluster, users: Users) -> AsyncIterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for w in made:
        for res in (R.WORKER_SNAPSHOTS, R.PODS):
            with contextlib.suppress(NotFound):
                await cluster.api.delete(res, w.name, namespace=NS, grace_period_seconds=0)


# -- the CLI, as its own process ------------------------------------------------------------------------

def cli_argv(*args: str, kubeconfig: Path) -> list[str]:
    return [sys.executable, "-m", "dynsnap", *args, "--kubeconfig", str(kubeconfig)]


def cli_env() -> dict[str, str]:
    # Nothing from the test's environment may pick the cluster or the identity: only --kubeconfig does.
    return {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}


async def run_cli(*args: str, kubeconfig: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*cli_argv(*args, kubeconfig=kubeconfig), cwd=ROOT, env=cli_env(),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=CLI_BOUND)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class Cli:
    """A CLI process whose output the test reads line by line while it plays the agent and the controller."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._err = asyncio.ensure_future(proc.stderr.read() if proc.stderr else asyncio.sleep(0))

    @classmethod
    async def start(cls, *args: str, kubeconfig: Path) -> Cli:
        proc = await asyncio.create_subprocess_exec(*cli_argv(*args, kubeconfig=kubeconfig), cwd=ROOT,
                                                    env=cli_env(), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        return cls(proc)

    async def expect(self, pattern: str, *, timeout: float = 60.0) -> str:
        """Read output until a line matches ``pattern`` (a regex); fail on end of output or timeout."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout=deadline - time.monotonic())
            except TimeoutError:
                break
            if not raw:
                raise AssertionError(f"output ended (exit {await self.proc.wait()}) before a line matching "
                                     f"{pattern!r}:\n{self.text}\nstderr:\n{await self.stderr()}")
            line = raw.decode().rstrip("\n")
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f}s:\n{self.text}")

    async def exit_code(self, *, timeout: float = CLI_BOUND) -> int:
        assert self.proc.stdout is not None
        rest = await asyncio.wait_for(self.proc.stdout.read(), timeout=timeout)
        self.lines += rest.decode().splitlines()
        return await asyncio.wait_for(self.proc.wait(), timeout=timeout)

    async def stderr(self) -> str:
        return (await asyncio.wait_for(self._err, timeout=CLI_BOUND) or b"").decode()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        self._err.cancel()


@pytest.fixture
async def clis() -> AsyncIterator[list[Cli]]:
    started: list[Cli] = []
    yield started
    for c in started:
        await c.close()


def line_of(output: str, pod: str) -> str:
    found = [line for line in output.splitlines() if re.search(rf"\s{re.escape(pod)}\s", line)]
    assert len(found) == 1, f"expected one row for {pod}:\n{output}"
    return found[0]


# -- status -------------------------------------------------------------------------------------------

ASLEEP_STEPS = [("quiesce", 0.25), ("save", 1.5), ("settle-suspended", 0.25)]
WAKE_STEPS = [("wake", 0.1), ("resume", 0.6), ("settle-active", 0.05)]


async def asleep(w: Worker, *, wake_id: str = "w0") -> None:
    """A worker woken and verified once (wake ``wake_id``), then captured: asleep now."""
    await w.desire("Suspended")
    await w.agent(state="Suspended", idle={"inflight": 0, "idleSince": ts(9000)},
                  lastCapture=op("c1", ASLEEP_STEPS, done=True), lastWake=op(wake_id, WAKE_STEPS, done=True,
                                                                             started=3600),
                  conditions=[cond("Accepted", "True", "Accepted"), cond("Suspended", "True", "Suspended")])
    await w.controller({"verification": verification(wake_id, ok=True, answered=3)},
                       verified=cond("Verified", "True", "Verified"))


async def test_status_lists_each_worker_with_state_tier_idle_capture_wake_and_proof(
        cluster: LocalCluster, users: Users, workers: list[Worker]) -> None:
    a = await make_worker(cluster, "cli-status-a")
    b = await make_worker(cluster, "cli-status-b", component="prefill", tier="snapshot")
    workers += [a, b]
    await asleep(a)
    rc, out, err = await run_cli("status", "-n", NS, kubeconfig=users.kubeconfig)
    assert rc == 0, err
    header = out.splitlines()[0]
    assert header.split() == ["DGD", "COMPONENT", "POD", "STATE", "TIER", "IDLE", "FOR", "LAST", "CAPTURE", "LAST",
                              "WAKE", "VERIFIED", "BY"]
    row_a = line_of(out, a.name)
    cols = re.split(r"\s{2,}", row_a)
    assert cols[:5] == [GRAPH, "decode", a.name, "Suspended", "suspend"], row_a
    assert cols[5].startswith("2h")  # idle since 9000 s before the status was written
    assert re.fullmatch(r"2\.00s, \d+s ago", cols[6]) and re.fullmatch(r"0\.75s, \d+s ago", cols[7]), row_a
    assert re.fullmatch(r"3/3 pinned \d+s ago", cols[8]), row_a
    # No status yet (the agent has not seen it): shown, with its graph and component from the pod.
    assert re.split(r"\s{2,}", line_of(out, b.name)) == [GRAPH, "prefill", b.name, "-", "snapshot", "-", "-", "-",
                                                           "-"]

    rc, out, err = await run_cli("status", "-n", NS, "-o", "json", kubeconfig=users.kubeconfig)
    assert rc == 0, err
    rows = {r["pod"]: r for r in json.loads(out)["items"]}
    ra = rows[a.name]
    assert (ra["dgd"], ra["component"], ra["state"], ra["desiredState"], ra["tier"]) == (
        GRAPH, "decode", "Suspended", "Suspended", "suspend")
    assert ra["lastCapture"]["id"] == "c1" and ra["lastCapture"]["seconds"] == 2.0
    assert [s["name"] for s in ra["lastCapture"]["steps"]] == ["quiesce", "save", "settle-suspended"]
    assert ra["verification"]["wakeId"] == "w0" and ra["verification"]["ok"] is True
    assert (ra["verification"]["answered"], ra["verification"]["requests"]) == (3, 3)
    assert rows[b.name]["state"] is None and rows[b.name]["component"] == "prefill"

    # Bound in the namespace only (the recommended binding): that namespace works, all namespaces are refused.
    rc, out, err = await run_cli("status", "-n", NS, kubeconfig=users.ns_kubeconfig)
    assert rc == 0 and a.name in out, err
    rc, out, err = await run_cli("status", "-A", kubeconfig=users.ns_kubeconfig)
    assert rc == 2 and out == "", out
    assert "forbidden" in err and "cannot list resource \"workersnapshots\"" in err and "dynsnap-user" in err, err


async def test_status_watch_prints_a_row_again_when_it_changes(
        cluster: LocalCluster, users: Users, workers: list[Worker], clis: list[Cli]) -> None:
    w = await make_worker(cluster, "cli-watch")
    workers.append(w)
    await w.agent(state="Active", idle={"inflight": 0, "idleSince": ts(30)},
                  conditions=[cond("Accepted", "True", "Accepted")])
    cli = await Cli.start("status", "-n", NS, "--watch", kubeconfig=users.kubeconfig)
    clis.append(cli)
    await cli.expect(rf"\s{w.name}\s+Active\s")
    # The controller opens its quiesce record, then the agent starts capturing.
    await w.controller({"quiesce": op("q1", [("serving-gate", 0.01)], started=1)})
    await cli.expect(rf"\s{w.name}\s+Active \(quiescing\)\s")
    await w.desire("Suspended")
    await w.agent(state="Capturing", lastCapture=op("c1", [("quiesce", 0.2), ("save", 1.0)], started=1))
    line = await cli.expect(rf"\s{w.name}\s+Capturing\s")
    assert "running save" in line, line
    cli.proc.send_signal(signal.SIGINT)
    assert await cli.exit_code() == 0, await cli.stderr()


# -- wake -----------------------------------------------------------------------------------------------

async def test_wake_sets_the_override_and_exits_0_only_once_the_new_wake_is_verified(
        cluster: LocalCluster, users: Users, workers: list[Worker], clis: list[Cli]) -> None:
    w = await make_worker(cluster, "cli-wake-ok")
    workers.append(w)
    await asleep(w, wake_id="w0")  # its earlier wake w0 was verified: no proof of the next one
    cli = await Cli.start("wake", w.name, "-n", NS, "--timeout", "240", kubeconfig=users.kubeconfig)
    clis.append(cli)
    await cli.expect(rf"^pod {NS}/{w.name}: override Active \(was: unset\)$")
    await cli.expect(r"^following WorkerSnapshot")
    assert await w.override() == "Active"
    ws = await cluster.api.get(R.WORKER_SNAPSHOTS, w.name, namespace=NS)
    managers = {m["manager"] for m in ws["metadata"].get("managedFields") or []
                if f"f:{P.ANN_OVERRIDE}" in json.dumps(m.get("fieldsV1"))}
    assert managers == {P.CLI_FIELD_MANAGER}
    pod = await w.pod()  # the pod is not written: the user role has no pods: patch
    assert P.ANN_DESIRED_STATE not in (pod["metadata"].get("annotations") or {})
    assert P.CLI_FIELD_MANAGER not in {m["manager"] for m in pod["metadata"].get("managedFields") or []}

    # The controller honours the override; the agent wakes the worker step by step.
    await w.desire("Active")
    await w.agent(state="Waking", lastWake=op("w1", [("wake", 0.12)], started=1))
    await cli.expect(r"^  wake: wake 0\.12s$")
    await w.agent(state="Active", lastWake=op("w1", [("wake", 0.12), ("resume", 0.5), ("settle-active", 0.03)],
                                              done=True, started=1),
                  conditions=[cond("Accepted", "True", "Accepted"), cond("Suspended", "False", "Active")])
    await cli.expect(r"^  woken in 0\.65s \(wake 0\.12s, resume 0\.50s, settle-active 0\.03s\)$")
    await cli.expect(r"^  waiting for the controller's verification$")
    # The controller verifies: 1 of 3 pinned requests answered so far. The CLI shows it and keeps going:
    # a finished wake, and w0's old verification, are no proof of w1.
    await w.controller({"verification": verification("w1", ok=None, answered=1, reason="Verifying")},
                       verified=cond("Verified", "Unknown", "Verifying"))
    await cli.expect(r"^  verifying: 1/3 pinned requests answered$")
    assert cli.proc.returncode is None
    await w.controller({"verification": verification("w1", ok=True, answered=3)},
                       verified=cond("Verified", "True", "Verified"))
    assert await cli.exit_code() == 0, f"{cli.text}\n{await cli.stderr()}"
    assert cli.lines[-1] == "verified: 3/3 pinned requests answered by worker 4242 (wake w1, woken in 0.65s)"


async def test_wake_whose_verification_fails_exits_1_with_the_reason_and_the_fallback(
        cluster: LocalCluster, users: Users, workers: list[Worker], clis: list[Cli]) -> None:
    w = await make_worker(cluster, "cli-wake-bad")
    workers.append(w)
    await asleep(w)
    cli = await Cli.start("wake", w.name, "-n", NS, kubeconfig=users.kubeconfig)
    clis.append(cli)
    await cli.expect(r"^following WorkerSnapshot")
    await w.desire("Active")
    await w.agent(state="Active", lastWake=op("w1", WAKE_STEPS, done=True, started=1),
                  conditions=[cond("Accepted", "True", "Accepted"), cond("Suspended", "False", "Active")])
    await w.controller({"verification": verification(
        "w1", ok=False, answered=0, reason="AnsweredByAnotherWorker",
        message="pinned request 1/3 answered by worker 77, not 4242", fallback="ColdRestart")},
        verified=cond("Verified", "False", "AnsweredByAnotherWorker"))
    assert await cli.exit_code() == 1, f"{cli.text}\n{await cli.stderr()}"
    assert cli.lines[-1] == ("verification FAILED: AnsweredByAnotherWorker: pinned request 1/3 answered by "
                             "worker 77, not 4242; fallback: ColdRestart (wake w1)")


async def test_wake_all_sets_every_override_first_skips_a_gone_pod_and_names_a_failed_wake(
        cluster: LocalCluster, users: Users, workers: list[Worker], clis: list[Cli]) -> None:
    """`dynsnap wake --all -n NS` (the Helm chart's uninstall hook runs it) under the dynsnap-user role:
    the override on every managed worker before any is followed; a worker awake all along is done at
    once; a WorkerSnapshot whose pod is gone is skipped, and said so; exit 1 naming the worker whose wake
    was not verified, once the others are done."""
    ok, bad, awake = [await make_worker(cluster, f"cli-all-{n}") for n in ("ok", "bad", "awake")]
    workers += [ok, bad, awake]
    await asleep(ok, wake_id="w0")
    await asleep(bad, wake_id="w0")
    await awake.agent(state="Active", conditions=[cond("Accepted", "True", "Accepted"),
                                                  cond("Suspended", "False", "Active")])
    # A WorkerSnapshot left by a pod that is gone (no owner reference, so the garbage collector keeps it).
    await cluster.api.create(R.WORKER_SNAPSHOTS, {
        "apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
        "metadata": {"name": "cli-all-gone", "namespace": NS, "labels": {P.LABEL_NODE: NODES[0]}},
        "spec": {"podName": "cli-all-gone", "podUID": "0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f", "tier": "suspend",
                 "desiredState": "Suspended"}})
    workers.append(Worker(cluster.api, "cli-all-gone"))
    cli = await Cli.start("wake", "--all", "-n", NS, "--timeout", "120", kubeconfig=users.kubeconfig)
    clis.append(cli)
    await cli.expect(rf"^waking every worker dynsnap manages in namespace {NS}: \d+ WorkerSnapshots$")
    await cli.expect(rf"^pod {NS}/cli-all-gone: skipped, its pod is gone$")
    await cli.expect(rf"^pod {NS}/{ok.name}: override Active \(was: unset\)$")  # the last, by name
    for w in (ok, bad, awake):  # every override is set before any worker is woken
        assert await w.override() == "Active", w.name
    ok_ws = await cluster.api.get(R.WORKER_SNAPSHOTS, ok.name, namespace=NS)
    assert ok_ws["status"]["state"] == "Suspended", ok_ws["status"]
    for w in (ok, bad):  # the controller honours the overrides; the agent wakes both
        await w.desire("Active")
        await w.agent(state="Active", lastWake=op("w1", WAKE_STEPS, done=True, started=1),
                      conditions=[cond("Accepted", "True", "Accepted"), cond("Suspended", "False", "Active")])
    await bad.controller({"verification": verification(
        "w1", ok=False, answered=0, reason="PinnedRequestFailed", message="pinned request 1/3: 503",
        fallback="ColdRestart")}, verified=cond("Verified", "False", "PinnedRequestFailed"))
    await cli.expect(r"^verification FAILED: PinnedRequestFailed")
    assert cli.proc.returncode is None  # the other wake is still followed
    await ok.controller({"verification": verification("w1", ok=True, answered=3)},
                        verified=cond("Verified", "True", "Verified"))
    assert await cli.exit_code() == 1, f"{cli.text}\n{await cli.stderr()}"
    assert "active: the worker never slept, nothing to wake" in cli.lines, cli.text
    assert "verified: 3/3 pinned requests answered by worker 4242 (wake w1, woken in 0.75s)" in cli.lines, cli.text
    assert cli.lines[-1] == f"2 of 3 awake, 1 skipped; failed: {NS}/{bad.name}"


# -- suspend --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fails", [False, True], ids=["captured", "capture-fails"])
async def test_suspend_follows_quiesce_and_capture_to_the_outcome(
        cluster: LocalCluster, users: Users, workers: list[Worker], clis: list[Cli], fails: bool) -> None:
    w = await make_worker(cluster, f"cli-suspend-{'bad' if fails else 'ok'}", tier="snapshot")
    workers.append(w)
    await w.agent(state="Active", idle={"inflight": 0, "idleSince": ts(5)},
                  conditions=[cond("Accepted", "True", "Accepted"), cond("Suspended", "False", "Active")])
    cli = await Cli.start("suspend", w.name, "-n", NS, kubeconfig=users.kubeconfig)
    clis.append(cli)
    await cli.expect(rf"^pod {NS}/{w.name}: override Suspended \(was: unset\)$")
    assert await w.override() == "Suspended"
    await w.controller({"quiesce": op("q1", [("serving-gate", 0.02)], tier="snapshot", started=1)})
    await cli.expect(r"^  quiesce: serving-gate 0\.02s$")
    await w.controller({"quiesce": op("q1", [("serving-gate", 0.02), ("endpoint-not-ready", 0.9)], tier="snapshot",
                                      done=True, started=1)})
    await w.desire("Suspended")
    await w.agent(state="Capturing", lastCapture=op("c1", [("quiesce", 0.2), ("save", 1.1)], tier="snapshot",
                                                    started=1))
    await cli.expect(r"^  capture: save 1\.10s$")
    if fails:
        err = {"reason": "DumpFailed", "message": "criu dump exited 1: Can't dump ghost file", "step": "dump",
               "at": ts()}
        failed = op("c1", [("quiesce", 0.2), ("save", 1.1), ("dump", 0.0)], tier="snapshot", started=1)
        failed.update(finished=ts(), ok=False, error=err)
        await w.agent(state="Active", lastCapture=failed, lastError=err, consecutiveFailures=1,
                      conditions=[cond("Accepted", "True", "Accepted"), cond("Suspended", "False", "Active"),
                                  cond("Degraded", "True", "DumpFailed", err["message"])])
        assert await cli.exit_code() == 1, f"{cli.text}\n{await cli.stderr()}"
        assert "  failed at dump: DumpFailed: criu dump exited 1: Can't dump ghost file" in cli.lines
        assert cli.lines[-1] == "capture FAILED: Degraded DumpFailed: criu dump exited 1: Can't dump ghost file"
        return
    steps = [("quiesce", 0.2), ("save", 1.1), ("dump", 2.5), ("seal", 0.1), ("settle-snapshotted", 0.1)]
    await w.agent(state="Suspended", lastCapture=op("c1", steps, tier="snapshot", done=True, started=1),
                  conditions=[cond("Accepted", "True", "Accepted"), cond("Suspended", "True", "Snapshotted")])
    assert await cli.exit_code() == 0, f"{cli.text}\n{await cli.stderr()}"
    assert "  capture: dump 2.50s" in cli.lines and "  Suspended=True Snapshotted" in cli.lines
    assert cli.lines[-1] == ("suspended, tier snapshot (captured in 4.00s: quiesce 0.20s, save 1.10s, dump 2.50s, "
                             "seal 0.10s, settle-snapshotted 0.10s)")


# -- bad input, no-follow, timeout ------------------------------------------------------------------------

async def test_bad_input_exits_2_and_changes_nothing(cluster: LocalCluster, users: Users,
                                                     workers: list[Worker]) -> None:
    plain = await make_worker(cluster, "cli-not-opted-in", desired=None)  # a pod with no WorkerSnapshot
    managed = await make_worker(cluster, "cli-opted-in")  # NS has dynsnap workers: no hint about the namespace
    workers += [plain, managed]
    rc, out, err = await run_cli("suspend", plain.name, "-n", NS, kubeconfig=users.kubeconfig)
    assert rc == 2 and out == "", out
    assert f"pod {NS}/{plain.name} has no WorkerSnapshot: dynsnap does not manage it" in err, err
    assert "nothing changed" in err
    pod = await plain.pod()
    assert P.ANN_DESIRED_STATE not in (pod["metadata"].get("annotations") or {})
    assert P.CLI_FIELD_MANAGER not in {m["manager"] for m in pod["metadata"].get("managedFields") or []}

    rc, out, err = await run_cli("wake", "no-such-pod", "-n", NS, kubeconfig=users.kubeconfig)
    assert rc == 2 and f"pod {NS}/no-such-pod not found; nothing changed" in err, err
    rc, out, err = await run_cli("wake", plain.name, "-n", "nowhere", kubeconfig=users.kubeconfig)
    assert rc == 2 and "pod nowhere/cli-not-opted-in not found (namespace 'nowhere' has no dynsnap workers" in err
    rc, out, err = await run_cli("wake", plain.name, "-n", "Bad_NS", kubeconfig=users.kubeconfig)
    assert rc == 2 and "namespace 'Bad_NS' is not a valid Kubernetes name" in err, err
    rc, out, err = await run_cli("status", "-n", "Bad_NS", kubeconfig=users.kubeconfig)
    assert rc == 2 and "namespace 'Bad_NS' is not a valid Kubernetes name" in err, err
    assert await managed.override() is None


async def test_no_follow_only_sets_the_override_and_a_timeout_exits_3_with_what_was_last_seen(
        cluster: LocalCluster, users: Users, workers: list[Worker]) -> None:
    w = await make_worker(cluster, "cli-timeout")
    workers.append(w)
    await asleep(w)
    rc, out, err = await run_cli("wake", w.name, "-n", NS, "--no-follow", kubeconfig=users.kubeconfig)
    assert rc == 0, err
    assert out.splitlines() == [f"pod {NS}/{w.name}: override Active (was: unset)"]
    assert await w.override() == "Active"
    # Nobody acts on it (no controller, no agent here): the follower gives up after its timeout.
    rc, out, err = await run_cli("wake", w.name, "-n", NS, "--timeout", "3", kubeconfig=users.kubeconfig)
    assert rc == 3, f"{out}\n{err}"
    assert out.splitlines()[0] == f"pod {NS}/{w.name}: override Active (was: Active)"
    assert re.search(r"^timed out after 3s; last seen: state Suspended, desired Suspended; last capture 2\.00s, "
                     r"\d+s ago; last wake 0\.75s, \d+s ago; verified by 3/3 pinned \d+s ago$", out, re.M), out


# -- status --timeline ----------------------------------------------------------------------------------

def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


async def test_status_timeline_draws_the_workers_last_capture_and_wake_into_a_png(
        cluster: LocalCluster, users: Users, workers: list[Worker], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from dynsnap.controller import timeline as TL

    a = await make_worker(cluster, "cli-timeline-a")
    bare = await make_worker(cluster, "cli-timeline-bare")
    workers += [a, bare]
    await asleep(a)  # capture c1 (2.00 s) and wake w0 (0.75 s) recorded by "the agent"
    await a.controller({"quiesce": op("q1", [("gate", 0.5), ("endpoint-not-ready", 1.25)], done=True, started=60),
                        "verification": verification("w0", ok=True, answered=3)
                        | {"steps": [{"name": "identity+endpoint", "seconds": 0.5},
                                     {"name": "pinned-requests", "seconds": 1.0}]}},
                       verified=cond("Verified", "True", "Verified"))
    png = tmp_path / "a.png"
    rc, out, err = await run_cli("status", "--timeline", a.name, "-n", NS, "-o", str(png), kubeconfig=users.kubeconfig)
    assert rc == 0, err
    # The file is a PNG of the size the layout of this WorkerSnapshot's records asks for...
    ws = await cluster.api.get(R.WORKER_SNAPSHOTS, a.name, namespace=NS)
    ops = TL.operations_of(ws)
    assert [o.kind for o in ops] == ["quiesce", "capture", "wake", "verify"]
    size = _png_size(png.read_bytes())
    assert size == TL.figure_size(TL.layout(ops))
    # ...and the command says what it drew: each operation with the total of its recorded steps.
    assert out.splitlines() == [f"wrote {png} ({size[0]}x{size[1]} px): quiesce (controller) 1.75s; "
                                "capture (suspend) 2.00s; wake (suspend) 0.75s; verify (controller) 1.50s"], out

    # A worker with nothing recorded yet: exit 1, nothing written.
    empty = tmp_path / "bare.png"
    rc, out, err = await run_cli("status", "--timeline", bare.name, "-n", NS, "-o", str(empty),
                                 kubeconfig=users.kubeconfig)
    assert rc == 1 and "no quiesce, capture, wake or verification recorded yet; nothing written" in out, out + err
    assert not empty.exists()
    # A pod dynsnap does not manage, and -o that is neither a format nor (with --timeline) a file: exit 2.
    rc, out, err = await run_cli("status", "--timeline", "no-such-pod", "-n", NS, "-o", str(empty),
                                 kubeconfig=users.kubeconfig)
    assert rc == 2 and f"pod {NS}/no-such-pod has no WorkerSnapshot" in err, err
    rc, out, err = await run_cli("status", "-n", NS, "-o", "yaml", kubeconfig=users.kubeconfig)
    assert rc == 2 and "argument -o/--output: invalid choice: 'yaml'" in err, err
    assert not empty.exists()
