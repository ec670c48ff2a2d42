"""What the controller's integration tests share: policy annotations, a load generator through the
frontend that records every answer, and waits on WorkerSnapshot status.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import yaml

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import PodRef, wait_for
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault


def policy(**kw: Any) -> dict[str, str]:
    """dynsnap.io/ annotations from keyword arguments (idle_after="3s" -> dynsnap.io/idle-after)."""
    return {f"{P.ANNOTATION_PREFIX}{k.replace('_', '-')}": str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in kw.items()}


@dataclass
class Load:
    """Unpinned chat completions through the frontend from ``concurrency`` clients; every answer
    kept (status, worker id), so a test can say that none failed and who served them."""

    fe: D.FrontendClient
    concurrency: int = 1
    pause: float = 0.0
    max_tokens: int = 8
    results: list[tuple[float, int, int | None, str]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set() and n < 100_000:
            n += 1
            try:
                r = await self.fe.chat(f"load {i}.{n}", max_tokens=self.max_tokens)
                self.results.append((time.time(), r.status, r.worker_id, "" if r.status == 200 else str(r.body)[:200]))
            except Exception as e:  # a transport error is a failed request too
                self.results.append((time.time(), 0, None, f"{type(e).__name__}: {e}"))
            if self.pause:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.pause)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def failures(self) -> list[tuple[float, int, int | None, str]]:
        return [r for r in self.results if r[1] != 200]


async def get_ws(api: Kube, pod: PodRef) -> Obj | None:
    with contextlib.suppress(NotFound):
        return await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
    return None


def cond(ws: Obj | None, ctype: str) -> Obj | None:
    return next((c for c in ((ws or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def asleep(ws: Obj | None) -> bool:
    c = cond(ws, "Suspended")
    return bool(ws and ws["spec"]["desiredState"] == "Suspended" and (ws.get("status") or {}).get("state") ==
                "Suspended" and c and c["status"] == "True")


def verified_after(since: str | None) -> Callable[[Obj | None], bool]:
    """A WorkerSnapshot whose latest wake (id other than ``since``) the controller verified."""
    def check(ws: Obj | None) -> bool:
        st = (ws or {}).get("status") or {}
        v = (st.get("controller") or {}).get("verification") or {}
        wake = st.get("lastWake") or {}
        return bool(wake.get("id") and wake.get("id") != since and v.get("wakeId") == wake.get("id")
                    and v.get("ok") is True)
    return check


PodT = TypeVar("PodT", bound=PodRef)


async def one_asleep(api: Kube, workers: list[PodT], *, timeout: float = 180) -> tuple[PodT, PodT]:
    """Exactly one of two workers asleep (idleness put it to sleep, min-active 1 keeps the other):
    (the sleeper, its peer)."""
    async def one() -> list[PodT] | None:
        sleeping = [p for p in workers if asleep(await get_ws(api, p))]
        return sleeping if len(sleeping) == 1 else None
    sleeping: list[PodT] = await wait_for("one of two workers asleep", one, timeout=timeout, interval=0.5)
    return sleeping[0], next(p for p in workers if p is not sleeping[0])


async def wait_verdict(wss: list[Obj], reason: str) -> Obj:
    """The verdict on the wake that follows, from ``wss`` (a WorkerSnapshot's :func:`history`): the first
    version whose verification is of a wake newer than the one on record when the history began (a verdict
    from before, on its return from a quiesce that was called off, may still be there). It must be
    ``Verified=False`` with ``reason``; a wrong verdict fails at once, not at a time-out."""
    before = ((wss[0].get("status") or {}).get("lastWake") or {}).get("id")

    def of_the_wake(ws: Obj) -> bool:
        st = ws.get("status") or {}
        wake = (st.get("lastWake") or {}).get("id")
        v = (st.get("controller") or {}).get("verification") or {}
        return bool(wake and wake != before and v.get("wakeId") == wake and v.get("ok") is not None)

    async def found() -> Obj | None:
        return next((ws for ws in wss if of_the_wake(ws)), None)
    try:
        ws: Obj = await wait_for("a verdict on the wake", found, timeout=180, interval=0.2)
    except TimeoutError:
        print("LAST STATUS:", yaml.safe_dump((wss[-1] if wss else {}).get("status")))
        raise
    c = cond(ws, "Verified")
    assert c and c["status"] == "False" and c["reason"] == reason, f"wanted Verified=False {reason}, got {c}"
    return ws


class HasApi(Protocol):
    """A test environment with the API server's client (CtlEnv here, realnodeenv.Env)."""

    @property
    def api(self) -> Kube: ...


async def wait_ws(env: HasApi, pod: PodRef, what: str, check: Callable[[Obj | None], bool],
                  timeout: float = 120) -> Obj:
    """The worker's WorkerSnapshot once ``check`` holds for it, bounded by ``timeout``; on timeout the
    last one seen is printed whole (the last one that existed, when the pod and its WorkerSnapshot are
    gone by then: a fallback that deleted the pod leaves nothing else to read)."""
    seen: list[Obj] = []

    async def probe() -> Obj | None:
        ws = await get_ws(env.api, pod)
        if ws is not None:
            seen[:] = [ws]
        return ws if check(ws) else None
    try:
        ws: Obj = await wait_for(f"{pod.name}: {what}", probe, timeout=timeout, interval=0.2)
    except TimeoutError:
        last = await get_ws(env.api, pod)
        if last is None and seen:
            print("WORKERSNAPSHOT GONE; the last one seen:")
            last = seen[0]
        print("LAST WORKERSNAPSHOT:", yaml.safe_dump(last))
        raise
    return ws


async def own_instance(api: Kube, pod: PodRef) -> int | None:
    """The instance id of the pod's DWM once that DWM is this pod's own (owned by its UID: a recreated
    pod's, not its predecessor's) and carries one; None until then."""
    try:
        dwm = await api.get(R.DWMS, pod.name, namespace=pod.namespace)
    except NotFound:
        return None
    if pod.uid not in {o["uid"] for o in dwm["metadata"].get("ownerReferences") or []}:
        return None
    try:
        return instance_id_from_dwm(dwm)
    except ValueError:  # applied before its endpoints are
        return None


@contextlib.asynccontextmanager
async def history(api: Kube, res: R.Resource, pod: PodRef) -> AsyncIterator[list[Obj]]:
    """Every version of the object of kind ``res`` named after ``pod`` (the pod, its WorkerSnapshot)
    during the block, from a watch that starts at the version read first: a state that lasts one
    reconcile is not missed, as it can be between polls, nor one whose object is deleted right after.
    A deleted object's last version is in the list too."""
    live = await api.get(res, pod.name, namespace=pod.namespace)
    seen: list[Obj] = [live]

    async def follow() -> None:
        async for ev in api.watch(res, namespace=pod.namespace, field_selector=f"metadata.name={pod.name}",
                                  resource_version=live["metadata"]["resourceVersion"], timeout_seconds=900):
            if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                seen.append(ev["object"])
    task = asyncio.create_task(follow())
    try:
        yield seen
    finally:
        early = task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    assert not early, f"the watch on {res.plural} {pod.name} ended early: its history is incomplete"


def record(ws: Obj | None) -> dict[str, Any]:
    """The controller's part of a WorkerSnapshot's status."""
    rec: dict[str, Any] = ((ws or {}).get("status") or {}).get("controller") or {}
    return rec


def verified_wake(ws: Obj | None) -> bool:
    """Awake, and its latest wake proven: Verified=True for the lastWake it names."""
    st = (ws or {}).get("status") or {}
    v = record(ws).get("verification") or {}
    c = cond(ws, "Verified")
    return bool(ws and ws["spec"]["desiredState"] == "Active" and st.get("state") == "Active"
                and v.get("ok") is True and st.get("lastWake") and v.get("wakeId") == st["lastWake"].get("id")
                and c and c["status"] == "True")


def refuse(proxy: FakeApiProxy, *, method: str, path: str) -> Fault:
    """fake_apiproxy refuses the controller's requests to exactly ``path`` with 503 until cleared: it stays
    at the step before that write (each reconcile retried, failing there)."""
    return proxy.add(Fault("respond", method=method, path_equals=path, status=503, times=None))


def ws_path(pod: PodRef, *, status: bool = False) -> str:
    """The path of the worker's WorkerSnapshot (its spec: desiredState; or its status)."""
    return R.WORKER_SNAPSHOTS.path(namespace=pod.namespace, name=pod.name, subresource="status" if status else None)


def gate_path(pod: PodRef) -> str:
    """The path the serving gate is written to (the pod's status)."""
    return R.PODS.path(namespace=pod.namespace, name=pod.name, subresource="status")


def gate_of(pod: Obj) -> str | None:
    """The pod's ``dynsnap.io/serving`` readiness-gate condition (None: never set)."""
    return next((str(c.get("status")) for c in (pod.get("status") or {}).get("conditions") or []
                 if c.get("type") == P.CONDITION_SERVING), None)


async def set_override(api: Kube, pod: PodRef, value: str | None) -> None:
    """What ``dynsnap suspend|wake POD`` writes: the WorkerSnapshot's ``dynsnap.io/override`` (``suspended`` or
    ``active``, any case; None takes it away), by a merge patch."""
    ann = {P.ANN_OVERRIDE: value.capitalize() if value is not None else None}
    await api.merge_patch(R.WORKER_SNAPSHOTS, pod.name, {"metadata": {"annotations": ann}}, namespace=pod.namespace)


async def events_for(api: Kube, namespace: str, name: str) -> list[Obj]:
    evs = await api.list(R.EVENTS, namespace=namespace)
    return [e for e in evs.get("items", []) if (e.get("regarding") or {}).get("name") == name]
