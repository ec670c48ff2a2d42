"""The stand-in GPU engine (dynsnap/testenv/stub_engine.py: stands in for vLLM) for real on the local
cluster: Dynamo 1.6.1's frontend with Kubernetes discovery, the engine's workers in pod sandboxes
under dynsnap-entrypoint with the serving gate, on the stub CUDA driver. What issues 20 and 21
build on, shown here:

- the engine is listed by the frontend and answers requests pinned to its instance id, the same
  text for the same prompt;
- its engine routes behave as Dynamo's vLLM worker's (level 1): ``control/sleep`` unregisters it
  (a pinned request is refused) and frees its device memory in the stub; ``control/wake_up``
  allocates again and registers the same instance, which answers the same text; both idempotent;
- the faults the lead's tests need happen for real: a route that answers an error, one that never
  answers, a worker without routes (404), a bad body;
- with the engine's process checkpointed by ``dynsnap-cuda save`` (the stub now holds a process's
  own driver calls while it is locked or checkpointed, as the H200's driver does), a request pinned
  to it is held inside its driver call, not refused, while the model stays listed and its system
  port reports it in flight; after ``dynsnap-cuda resume`` that worker answers it, the same text.

Sandbox, why: it tests the stand-in engine itself behind the real frontend; no dynsnap part runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentenv import StubDriver, build_stub_driver, deploy_serving

from dynsnap.models import protocol as P
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynsnap_parts import engine_worker_component

pytestmark = pytest.mark.cluster

GIB = 1 << 30
WEIGHTS_GIB, KV_GIB = 1, 2
CHECKPOINTED = 2
PROMPT = "What does a sleeping engine say?"


@dataclass
class Env:
    graph: D.Graph
    fe: D.FrontendClient
    driver: StubDriver
    ids: dict[str, int]  # component -> its one worker's instance id
    fault_file: Path

    def pod(self, component: str) -> RunningPod:
        return self.graph.workers(component)[0]


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-stub-engine-"))
    driver = build_stub_driver(work / "stubcuda")
    faults = work / "engine-faults"

    def engine(name: str, args: list[str]) -> dict[str, Any]:
        return engine_worker_component(name, replicas=1, driver=driver, gib=WEIGHTS_GIB, kv_gib=KV_GIB,
                                       engine_args=args)
    graph = await deploy_serving(cluster, D.dgd("seng", [
        D.frontend_component(),
        engine("engine", ["--fault-file", str(faults)]),
        engine("faulty", ["--fail-route", "sleep", "--hang-route", "wake_up"]),
        engine("bare", ["--no-routes"]),
    ]))
    fe = D.FrontendClient(graph.frontend)
    try:
        await fe.wait_model()
        ids = {c: await D.instance_id(cluster, graph.workers(c)[0]) for c in ("engine", "faulty", "bare")}
        for wid in ids.values():
            await fe.wait_routable(wid)
        yield Env(graph, fe, driver, ids, faults)
    finally:
        await fe.close()
        await D.teardown(cluster, graph)


async def route(pod: RunningPod, name: str, body: Any = None, *, timeout: float = 20.0) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as http:
        return await http.post(f"http://{pod.ip}:{P.DYNAMO_SYSTEM_PORT}/engine/{name}", json={} if body is None
                               else body)


def engine_pid(pod: RunningPod) -> int:
    """The host pid of the engine's process: the child of the pod's PID 1 (dynsnap-entrypoint)."""
    for child in Path(f"/proc/{pod.sandbox.pid}/task/{pod.sandbox.pid}/children").read_text().split():
        if b"dynsnap.testenv.stub_engine" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError(f"no stub_engine process under {pod.name}'s PID 1")


def cuda(driver: StubDriver, action: str, pid: int) -> subprocess.CompletedProcess[str]:
    """The real CLI against the stub, as the agent runs it."""
    cli = Path(os.environ.get("DYNSNAP_NATIVE_BIN", "native/build")) / "dynsnap-cuda"
    return subprocess.run([str(cli), "--action", action, "--pid", str(pid)], env={**os.environ, **driver.env()},
                          capture_output=True, text=True, timeout=60, check=False)


async def pinned(env: Env, component: str) -> D.ChatResult:
    return await env.fe.chat(PROMPT, worker_id=env.ids[component])


async def test_listed_and_answers_pinned_requests_with_its_id_the_same_text(env: Env) -> None:
    assert await env.fe.model_listed()
    texts = set()
    for _ in range(2):
        res = await pinned(env, "engine")
        assert res.status == 200, res.body
        assert res.worker_id == env.ids["engine"]
        texts.add(res.text)
    assert len(texts) == 1 and texts.pop().strip()
    # it holds its weights and KV pool in the stub's device memory
    key = env.driver.key_of(engine_pid(env.pod("engine")))
    assert env.driver.allocations()[key] == (0, (WEIGHTS_GIB + KV_GIB) * GIB, True)


async def test_sleep_unroutes_and_frees_wake_up_brings_the_same_instance_back(
        cluster: LocalCluster, env: Env) -> None:
    pod, wid = env.pod("engine"), env.ids["engine"]
    before = await pinned(env, "engine")
    assert before.status == 200 and before.worker_id == wid
    key = env.driver.key_of(engine_pid(pod))
    free = env.driver.free_bytes()

    r = await route(pod, "control/sleep", {"level": 1})
    assert (r.status_code, r.json()) == (200, {"status": "ok", "message": "Engine slept (level=1)"})

    async def refused() -> bool:
        res = await pinned(env, "engine")
        return res.status >= 400 and res.worker_id is None
    await wait_for("a pinned request refused while it sleeps", refused, timeout=30)
    assert key not in env.driver.allocations()  # freed on the device: nothing left allocated
    assert env.driver.free_bytes() == free + (WEIGHTS_GIB + KV_GIB) * GIB
    r = await route(pod, "control/sleep")
    assert r.json() == {"status": "ok", "message": "Engine already sleeping"}

    r = await route(pod, "control/wake_up")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "message": "Engine woke"})
    await env.fe.wait_routable(wid, timeout=30)
    assert await D.instance_id(cluster, pod) == wid
    after = await pinned(env, "engine")
    assert (after.status, after.worker_id, after.text) == (200, wid, before.text)
    assert env.driver.allocations()[key] == (0, (WEIGHTS_GIB + KV_GIB) * GIB, True)
    assert env.driver.free_bytes() == free
    r = await route(pod, "control/wake_up")
    assert r.json() == {"status": "ok", "message": "Engine already awake"}


async def test_faults_answer_an_error_or_nothing_and_change_nothing(env: Env) -> None:
    faulty = env.pod("faulty")
    r = await route(faulty, "control/sleep")
    assert r.status_code == 200 and r.json()["status"] == "error" and "injected" in r.json()["message"]
    with pytest.raises(httpx.ReadTimeout):
        await route(faulty, "control/wake_up", timeout=3)
    res = await pinned(env, "faulty")
    assert (res.status, res.worker_id) == (200, env.ids["faulty"])

    r = await route(env.pod("bare"), "control/sleep")
    assert r.status_code == 404
    res = await pinned(env, "bare")
    assert (res.status, res.worker_id) == (200, env.ids["bare"])

    engine = env.pod("engine")
    env.fault_file.write_text("fail sleep\n")
    try:
        r = await route(engine, "control/sleep")
        assert r.json()["status"] == "error" and "fail sleep" in r.json()["message"]
    finally:
        env.fault_file.unlink()
    for body, why in (([1], "request body must be a JSON object"), ({"level": 2}, "level 1 only")):
        r = await route(engine, "control/sleep", body)
        assert r.json()["status"] == "error" and why in r.json()["message"], r.json()
    state = (await route(engine, "stub/state")).json()
    assert (state["asleep"], state["registered"], state["resident"]) == (False, True, True)
    res = await pinned(env, "engine")
    assert (res.status, res.worker_id) == (200, env.ids["engine"])


async def inflight(pod: RunningPod) -> float:
    async with httpx.AsyncClient(timeout=5.0) as http:
        text = (await http.get(f"http://{pod.ip}:{P.DYNAMO_SYSTEM_PORT}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_inflight_requests{") and 'dynamo_endpoint="generate"' in line)


async def test_a_request_to_a_checkpointed_engine_is_held_and_answered_after_the_resume(env: Env) -> None:
    pod, wid = env.pod("engine"), env.ids["engine"]
    before = await pinned(env, "engine")
    assert before.status == 200 and before.worker_id == wid
    pid = engine_pid(pod)
    key = env.driver.key_of(pid)
    free = env.driver.free_bytes()
    r = cuda(env.driver, "save", pid)
    assert r.returncode == 0, r.stderr
    assert env.driver.states()[key] == CHECKPOINTED
    assert env.driver.free_bytes() == free + (WEIGHTS_GIB + KV_GIB) * GIB  # the checkpoint freed it
    mark = len(env.driver.holds())
    fe = D.FrontendClient(env.graph.frontend, timeout=120)
    try:
        task = asyncio.create_task(fe.chat(PROMPT, worker_id=wid))
        # the cause: the engine's own driver call is held by the stub for its checkpointed state
        held = f"hold cuMemcpyDtoH_v2 key={key} state={CHECKPOINTED}"

        async def held_now() -> bool:
            return held in env.driver.holds()[mark:]
        await wait_for("the engine's driver call held", held_now, timeout=30)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 3)
        assert not task.done(), task.result()  # held, not refused
        assert await env.fe.model_listed()
        assert await inflight(pod) >= 1
        r = cuda(env.driver, "resume", pid)
        assert r.returncode == 0, r.stderr
        res = await asyncio.wait_for(task, 30)
    finally:
        await fe.close()
    assert (res.status, res.worker_id, res.text) == (200, wid, before.text)
    assert any(x.startswith(f"release cuMemcpyDtoH_v2 key={key} state=0 ") and x.endswith(" rc=0")
               for x in env.driver.holds()[mark:])
    assert env.driver.free_bytes() == free



async def test_a_disaggregated_pair_answers_what_the_aggregated_engine_does(cluster: LocalCluster, env: Env) -> None:
    """Prefill and decode engines (each on its endpoint, as the mocker's), pinned with both headers:
    answered by both, with the text the aggregated engine gives (the decode continues from the
    prefill's first token and state, computed on the prefill's device)."""
    agg = await pinned(env, "engine")
    assert agg.status == 200
    graph = await deploy_serving(cluster, D.dgd("sengdis", [
        D.frontend_component(router_mode="kv"),
        engine_worker_component("prefill", replicas=1, driver=env.driver, mode="prefill", sub="prefill",
                                gib=WEIGHTS_GIB, kv_gib=KV_GIB),
        engine_worker_component("decode", replicas=1, driver=env.driver, mode="decode", sub="decode",
                                gib=WEIGHTS_GIB, kv_gib=KV_GIB),
    ]))
    fe = D.FrontendClient(graph.frontend)
    try:
        await fe.wait_model()
        prefill_id = await D.instance_id(cluster, graph.workers("prefill")[0])
        decode_id = await D.instance_id(cluster, graph.workers("decode")[0])
        await fe.wait_routable(decode_id, prefill_id=prefill_id)
        res = await fe.chat(PROMPT, worker_id=decode_id, prefill_id=prefill_id)
        assert res.status == 200, res.body
        assert (res.worker_id, res.prefill_worker_id) == (decode_id, prefill_id)
        assert res.text == agg.text
        log_path = graph.workers("decode")[0].sandbox.log_path

        async def logged() -> str | None:
            text = log_path.read_text()
            return text if "decode: continuing from the prefill's first token" in text else None
        log = await wait_for("the decode engine's log of its prefill result", logged, timeout=10)
        assert "no prefill result" not in log
    finally:
        await fe.close()
        await D.teardown(cluster, graph)
