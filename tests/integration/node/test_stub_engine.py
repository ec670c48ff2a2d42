"""The stand-in GPU engine (dynsnap/testenv/stub_engine.py: stands in for vLLM) itself, on the real node
(kubelet, containerd, runc; real_graph.Engine in examples/dgd/agg.yaml and disagg.yaml under the local
overlay, on the stub CUDA driver) behind Dynamo 1.6.1's real frontend, moved from the sandbox suite
test_stub_engine.py. dynsnap is installed (the package's) but the graphs are not opted in
(``dynsnap.io/enabled: "false"``): the chart's controller only sets their serving gates and its agent
has no WorkerSnapshot of theirs to act on. What node/test_engine_tier.py and
node/test_wake_on_request.py build on, shown here:

- the engine is listed by the frontend and answers requests pinned to its instance id, the same text
  for the same prompt, its weights and KV pool allocated on its (stub) device;
- its engine routes behave as Dynamo's vLLM worker's (level 1): ``control/sleep`` unregisters it (a
  pinned request is refused) and frees its device memory; ``control/wake_up`` allocates again and
  registers the same instance, which answers the same text; both idempotent;
- the faults the engine tier's tests need happen for real: a route that answers an error, one that
  never answers (both from the engine's fault file, a read-only hostPath of the test's), a bad body;
  (a worker without routes, 404: node/test_engine_tier.py's EngineRoutesMissing test);
- with the engine's process checkpointed by ``dynsnap-cuda save`` from the node (the stub holds a
  process's own driver calls while it is locked or checkpointed, as the H200's driver does), a request
  pinned to it is held inside its driver call, not refused, while the model stays listed and its system
  port reports it in flight; after ``dynsnap-cuda resume`` that worker answers it, the same text;
- a disaggregated prefill/decode pair pinned with both headers answers what the aggregated engine does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from realnodeenv import WORKER_COMPONENT, Env, deployed, host_dir_mounted, instance_id
from realnodefacts import container_procs, kubelet_facts

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.testenv import chart_node
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import Engine, Graph, NodePod

pytestmark = pytest.mark.cluster

GIB = 1 << 30
WEIGHTS_GIB, KV_GIB = 0.25, 0.5
ENGINE_BYTES = int((WEIGHTS_GIB + KV_GIB) * GIB)
CHECKPOINTED = 2
PROMPT = "What does a sleeping engine say?"
FAULTS_VOLUME = "engine-faults"
DISAGG = chart_node.ROOT / "examples" / "dgd" / "disagg.yaml"
# Not opted in: the chart's controller only lets the gated pods serve, and no WorkerSnapshot exists, so
# the chart's agent leaves the engine alone. (Opted in, the process this module checkpoints with
# dynsnap-cuda was running again, the held request answered, before the test saw it held: the agent's
# planner puts a GPU process that is not running under an active entrypoint back to running,
# GPU_ROLLBACK, as after an interrupted save: tests/unit/test_agent_plan.py's row for it.)
POLICY = {P.ANN_ENABLED: "false"}


@dataclass
class Seng:
    env: Env
    graph: Graph
    fe: D.FrontendClient  # the module's graph's own (a later graph's deploy moves env.fe)
    wid: int
    fault_file: Path

    @property
    def pod(self) -> NodePod:
        return self.graph.workers(WORKER_COMPONENT)[0]


@pytest.fixture(scope="module")
async def seng(env: Env, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Seng]:
    """examples/dgd/agg.yaml with one stand-in engine worker whose fault file is in a directory of the
    node (a read-only hostPath at the same path)."""
    faults = tmp_path_factory.mktemp("engine-faults")
    faults.chmod(0o755)  # the worker runs as the image's user
    fault_file = faults / "faults"
    engine = Engine(gib=WEIGHTS_GIB, kv_gib=KV_GIB, extra=("--fault-file", str(fault_file)))
    body = chart_node.example_body(env, name="seng", worker_replicas=1, engine=engine, policy=POLICY)
    host_dir_mounted(body, FAULTS_VOLUME, faults)
    async with deployed(env, body) as g:
        fe = D.FrontendClient(g.frontend)
        try:
            wid = await instance_id(env, g.workers(WORKER_COMPONENT)[0])
            await fe.wait_routable(wid, timeout=120)
            yield Seng(env, g, fe, wid, fault_file)
        finally:
            await fe.close()


async def route(pod: NodePod, name: str, body: Any = None, *, timeout: float = 20.0) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as http:
        return await http.post(f"http://{pod.ip}:{P.DYNAMO_SYSTEM_PORT}/engine/{name}", json={} if body is None
                               else body)


async def engine_pid(env: Env, pod: NodePod) -> int:
    """The host pid of the engine's process: the worker tree's root, the entrypoint's child."""
    pid = container_procs(pod.uid, (await kubelet_facts(env.api, pod)).container_id).root
    assert b"dynsnap.testenv.stub_engine" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return pid


def cuda(env: Env, action: str, pid: int) -> subprocess.CompletedProcess[str]:
    """The real CLI against the stub, from the node as the agent runs it."""
    cli = Path(os.environ.get("DYNSNAP_NATIVE_BIN", "native/build")) / "dynsnap-cuda"
    return subprocess.run([str(cli), "--action", action, "--pid", str(pid)], env={**os.environ, **env.driver.env()},
                          capture_output=True, text=True, timeout=60, check=False)


async def pinned(s: Seng) -> D.ChatResult:
    return await s.fe.chat(PROMPT, worker_id=s.wid)


async def on_device(s: Seng) -> tuple[int, int]:
    """(engine process's stub driver key, its device), asserting the engine holds its weights and KV pool
    there, resident."""
    key = s.env.driver.key_of(await engine_pid(s.env, s.pod))
    device, size, resident = s.env.driver.allocations()[key]
    assert (size, resident) == (ENGINE_BYTES, True)
    return key, device


async def test_listed_and_answers_pinned_requests_with_its_id_the_same_text(seng: Seng) -> None:
    assert await seng.fe.model_listed()
    texts = set()
    for _ in range(2):
        res = await pinned(seng)
        assert res.status == 200, res.body
        assert res.worker_id == seng.wid
        texts.add(res.text)
    assert len(texts) == 1 and texts.pop().strip()
    await on_device(seng)


async def test_sleep_unroutes_and_frees_wake_up_brings_the_same_instance_back(seng: Seng) -> None:
    pod, wid, driver = seng.pod, seng.wid, seng.env.driver
    before = await pinned(seng)
    assert before.status == 200 and before.worker_id == wid
    key, device = await on_device(seng)
    free = driver.free_bytes(device)

    r = await route(pod, "control/sleep", {"level": 1})
    assert (r.status_code, r.json()) == (200, {"status": "ok", "message": "Engine slept (level=1)"})

    async def refused() -> bool:
        res = await pinned(seng)
        return res.status >= 400 and res.worker_id is None
    await wait_for("a pinned request refused while it sleeps", refused, timeout=30)
    assert key not in driver.allocations()  # freed on the device: nothing left allocated
    assert driver.free_bytes(device) == free + ENGINE_BYTES
    r = await route(pod, "control/sleep")
    assert r.json() == {"status": "ok", "message": "Engine already sleeping"}

    r = await route(pod, "control/wake_up")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "message": "Engine woke"})
    await seng.fe.wait_routable(wid, timeout=30)
    assert await instance_id(seng.env, pod) == wid
    after = await pinned(seng)
    assert (after.status, after.worker_id, after.text) == (200, wid, before.text)
    assert driver.allocations()[key] == (device, ENGINE_BYTES, True)
    assert driver.free_bytes(device) == free
    r = await route(pod, "control/wake_up")
    assert r.json() == {"status": "ok", "message": "Engine already awake"}


async def test_faults_answer_an_error_or_nothing_and_change_nothing(seng: Seng) -> None:
    pod = seng.pod
    try:
        seng.fault_file.write_text("fail sleep\nhang wake_up\n")
        r = await route(pod, "control/sleep")
        assert r.status_code == 200 and r.json()["status"] == "error", r.json()
        assert "injected fault: control/sleep fails" in r.json()["message"], r.json()
        with pytest.raises(httpx.ReadTimeout):
            await route(pod, "control/wake_up", timeout=3)
    finally:
        seng.fault_file.unlink()
    for body, why in (([1], "request body must be a JSON object"), ({"level": 2}, "level 1 only")):
        r = await route(pod, "control/sleep", body)
        assert r.json()["status"] == "error" and why in r.json()["message"], r.json()
    state = (await route(pod, "stub/state")).json()
    assert (state["asleep"], state["registered"], state["resident"]) == (False, True, True)
    res = await pinned(seng)
    assert (res.status, res.worker_id) == (200, seng.wid)
    await on_device(seng)


async def inflight(pod: NodePod) -> float:
    async with httpx.AsyncClient(timeout=5.0) as http:
        text = (await http.get(f"http://{pod.ip}:{P.DYNAMO_SYSTEM_PORT}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_inflight_requests{") and 'dynamo_endpoint="generate"' in line)


async def test_a_request_to_a_checkpointed_engine_is_held_and_answered_after_the_resume(seng: Seng) -> None:
    pod, wid, driver = seng.pod, seng.wid, seng.env.driver
    before = await pinned(seng)
    assert before.status == 200 and before.worker_id == wid
    pid = await engine_pid(seng.env, pod)
    key, device = await on_device(seng)
    free = driver.free_bytes(device)
    r = cuda(seng.env, "save", pid)
    assert r.returncode == 0, r.stderr
    assert driver.states()[key] == CHECKPOINTED
    assert driver.free_bytes(device) == free + ENGINE_BYTES  # the checkpoint freed it
    mark = len(driver.holds())
    fe = D.FrontendClient(seng.graph.frontend, timeout=120)
    resumed = False
    try:
        task = asyncio.create_task(fe.chat(PROMPT, worker_id=wid))
        # the cause: the engine's own driver call is held by the stub for its checkpointed state
        held = f"hold cuMemcpyDtoH_v2 key={key} state={CHECKPOINTED}"

        async def held_now() -> bool:
            return held in driver.holds()[mark:]
        try:
            await wait_for("the engine's driver call held", held_now, timeout=30)
        except TimeoutError:
            print("holds since:", driver.holds()[mark:], "state:", driver.states().get(key), "request done:",
                  task.done() and task.result())
            raise
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 3)
        assert not task.done(), task.result()  # held, not refused
        assert await seng.fe.model_listed()
        assert await inflight(pod) >= 1
        r = cuda(seng.env, "resume", pid)
        resumed = r.returncode == 0
        assert resumed, r.stderr
        res = await asyncio.wait_for(task, 30)
    finally:
        if not resumed:
            cuda(seng.env, "resume", pid)
        await fe.close()
    assert (res.status, res.worker_id, res.text) == (200, wid, before.text)
    assert any(x.startswith(f"release cuMemcpyDtoH_v2 key={key} state=0 ") and x.endswith(" rc=0")
               for x in driver.holds()[mark:])
    assert driver.free_bytes(device) == free


async def test_a_disaggregated_pair_answers_what_the_aggregated_engine_does(seng: Seng) -> None:
    """Prefill and decode engines of examples/dgd/disagg.yaml (one each), pinned with both headers:
    answered by both, with the text the aggregated engine gives (the decode continues from the
    prefill's first token and state, computed on the prefill's device), by the decode's own log."""
    env = seng.env
    agg = await pinned(seng)
    assert agg.status == 200
    body: Obj = chart_node.example_body(env, example=DISAGG, name="sengdis", worker_replicas=1, policy=POLICY,
                                        engine=Engine(gib=WEIGHTS_GIB, kv_gib=KV_GIB))
    async with deployed(env, body) as g:
        fe = D.FrontendClient(g.frontend)
        try:
            prefill, decode = g.workers("prefill")[0], g.workers("decode")[0]
            prefill_id, decode_id = await instance_id(env, prefill), await instance_id(env, decode)
            await fe.wait_routable(decode_id, prefill_id=prefill_id, timeout=120)
            res = await fe.chat(PROMPT, worker_id=decode_id, prefill_id=prefill_id)
            assert res.status == 200, res.body
            assert (res.worker_id, res.prefill_worker_id) == (decode_id, prefill_id)
            assert res.text == agg.text

            async def logged() -> str | None:
                text = await env.pod_log(decode.namespace, decode.name, "main", tail=400)
                return text if "decode: continuing from the prefill's first token" in text else None
            log = await wait_for("the decode engine's log of its prefill result", logged, timeout=30, interval=1)
            assert "no prefill result" not in log
        finally:
            await fe.close()
