"""Whether the frontend still routes to a worker (dynsnap/controller/routing.py), told from its answer
to a request pinned to it: fail closed. Only Dynamo 1.6.1's explicit refusal of the pinned instance
(400 with exactly its "Invalid request" body, observed on the local cluster) counts as not routed; an
answer is routed; every other answer (another 400, 404, 429, 5xx, a timeout, nothing to ask) proves
nothing. And the model a graph's frontend serves is asked again when the graph changes, and
forgotten with it."""

from __future__ import annotations

import json

import pytest

from dynsnap.controller import routing as RT
from dynsnap.controller.frontend import PinnedAnswer
from dynsnap.models.ids import InstanceId

REFUSAL = json.dumps({"message": "Invalid request", "type": "Bad Request", "code": 400})  # as Dynamo 1.6.1 sends it


@pytest.mark.parametrize(("answer", "verdict"), [
    (PinnedAnswer(200, InstanceId(7), None), RT.Routed.YES),
    (PinnedAnswer(400, None, None, REFUSAL), RT.Routed.NO),
    (PinnedAnswer(400, None, None, '{"code":400,"type":"Bad Request","message":"Invalid request"}'), RT.Routed.NO),
    # another 400 is not the refusal of the instance (a request this controller did not mean to send)
    (PinnedAnswer(400, None, None, '{"message":"Failed to deserialize the JSON body","type":"Bad Request",'
                                   '"code":400}'), RT.Routed.UNKNOWN),
    (PinnedAnswer(400, None, None, "Invalid request"), RT.Routed.UNKNOWN),  # not the JSON body
    (PinnedAnswer(400, None, None, ""), RT.Routed.UNKNOWN),
    (PinnedAnswer(400, None, None, REFUSAL[:40]), RT.Routed.UNKNOWN),  # cut short
    (PinnedAnswer(404, None, None, '{"message":"Model not found","type":"Not Found","code":404}'), RT.Routed.UNKNOWN),
    (PinnedAnswer(429, None, None, "too many requests"), RT.Routed.UNKNOWN),
    (PinnedAnswer(500, None, None, REFUSAL), RT.Routed.UNKNOWN),  # the body alone is not the refusal
    (PinnedAnswer(503, None, None, "service unavailable"), RT.Routed.UNKNOWN),
    (PinnedAnswer(504, None, None, "deadline"), RT.Routed.UNKNOWN),
    (PinnedAnswer(0, None, None, "ConnectTimeout: timed out"), RT.Routed.UNKNOWN),  # a transport error
    (None, RT.Routed.UNKNOWN),  # no ready frontend, or no model to ask with
], ids=["answered", "refused", "refused-keys-reordered", "400-other-text", "400-not-json", "400-empty",
        "400-cut-short", "404", "429", "500-refusal-body", "503", "504", "timeout", "nothing-to-ask"])
def test_only_the_frontends_explicit_refusal_counts_as_not_routed(answer: PinnedAnswer | None,
                                                                  verdict: RT.Routed) -> None:
    assert RT.routed(answer) == verdict


def dgd(uid: str = "u1", generation: int = 1) -> dict[str, object]:
    return {"metadata": {"name": "g", "namespace": "ns", "uid": uid, "generation": generation}}


def test_the_model_follows_the_graph_and_is_forgotten_with_it() -> None:
    cache = RT.ModelCache()
    cache.put("ns/g", dgd(), "tiny")
    assert cache.get("ns/g", dgd()) == "tiny"
    assert cache.get("ns/g", dgd(generation=2)) is None  # the graph changed: ask again
    assert cache.get("ns/g", dgd(uid="u2")) is None  # another graph of that name
    cache.put("ns/g", dgd(generation=2), "tiny-2")
    assert cache.get("ns/g", dgd(generation=2)) == "tiny-2"
    cache.drop("ns/g")  # the frontend said the model is not found
    assert cache.get("ns/g", dgd(generation=2)) is None
    cache.put("ns/g", dgd(), "tiny")
    cache.put("ns/h", dgd(), "other")
    cache.prune({"ns/h"})
    assert len(cache) == 1 and cache.get("ns/h", dgd()) == "other"


def test_the_routing_probe_names_only_the_instance_asked_about() -> None:
    def pod(sub: str) -> dict[str, object]:
        return {"metadata": {"name": "w", "namespace": "ns", "labels": {
            "nvidia.com/dynamo-graph-deployment-name": "g", "nvidia.com/dynamo-component-type": "worker",
            "nvidia.com/dynamo-sub-component-type": sub}}}
    assert RT.probe_pins(pod("prefill"), 5) == (None, 5)
    assert RT.probe_pins(pod("decode"), 5) == (5, None)
    assert RT.probe_pins(pod(""), 5) == (5, None)


async def test_no_frontend_to_ask_is_no_refusal() -> None:
    """The quiesce's probe (dynsnap.controller.quiesce.routing) with no ready frontend pod for the graph:
    nothing could refuse the worker, so nothing says it stopped being routed."""
    from datetime import UTC, datetime

    from dynsnap.controller import quiesce as Q
    from dynsnap.controller.frontend import Frontend
    from dynsnap.controller.scope import Scope, Stores
    from dynsnap.controller.settings import ControllerSettings
    from dynsnap.controller.writes import Ctx
    from dynsnap.k8s.store import Store
    from dynsnap.models.policy import ParsedPolicy, Policy
    from dynsnap.models.workersnapshot import ControllerRecord, WorkerIdentity, WorkerSnapshot

    uid = "00000001-2222-3333-4444-555555555555"
    pods = Store({"dgd": lambda o: ["ns/g"]})
    pod = {"metadata": {"name": "w", "namespace": "ns", "uid": uid, "labels": {
        "nvidia.com/dynamo-graph-deployment-name": "g", "nvidia.com/dynamo-component-type": "worker"}}}
    pods.upsert(pod)
    pods.upsert({"metadata": {"name": "fe", "namespace": "ns", "uid": "f", "labels": {  # a frontend, not Ready
        "nvidia.com/dynamo-graph-deployment-name": "g", "nvidia.com/dynamo-component-type": "frontend"}},
        "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "False"}]}})
    now = datetime.now(UTC)
    ws = WorkerSnapshot.model_validate({"metadata": {"name": "w", "namespace": "ns"},
                                        "spec": {"podName": "w", "podUID": uid, "tier": "suspend"}})
    ws.status.controller = ControllerRecord(identity=WorkerIdentity(pod_uid=uid, pod_ip="10.0.0.5", dwm_uid="d",
                                                                    instance_id=7, recorded=now))
    ctx = Ctx(kube=None, settings=ControllerSettings(leader_elect=False),  # type: ignore[arg-type]
              stores=Stores(dgds=Store(), pods=pods, dwms=Store(), slices=Store(), wss=Store()),
              frontend=Frontend(timeout=1.0))
    s = Scope(key="ns/w", pod=pod, dgd=dgd(), component="worker", ws=ws, parsed=ParsedPolicy(Policy()),
              endpoint_ready=False, now=now)
    assert await Q.routing(ctx, s) == RT.Routed.UNKNOWN
    await ctx.frontend.close()
