"""A capture the agent refuses for a reason that will not go away (issue 18): the worker is back in
serving at once and is not asked again until the policy changes. On the real node (kubelet,
containerd, runc; dynsnap installed by ``helm install``: realnodeenv.py), each case its own graph of
examples/dgd/agg.yaml under the local overlay.

Two idle workers of one component (min-active 1, tier snapshot) whose entrypoint makes every snapshot
impossible, for real: started with ``--no-seccomp`` (the agent refuses ``SeccompOff``), or in a
container without capabilities (writing ns_last_pid is refused: containerd mounts /proc/sys read-only
besides) and told not to cycle pids instead (the reservation fails: the agent refuses
``PidReservationMissing``; the entrypoint's control file and log say the reservation failed, and
nothing is saved). The controller quiesces one for idleness and asks for the capture; the agent
refuses it. Then, for each worker in turn (the planner picks the other once the first is back):

- the refusal on record (``status.controller.refusal``: the agent's reason, the pod UID, the spec's
  generation, the policy's hash) and a Warning Event ``CaptureRefused`` naming the reason;
- back in serving: desiredState Active, the return verified (a recall: the worker never left), its
  serving gate True, kubelet's Ready True, its EndpointSlice endpoint ready, and requests pinned to it
  answered by it;
- never quiesced again while it stays idle (no new quiesce, desiredState Active throughout a window
  of several idle-afters);
- once the component's policy changes (tier suspend, which needs neither the io_uring filter nor the
  pid reservation), quiesced again and captured, and the refusal gone from the record.

Before issue 18 the refused worker stayed out of serving, its gate False, its pinned requests
answered 400, while the agent retried (the controller had set Suspended and counted it asleep).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from controllerenv import asleep, cond, events_for, gate_of, get_ws, history, policy, wait_ws
from faultsenv import io_uring_fds
from realnodecycle import back_after_refusal
from realnodeenv import WORKER_COMPONENT, Env, component_policy, deployed, edit_dgd
from realnodefacts import container_procs, control_file, kubelet_facts, stub_state
from refusalenv import maps

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import Graph, NodePod

pytestmark = pytest.mark.cluster

IDLE_AFTER = 2  # seconds
QUIET_WINDOW = 12.0  # several idle-afters: long enough for the planner to have asked again, had it


def no_seccomp(main: Obj) -> None:
    """The entrypoint told not to install its io_uring filter: the agent refuses SeccompOff."""
    cmd: list[str] = main["command"]
    cmd.insert(cmd.index("--"), "--no-seccomp")


def no_pid_reservation(main: Obj) -> None:
    """The worker container without capabilities (writing ns_last_pid is refused) and the entrypoint told
    not to cycle pids instead: the reservation fails and the agent refuses PidReservationMissing."""
    cmd: list[str] = main["command"]
    cmd.insert(cmd.index("--"), "--no-pid-cycle")
    main.setdefault("securityContext", {})["capabilities"] = {"drop": ["ALL"]}


CASES: dict[str, Callable[[Obj], None]] = {"SeccompOff": no_seccomp, "PidReservationMissing": no_pid_reservation}



def graph(env: Env, name: str, spoil: Callable[[Obj], None]) -> Obj:
    """examples/dgd/agg.yaml as the case's graph: the graph's policy, the component's own (on its pod
    template), and the worker's command or container spoiled by ``spoil``."""
    body = chart_node.example_body(env, name=name, policy=policy(
        enabled=True, idle_after=f"{IDLE_AFTER}s", tier="snapshot", wake_at_inflight=1))
    component_policy(body, WORKER_COMPONENT, policy(min_active=1, verify_requests=2))
    worker = next(c for c in body["spec"]["components"] if c["name"] == WORKER_COMPONENT)
    spoil(next(c for c in worker["podTemplate"]["spec"]["containers"] if c["name"] == "main"))
    return body


def record(ws: Obj | None) -> dict[str, Any]:
    rec: dict[str, Any] = ((ws or {}).get("status") or {}).get("controller") or {}
    return rec


async def assert_serving(env: Env, pod: NodePod) -> None:
    """Gate True, kubelet's Ready True, endpoint ready, and requests pinned to it answered by it."""
    live = await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    assert gate_of(live) == "True", live["status"]
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in live["status"]["conditions"]), live["status"]
    ep = await env.cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")
    assert ep is not None and ep["conditions"].get("ready") is True, ep
    wid = instance_id_from_dwm(await env.api.get(R.DWMS, pod.name, namespace=pod.namespace))
    assert env.fe is not None
    for _ in range(3):
        answer = await env.fe.chat("still yours?", worker_id=wid, max_tokens=2)
        assert answer.status == 200 and answer.worker_id == wid, answer.body


async def set_tier(env: Env, g: Graph, tier: str) -> None:
    """What a user's `kubectl edit` of the DGD does: the graph's dynsnap.io/tier changed."""
    def change(obj: Obj) -> None:
        obj["metadata"].setdefault("annotations", {})[P.ANN_TIER] = tier
    await edit_dgd(env, g, change)


def refused_before_any_change(env: Env, pod: NodePod, container_id: str, ws: Obj, mark: int) -> None:
    """The agent's account of a SeccompOff refusal (moved from the sandbox's test_agent_faults.py): at the
    quiesce step, its message naming the filter and why CRIU needs it, Degraded; and nothing changed: not
    one lock of the worker's GPU processes since the graph was deployed (the stub driver's log), each
    running in the driver, no image; and the ring the filter would have refused is there."""
    err = ws["status"]["lastError"]
    assert err["reason"] == "SeccompOff" and err["step"] == "quiesce", err
    assert "io_uring filter is 'off'" in err["message"] and "CRIU cannot dump io_uring" in err["message"], err
    cap = ws["status"]["lastCapture"]
    assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce"], cap
    degraded = cond(ws, "Degraded")
    assert degraded is not None and degraded["status"] == "True" and degraded["reason"] == "SeccompOff", degraded
    procs = container_procs(pod.uid, container_id)
    gpu = [p for p in procs.tree if "libcuda.so.1" in maps(p)]
    assert gpu, f"the worker maps the (stub) driver: {procs}"
    locks = [c for c in env.driver.calls()[mark:] if c.startswith("cuCheckpointProcessLock ")
             and any(f" pid={p} " in c + " " for p in gpu)]
    assert locks == [], locks
    assert [stub_state(env.driver, p) for p in gpu] == [0] * len(gpu), "every GPU process running in the driver"
    assert not ws["status"].get("image"), ws["status"]
    # Not refused one by the entrypoint, Dynamo's runtime takes an io_uring ring (containerd's RuntimeDefault
    # profile, kubelet's seccompDefault, allows it): the thing CRIU could not dump, never reached.
    rings = {p: io_uring_fds(p) for p in procs.tree if io_uring_fds(p)}
    assert rings, "the mocker holds an io_uring ring when the entrypoint does not refuse it"


@pytest.mark.parametrize("reason", list(CASES))
async def test_a_capture_refused_for_good_puts_the_worker_back_into_serving_and_is_not_asked_again(
        env: Env, reason: str) -> None:
    mark = len(env.driver.calls())
    async with deployed(env, graph(env, f"refuse-{reason.lower()}", CASES[reason])) as g:
        workers = g.workers(WORKER_COMPONENT)
        for pod in workers:  # the planner takes them in turn: one refused and back, then the other
            ws = await wait_ws(env, pod, f"refused {reason}, back in serving, verified", back_after_refusal(reason),
                               timeout=180)
            ref = record(ws)["refusal"]
            # For the record (docs): from the agent's refusal to the return proven, by the records' clocks.
            print(f"{pod.name}: refused {ref['reason']} at {ref['at']}, back in serving (verified) at "
                  f"{record(ws)['verification']['finished']}")
            assert ref["podUID"] == pod.uid and ref["generation"] == ws["metadata"]["generation"]
            assert ref["captureId"] == record(ws)["capture"]["id"] and record(ws)["capture"]["ok"] is False
            assert record(ws)["capture"]["error"]["reason"] == reason
            cid = (await kubelet_facts(env.api, pod)).container_id
            if reason == "SeccompOff":
                refused_before_any_change(env, pod, cid, ws, mark)
            if reason == "PidReservationMissing":  # the entrypoint's own account; nothing was saved
                info = control_file(container_procs(pod.uid, cid).entrypoint)
                assert info["pid_reserved"] is False and info["state"] == "active", info
                log = await env.pod_log(pod.namespace, pod.name, "main", tail=100000)
                assert "PID RESERVATION FAILED" in log, log[:2000]
                assert not ws["status"].get("image"), ws["status"]
            await assert_serving(env, pod)
            warned = [e for e in await events_for(env.api, pod.namespace, pod.name)
                      if e["type"] == "Warning" and e["reason"] == "CaptureRefused"]
            assert warned and reason in warned[-1]["note"], warned
        # Idle, but never asked again: no new quiesce, Active wanted throughout, and the agent never tried the
        # capture again (a permanent refusal: the same last capture, one failure on record).
        now = {p.name: await get_ws(env.api, p) for p in workers}
        quiesced = {name: record(ws)["quiesce"]["id"] for name, ws in now.items()}
        captures = {name: (ws or {})["status"]["lastCapture"]["id"] for name, ws in now.items()}
        async with history(env.api, R.WORKER_SNAPSHOTS, workers[0]) as first, \
                history(env.api, R.WORKER_SNAPSHOTS, workers[1]) as second:
            await asyncio.sleep(QUIET_WINDOW)
        for pod, seen in zip(workers, (first, second), strict=True):
            assert {record(v)["quiesce"]["id"] for v in seen} == {quiesced[pod.name]}, pod.name
            assert {v["spec"]["desiredState"] for v in seen} == {"Active"}, pod.name
            assert {v["status"]["lastCapture"]["id"] for v in seen} == {captures[pod.name]}, pod.name
            assert {v["status"].get("consecutiveFailures") for v in seen} == {1}, pod.name
            assert (seen[-1]["status"].get("idle") or {}).get("idleSince"), f"{pod.name} is not idle"
            await assert_serving(env, pod)
        # The policy changes: asked again, and at tier suspend the capture is not refused.
        await set_tier(env, g, "suspend")
        slept = await wait_ws_any(env, workers, lambda ws: asleep(ws) and record(ws)["quiesce"]["id"] not in
                                  quiesced.values())
        assert "refusal" not in record(slept) and slept["spec"]["tier"] == "suspend", record(slept)


async def wait_ws_any(env: Env, pods: list[NodePod], check: Callable[[Obj | None], bool],
                      timeout: float = 120) -> Obj:
    """The first WorkerSnapshot of ``pods`` for which ``check`` holds."""
    async def probe() -> Obj | None:
        for pod in pods:
            ws = await get_ws(env.api, pod)
            if check(ws):
                return ws
        return None
    found: Obj = await wait_for("a worker quiesced again and captured", probe, timeout=timeout, interval=0.3)
    return found
