"""Wake on request (issue 20) on a disaggregated graph, in the pod sandboxes: prefill and decode, each
with its own policy (``min-active: 0``, ``wake-on-request``), all asleep routable, one request wakes
the last worker of each and is answered. The rest of the wake-on-request suite runs on the real node
(tests/integration/node/test_wake_on_request.py).

Still in a sandbox because on the real node the stand-in engine's prefill and decode workers each
wait in ``register_model`` for the other's instance and neither becomes Ready (seen 2026-12-02; the
mocker's disaggregated graph runs there, tests/integration/node/test_controller_disagg.py).
"""

from __future__ import annotations

import pytest
from controllerenv import CtlEnv, asleep, get_ws, policy, running, verified_after, wait_ws

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynsnap_parts import StubDriver, engine_worker_component

pytestmark = pytest.mark.cluster

PROMPT = "the same words every time"


def disagg(driver: StubDriver) -> Obj:
    comps = []
    for role in ("prefill", "decode"):
        c = engine_worker_component(role, replicas=1, driver=driver, mode=role, sub=role, gib=0.25, kv_gib=0.25)
        c["annotations"] = policy(min_active=0, wake_on_request=True)  # each component its own policy
        comps.append(c)
    body = D.dgd("wor-disagg", [D.frontend_component(router_mode="kv"), *comps])
    body["metadata"]["annotations"] = policy(enabled=True, idle_after="3s", tier="suspend", wake_at_inflight=4)
    return body


def routable(ws: Obj | None) -> bool:
    """Asleep routable: asleep, and the agent's Suspended condition says Routable."""
    c = next((c for c in ((ws or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Suspended"), None)
    return asleep(ws) and c is not None and c["reason"] == "Routable" and bool((ws or {})["spec"].get("routable"))


async def _all_asleep(env: CtlEnv, component: str, timeout: float = 180) -> RunningPod:
    """Every worker of ``component`` asleep, exactly one routable (the last); that one."""
    pods = env.graph.workers(component)

    async def done() -> RunningPod | None:
        wss = [await get_ws(env.api, p) for p in pods]
        if not all(asleep(ws) for ws in wss):
            return None
        rout = [p for p, ws in zip(pods, wss, strict=True) if routable(ws)]
        assert len(rout) <= 1, "more than one worker of the component sleeps routable"
        return rout[0] if rout else None
    found: RunningPod = await wait_for(f"every {component} asleep, the last routable", done, timeout=timeout,
                                       interval=0.5)
    return found


async def _in_serving(env: CtlEnv, pod: RunningPod) -> None:
    """Asleep and still in serving: pod Ready, gate True, endpoint ready, the model listed."""
    live = await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    conds = {c["type"]: c["status"] for c in live["status"].get("conditions") or []}
    assert conds.get("Ready") == "True" and conds.get(P.CONDITION_SERVING) == "True", conds
    ep = await env.cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")
    assert ep is not None and ep["conditions"]["ready"] is True, ep
    assert await env.fe.model_listed(), "the model left the frontend while its last worker sleeps"


async def _iid(env: CtlEnv, pod: RunningPod) -> int:
    return instance_id_from_dwm(await env.api.get(R.DWMS, pod.name, namespace=pod.namespace))


async def test_a_disaggregated_graph_sleeps_both_roles_routable_and_one_request_wakes_them(
        cluster: LocalCluster) -> None:
    async with running(cluster, disagg) as env:
        pre, dec = env.graph.workers("prefill")[0], env.graph.workers("decode")[0]
        ids = {p.name: await _iid(env, p) for p in (pre, dec)}
        await env.fe.wait_routable(ids[dec.name], prefill_id=ids[pre.name])
        reference = (await env.fe.chat(PROMPT, worker_id=ids[dec.name], prefill_id=ids[pre.name])).text
        assert reference
        for role in ("prefill", "decode"):
            sleeper = await _all_asleep(env, role)
            await _in_serving(env, sleeper)
        before = {p.name: ((await get_ws(env.api, p)) or {})["status"].get("lastWake", {}).get("id")
                  for p in (pre, dec)}
        r = await env.fe.chat(PROMPT)
        assert r.status == 200 and r.text == reference, r.body
        assert (r.worker_id, r.prefill_worker_id) == (ids[dec.name], ids[pre.name])
        triggers = []
        for p in (pre, dec):
            ws = await wait_ws(env, p, "woken and verified", verified_after(before[p.name]), timeout=120)
            triggers.append(ws["status"]["lastWake"].get("trigger"))
        # The role the request reached first is woken by it; the other by it too, or by the demand it
        # makes (the frontend's in-flight count: the existing path), whichever comes first.
        assert "request" in triggers, triggers
