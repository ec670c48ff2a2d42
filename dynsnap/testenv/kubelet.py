"""stub_kubelet: probe emulation for sandboxed pods (stands in for kubelet's prober).

No kubelet can run here, so for each pod the harness really runs, this polls the
container's readiness and liveness HTTP probes at the pod IP (as kubelet does, from the
node's network) and writes the pod's ``ContainersReady`` and ``Ready`` conditions,
``Ready`` honouring ``spec.readinessGates`` exactly as kubelet computes it: Ready only
when the containers are ready *and* every gate condition is True. Startup probes gate
the other two, as in kubelet. Liveness failures past
``failureThreshold`` are counted into ``containerStatuses[].restartCount`` (kubelet would
restart the container at that point; tests assert on the count, the process is left
alone so the evidence survives).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import ApiError, NotFound, RetryExhausted
from dynsnap.models.resources import PODS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpProbe:
    path: str
    port: int
    period: float
    failure_threshold: int
    timeout: float

    @classmethod
    def from_spec(cls, probe: dict[str, Any] | None, container: dict[str, Any]) -> HttpProbe | None:
        if not probe or "httpGet" not in probe:
            return None
        get = probe["httpGet"]
        port = get["port"]
        if isinstance(port, str):  # a named container port
            named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
            port = named[port]
        return cls(path=get.get("path", "/"), port=int(port), period=float(probe.get("periodSeconds", 10)),
                   failure_threshold=int(probe.get("failureThreshold", 3)),
                   timeout=float(probe.get("timeoutSeconds", 1)))


def compute_ready(pod: Obj, containers_ready: bool) -> bool:
    """kubelet's rule: Ready = ContainersReady and every readiness gate condition True."""
    conds = {c["type"]: c.get("status") for c in pod.get("status", {}).get("conditions", [])}
    gates = [g["conditionType"] for g in pod.get("spec", {}).get("readinessGates", [])]
    return containers_ready and all(conds.get(g) == "True" for g in gates)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class StubKubelet:
    """Probes one pod and keeps its Ready condition true to what the probes and gates say."""

    kube: Kube
    namespace: str
    name: str
    pod_ip: str
    # How often gates are re-read even when probes are slower: a gate flip must reach Ready fast.
    tick: float = 0.25
    restarts: int = 0
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"stub-kubelet/{self.namespace}/{self.name}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _probe(self, http: httpx.AsyncClient, probe: HttpProbe) -> bool:
        try:
            r = await http.get(f"http://{self.pod_ip}:{probe.port}{probe.path}", timeout=probe.timeout)
        except httpx.HTTPError:
            return False
        return 200 <= r.status_code < 400

    async def _run(self) -> None:
        # Kubelet keeps probing whatever one probe or write did: an error nobody expected is logged and
        # the next tick goes on, never a pod left with the Ready it had when the task died unseen.
        for _ in range(1_000_000):  # bounded: a stub kubelet lives for one test at most
            try:
                await self._ticks()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("stub-kubelet %s: unexpected error; probing again", self.name)
                await asyncio.sleep(1.0)

    async def _ticks(self) -> None:
        loop = asyncio.get_running_loop()
        last_probe = {"startup": -1e9, "readiness": -1e9, "liveness": -1e9}
        state = {"readiness": False, "started": False}
        live_failures = 0
        async with httpx.AsyncClient() as http:
            while True:
                try:
                    pod = await self.kube.get(PODS, self.name, namespace=self.namespace)
                except NotFound:
                    return
                except (ApiError, RetryExhausted) as e:  # RetryExhausted: the API server is away; kubelet carries on
                    log.warning("stub-kubelet %s: %s", self.name, e)
                    await asyncio.sleep(1.0)
                    continue
                container = pod["spec"]["containers"][0]
                now = loop.time()
                startup = HttpProbe.from_spec(container.get("startupProbe"), container)
                readiness = HttpProbe.from_spec(container.get("readinessProbe"), container)
                liveness = HttpProbe.from_spec(container.get("livenessProbe"), container)
                # As kubelet: no readiness or liveness probing until the startup probe has passed.
                if not state["started"]:
                    if startup is None:
                        state["started"] = True
                    elif now - last_probe["startup"] >= min(startup.period, 1.0):
                        last_probe["startup"] = now
                        state["started"] = await self._probe(http, startup)
                if not state["started"]:
                    state["readiness"] = False
                elif readiness is None:
                    state["readiness"] = True
                elif now - last_probe["readiness"] >= min(readiness.period, 1.0):
                    # Probing faster than periodSeconds and believing one failure only shortens the tests:
                    # no test here needs kubelet's readiness window (the real node's kubelet keeps it).
                    last_probe["readiness"] = now
                    state["readiness"] = await self._probe(http, readiness)
                if state["started"] and liveness is not None and now - last_probe["liveness"] >= liveness.period:
                    last_probe["liveness"] = now
                    if await self._probe(http, liveness):
                        live_failures = 0
                    else:
                        live_failures += 1
                        if live_failures >= liveness.failure_threshold:
                            self.restarts += 1
                            live_failures = 0
                            log.warning("stub-kubelet %s: liveness failed: kubelet would restart it", self.name)
                await self._write(pod, containers_ready=state["readiness"])
                await asyncio.sleep(self.tick)

    async def _write(self, pod: Obj, *, containers_ready: bool) -> None:
        status = pod.get("status", {})
        conds: list[Obj] = [dict(c) for c in status.get("conditions", [])]
        want = {"ContainersReady": containers_ready, "Ready": compute_ready(pod, containers_ready)}
        changed = False
        for ctype, ok in want.items():
            value = "True" if ok else "False"
            existing = next((c for c in conds if c["type"] == ctype), None)
            if existing is None:
                conds.append({"type": ctype, "status": value, "lastTransitionTime": _now()})
                changed = True
            elif existing.get("status") != value:
                existing.update(status=value, lastTransitionTime=_now())
                changed = True
        cstats = [dict(c) for c in status.get("containerStatuses", [])]
        for c in cstats:
            if c.get("ready") != containers_ready or c.get("restartCount", 0) != self.restarts:
                c.update(ready=containers_ready, restartCount=self.restarts)
                changed = True
        if not changed:
            return
        patch = {"metadata": {"resourceVersion": pod["metadata"]["resourceVersion"]},
                 "status": {"conditions": conds, "containerStatuses": cstats}}
        try:
            await self.kube.merge_patch(PODS, self.name, patch, namespace=self.namespace, subresource="status")
        except ApiError as e:  # 409: someone wrote in between; the next tick reads again
            if e.status != 409:
                log.warning("stub-kubelet %s: status write failed: %s", self.name, e)
        except RetryExhausted as e:  # the API server is away: the next tick writes again
            log.warning("stub-kubelet %s: status write failed: %s", self.name, e)
