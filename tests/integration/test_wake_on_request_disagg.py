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
from controllerenv import CtlEnv, get_ws, policy, running, verified_after, wait_ws
from routablecheck import all_asleep, in_serving

from dynsnap.k8s.client import Obj
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod
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


async def _all_asleep(env: CtlEnv, component: str, timeout: float = 180) -> RunningPod:
    return await all_asleep(env.api, env.graph.workers(component), component, timeout)


async def _in_serving(env: CtlEnv, pod: RunningPod) -> None:
    await in_serving(env.cluster, env.fe, pod)


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
