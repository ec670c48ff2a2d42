"""The steps of tier ``engine``: the engine sleeps and wakes itself through its own routes on the
worker's system port (engine_routes.py), and the entrypoint follows (``suspended``, ``active``), so its
probes and the pod's readiness say what the worker is. The quiesce before it is the other tiers' (the
serving gate, nothing in flight), plus one check before anything changes: the engine has the routes
(found by a wake of the awake engine, which changes nothing); a worker without them is refused
(``EngineRoutesMissing``).

What each step records: the route set (``engine``: vllm or trtllm), the engine's answer, and each
GPU's free memory before and after (dynsnap-cuda --mem-info), as a driver capture records them.

Layer: ``dynsnap.agent``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynsnap.agent.cuda import GpuFree
from dynsnap.agent.engine_routes import EngineRouteError, EngineRoutes, EngineRoutesMissing, EngineRouteTimeout
from dynsnap.agent.steps import StepCall, StepFailure
from dynsnap.models.protocol import EntrypointState, Reason

if TYPE_CHECKING:
    from dynsnap.agent.executor import Executor


def routes_of(ex: Executor, c: StepCall) -> EngineRoutes:
    if not c.subject.system_url:
        raise StepFailure(Reason.ENGINE_ROUTE_FAILED, "the worker's system port is not known (no pod IP): its "
                          "engine routes cannot be called", changed=False)
    return EngineRoutes(c.subject.system_url, timeout=ex.settings.engine_route_timeout)


async def probe(ex: Executor, c: StepCall) -> str:
    """Before a capture: the engine of this worker has sleep routes (refused before any change if not)."""
    try:
        rs, _ = await routes_of(ex, c).wake()  # on an awake engine: "already awake", nothing changes
    except EngineRoutesMissing as e:
        raise StepFailure(Reason.ENGINE_ROUTES_MISSING, f"{e}; use tier suspend (or auto) for this worker",
                          changed=False) from e
    except EngineRouteTimeout as e:
        raise StepFailure(Reason.ENGINE_ROUTE_TIMEOUT, str(e), changed=False) from e
    except EngineRouteError as e:
        raise StepFailure(Reason.ENGINE_ROUTE_FAILED, str(e), changed=False) from e
    return rs.engine


async def _free(ex: Executor) -> dict[str, int | None]:
    gpus: list[GpuFree] = await ex.cuda.mem_info()
    return {g.uuid: g.free for g in gpus}


def _gpus(before: dict[str, int | None], after: dict[str, int | None]) -> list[dict[str, Any]]:
    return [{"uuid": u, "freeBefore": before.get(u), "freeAfter": after.get(u)} for u in sorted({*before, *after})]


async def engine_sleep(ex: Executor, c: StepCall) -> None:
    routes = routes_of(ex, c)
    before = await _free(ex)
    try:
        rs, message = await routes.sleep(level=c.engine_sleep_level)
    except EngineRoutesMissing as e:  # gone since the quiesce found them: nothing slept; roll back
        raise StepFailure(Reason.ENGINE_ROUTES_MISSING, str(e)) from e
    except EngineRouteTimeout as e:  # it may be asleep, or half: the rollback's wake route settles it
        raise StepFailure(Reason.ENGINE_ROUTE_TIMEOUT, str(e)) from e
    except EngineRouteError as e:
        raise StepFailure(Reason.ENGINE_ROUTE_FAILED, str(e)) from e
    c.info["engine"] = {"routes": rs.engine, "route": rs.sleep, "level": c.engine_sleep_level, "answer": message}
    c.info["gpus"] = _gpus(before, await _free(ex))
    await ex.request(c.obs, EntrypointState.SUSPENDED)


async def engine_wake(ex: Executor, c: StepCall) -> None:
    routes = routes_of(ex, c)
    before = await _free(ex)
    try:
        rs, message = await routes.wake()
        c.info["engine"] = {"routes": rs.engine, "route": rs.wake, "answer": message}
    except EngineRoutesMissing:
        # An engine without the routes never slept (the quiesce refuses such a worker; this is the
        # rollback of a capture whose routes went away): nothing to wake, the entrypoint settles.
        c.info["engine"] = {"routes": None, "answer": "no engine routes: nothing to wake"}
    except EngineRouteTimeout as e:
        raise StepFailure(Reason.ENGINE_ROUTE_TIMEOUT, str(e)) from e
    except EngineRouteError as e:
        raise StepFailure(Reason.ENGINE_ROUTE_FAILED, str(e)) from e
    c.info["gpus"] = _gpus(before, await _free(ex))
    await ex.request(c.obs, EntrypointState.ACTIVE)
