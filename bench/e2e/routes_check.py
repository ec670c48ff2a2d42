"""A check of engine.py's level-1 engine routes on a GPU where Dynamo is not installed: the route
handlers (``engine.Routes``) driven directly on the real model, with ``FakeEndpoint`` standing in for
Dynamo's ``Endpoint`` (it records the unregister and register calls the routes make). What it cannot
show, the Dynamo wiring (``register_engine_route`` on the system port), tests/integration/
node/test_stub_engine.py shows with the stand-in engine and the same route contract.

    python3 bench/e2e/routes_check.py [GIB] [KV_GIB]        (default 4 8; one JSON line on stdout)

The driver's own view of used memory (``torch.cuda.mem_get_info``) awake, asleep and woken; the
route answers; the seconds each took; whether the host copies were pinned; and whether the answer
after the wake is the one before the sleep.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as E


class FakeEndpoint:
    """Stands in for Dynamo's Endpoint: records what the routes ask of discovery."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def unregister_endpoint_instance(self) -> None:
        self.calls.append("unregister")

    async def register_endpoint_instance(self) -> None:
        self.calls.append("register")


def used() -> int:
    free_b, total_b = torch.cuda.mem_get_info()
    return int(total_b - free_b)


async def check(gib: float, kv_gib: float) -> dict[str, Any]:
    weights = E.make_weights(gib, 4096, 4096, "cuda", 12)
    model = E.TinyLM(weights, "cuda", kv_bytes=int(kv_gib * E.GIB))
    del weights
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    prompt = [100, 200, 300]
    before = model.generate(prompt, 8)
    out: dict[str, Any] = {"gib": gib, "kv_gib": kv_gib, "weights_bytes": model.bytes, "used_awake": used()}
    routes = E.Routes(model, asyncio.Lock(), asyncio.Event())
    routes.awake.set()
    routes.endpoint = ep = FakeEndpoint()
    t = time.monotonic()
    out["sleep"] = await routes.sleep({"level": 1})
    out["sleep_s"] = round(time.monotonic() - t, 3)
    out["used_asleep"] = used()
    out["host_pinned"] = model.host is not None and all(h.is_pinned() for h in model.host)
    out["sleep_again"] = await routes.sleep({})
    out["bad_body"] = await routes.sleep([1])
    t = time.monotonic()
    out["wake_up"] = await routes.wake_up({})
    out["wake_s"] = round(time.monotonic() - t, 3)
    out["used_woken"] = used()
    out["wake_again"] = await routes.wake_up({})
    out["discovery_calls"] = ep.calls
    out["same_answer"] = model.generate(prompt, 8) == before
    return out


def main() -> int:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    kv_gib = float(sys.argv[2]) if len(sys.argv) > 2 else 8.0
    res = asyncio.run(check(gib, kv_gib))
    print(json.dumps(res))
    ok = (res["sleep"]["status"] == res["wake_up"]["status"] == "ok" and res["same_answer"]
          and res["discovery_calls"] == ["unregister", "register"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
