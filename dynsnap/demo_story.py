"""How ``dynsnap demo`` tells what happens (layer: cli, beside demo.py): the timeline it prints, the
narrator that reads WorkerSnapshot status and Events (polled, read-only), the kubelet's account of
each worker (KubeletWatch), the load generator, the proof of a wake it accepts, and the PNG timeline
at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from dynsnap.controller import timeline as TL
from dynsnap.k8s.client import Kube, Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import TEST_NAMESPACE


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.failures: list[str] = []

    def step(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.2f}s] {msg}", flush=True)

    def check(self, ok: bool, msg: str) -> None:
        self.step(("ok    " if ok else "FAILED") + f" {msg}")
        if not ok:
            self.failures.append(msg)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows])


def steps(record: dict[str, Any] | None) -> str:
    return ", ".join(f"{s['name']} {s['seconds']:.2f}s" for s in (record or {}).get("steps") or [])


def proof_of_wake(ws: Obj) -> dict[str, Any] | None:
    """The controller's passed verification of this worker's last wake, or of a recall after it (a
    quiesce called off as load came back: the controller proves the worker's return to serving again,
    under the wake id ``recall-<quiesce id>``, and that record replaces the wake's). None until then."""
    st = ws.get("status") or {}
    wake = st.get("lastWake") or {}
    v = (st.get("controller") or {}).get("verification") or {}
    if v.get("ok") is not True or not wake.get("id") or not wake.get("finished"):
        return None
    if v.get("wakeId") == wake["id"]:
        return dict(v)
    recall = str(v.get("wakeId", "")).startswith("recall-") and v.get("started")
    if recall and datetime.fromisoformat(v["started"]) >= datetime.fromisoformat(wake["finished"]):
        return dict(v)
    return None


async def _every(interval: float, look: Callable[[], Awaitable[None]], stop: asyncio.Event) -> None:
    """``look`` every ``interval`` seconds until ``stop`` (bounded by count; a failed look is skipped:
    the next one reads again)."""
    n = 0
    while not stop.is_set() and n < 100_000:
        n += 1
        with contextlib.suppress(Exception):
            await look()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


class Narrator:
    """Prints what dynsnap does, as it shows in WorkerSnapshot status and Events (polled; read-only)."""

    def __init__(self, api: Kube, tl: Timeline) -> None:
        self.api = api
        self.tl = tl
        self.seen: dict[str, dict[str, Any]] = {}
        self.events: set[str] = set()
        # pod -> finished operations, in order: what the table prints, and kind + record (as on the
        # WorkerSnapshot) for the PNG timeline
        self.history: dict[str, list[dict[str, Any]]] = {}

    async def poll(self) -> None:
        snaps = (await self.api.list(R.WORKER_SNAPSHOTS, namespace=TEST_NAMESPACE))["items"]
        for ws in snaps:
            self._ws(ws)
        evs = (await self.api.list(R.EVENTS, namespace=TEST_NAMESPACE))["items"]
        for e in sorted(evs, key=lambda e: e.get("eventTime") or e["metadata"].get("creationTimestamp") or ""):
            uid = e["metadata"]["uid"]
            if uid in self.events or not str(e.get("reportingController", "")).startswith(P.DYNSNAP_GROUP):
                continue
            self.events.add(uid)
            who = str(e.get("reportingController", "")).removeprefix(P.DYNSNAP_GROUP + "/")
            self.tl.step(f"  event  {who:<10} {e.get('type'):<7} {e['reason']:<18} "
                         f"{(e.get('regarding') or {}).get('name')}: {e.get('note', '')[:150]}")

    def _ws(self, ws: Obj) -> None:
        name = ws["metadata"]["name"]
        st = ws.get("status") or {}
        rec = st.get("controller") or {}
        last = self.seen.setdefault(name, {})
        hist = self.history.setdefault(name, [])
        q = rec.get("quiesce") or {}
        if q.get("finished") and q.get("ok") and last.get("quiesce") != q.get("id"):
            last["quiesce"] = q.get("id")
            if q.get("steps"):
                hist.append({"op": "quiesce", "steps": q["steps"], "kind": "quiesce", "record": q})
                self.tl.step(f"{name}: quiesced by the controller: {steps(q)}")
            else:  # a routable capture: the worker stays in serving (wake on request), nothing to quiesce
                self.tl.step(f"{name}: kept in serving by the controller (asleep routable: no quiesce)")
        cap = st.get("lastCapture") or {}
        if cap.get("finished") and last.get("capture") != cap.get("id"):
            last["capture"] = cap.get("id")
            hist.append({"op": f"capture ({cap.get('tier')})", "steps": cap.get("steps") or [], "ok": cap.get("ok"),
                         "kind": "capture", "record": cap})
            freed = st.get("image") or {}
            self.tl.step(f"{name}: captured by the agent ({cap.get('tier')}, ok={cap.get('ok')}): {steps(cap)}"
                         + (f"; image {freed.get('bytes', 0) / 2**20:.0f} MiB" if freed else ""))
        wake = st.get("lastWake") or {}
        if wake.get("finished") and last.get("wake") != wake.get("id"):
            last["wake"] = wake.get("id")
            hist.append({"op": f"wake ({wake.get('tier')})", "steps": wake.get("steps") or [], "ok": wake.get("ok"),
                         "kind": "wake", "record": wake})
            self.tl.step(f"{name}: woken in place by the agent (ok={wake.get('ok')}): {steps(wake)}")
        v = rec.get("verification") or {}
        if v.get("finished") and last.get("verified") != (v.get("wakeId"), v.get("ok")):
            last["verified"] = (v.get("wakeId"), v.get("ok"))
            hist.append({"op": "verify", "steps": v.get("steps") or [], "ok": v.get("ok"), "kind": "verify",
                         "record": v})
            self.tl.step(f"{name}: verification {'PASSED' if v.get('ok') else 'FAILED'} ({v.get('reason')}): "
                         f"{v.get('answered')}/{v.get('requests')} pinned answers; {steps(v)}")

    async def run(self, stop: asyncio.Event) -> None:
        await _every(0.25, self.poll, stop)


class KubeletWatch:
    """The kubelet's own account of each watched pod, polled: the states it went through, as
    (serving gate, Ready) pairs with repeats dropped, and its main container's id and restartCount
    at every look once it has one (read-only)."""

    def __init__(self, api: Kube, pods: dict[str, str], container: str = "main") -> None:
        self.api = api
        self.pods = pods  # name -> namespace
        self.container = container
        self.states: dict[str, list[tuple[str, bool]]] = {n: [] for n in pods}
        self.containers: dict[str, set[tuple[str, int]]] = {n: set() for n in pods}
        self.looks = 0

    async def look(self) -> None:
        for name, ns in self.pods.items():
            pod = await self.api.get(R.PODS, name, namespace=ns)
            conds = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}
            state = (conds.get(P.CONDITION_SERVING, "Unset"), conds.get("Ready") == "True")
            if not self.states[name] or self.states[name][-1] != state:
                self.states[name].append(state)
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                # no id yet while the pod's init containers run (the watch begins as the pod starts)
                if cs["name"] == self.container and cs.get("containerID"):
                    self.containers[name].add((cs.get("containerID", ""), int(cs.get("restartCount", 0))))
        self.looks += 1

    def since_ready(self, name: str) -> list[tuple[str, bool]]:
        """``name``'s states from the first look that saw it Ready (none, if never): a watch begun as the
        pod starts sees it not Ready first, before the controller has let it serve."""
        seen = self.states[name]
        first = next((i for i, (_, ready) in enumerate(seen) if ready), len(seen))
        return seen[first:]

    def through_gate(self, name: str) -> bool:
        """Every time ``name`` was seen not Ready after it first was, its serving gate was False then or
        just before (out of serving only by the gate), and it was seen Ready again after being not Ready
        at least once (back in serving)."""
        seen = self.since_ready(name)
        if not seen:
            return False
        back = False
        for i in range(1, len(seen)):
            gate, ready = seen[i]
            if not ready and gate != "False" and seen[i - 1][0] != "False":
                return False
            back = back or (ready and not seen[i - 1][1])
        return back

    async def run(self, stop: asyncio.Event) -> None:
        await _every(0.5, self.look, stop)


class LoadGen:
    """Unpinned chat completions through the frontend from ``clients`` concurrent clients."""

    def __init__(self, fe: D.FrontendClient, clients: int, *, pause: float = 0.0, max_tokens: int = 40,
                 name: str = "load") -> None:
        self.fe, self.clients, self.pause, self.max_tokens, self.name = fe, clients, pause, max_tokens, name
        self.ok = 0
        self.failed: list[str] = []  # each: when (since start), its x-request-id, what came back
        self.failed_ids: list[str] = []
        self.started = time.monotonic()
        self.stop_ev = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.started = time.monotonic()
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]

    def _at(self) -> str:
        """When a request failed: seconds since this load started, to place it on the timeline."""
        return f"+{time.monotonic() - self.started:.2f}s"

    async def _client(self, i: int) -> None:
        n = 0
        while not self.stop_ev.is_set() and n < 10_000:
            n += 1
            rid = f"dynsnap-demo-{self.name}-{i}-{n}"  # x-request-id: the frontend logs the request under it
            try:
                r = await self.fe.chat(f"load {i}.{n}", max_tokens=self.max_tokens, request_id=rid)
                if r.status == 200:
                    self.ok += 1
                else:
                    self._fail(rid, f"HTTP {r.status} {str(r.body)[:160]}")
            except httpx.HTTPError as e:
                self._fail(rid, f"{type(e).__name__}: {str(e)[:160]}")
            if self.pause:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop_ev.wait(), self.pause)

    def _fail(self, rid: str, what: str) -> None:
        self.failed.append(f"{self._at()} {rid} {what}")
        self.failed_ids.append(rid)

    async def stop(self) -> None:
        self.stop_ev.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)




def frontend_account(log: str, request_ids: list[str], *, per_request: int = 8) -> list[str]:
    """The frontend's own log lines about each failed request (the lines naming its ``x-request-id``:
    where it routed it, how that failed), colour codes stripped, at most ``per_request`` lines each."""
    lines = [D.uncoloured(line) for line in log.splitlines()]
    out: list[str] = []
    for rid in request_ids:
        named = re.compile(rf"(?<![\w-]){re.escape(rid)}(?![\w-])")  # the whole id: not -3-7 in -3-70
        said = [line.strip()[:400] for line in lines if named.search(line)][:per_request]
        out.append(f"{rid}: " + ("\n      ".join(["", *said]) if said else "not in the frontend's log"))
    return out


async def snapshots(api: Kube) -> list[Obj]:
    items: list[Obj] = (await api.list(R.WORKER_SNAPSHOTS, namespace=TEST_NAMESPACE))["items"]
    return items


def asleep(ws: Obj) -> bool:
    return ws["spec"]["desiredState"] == "Suspended" and (ws.get("status") or {}).get("state") == "Suspended"


def write_timeline(narrator: Narrator, path: Path, tl: Timeline) -> None:
    """The PNG of every operation the narrator saw (dynsnap/controller/timeline.py); a failure to draw
    it is a failed check, said with its reason (the plots extra missing: how to install it)."""
    ops = [op for name in sorted(narrator.history) for h in narrator.history[name]
           if (op := TL.operation(name, h["kind"], h["record"])) is not None]
    try:
        w, h = TL.write_timeline(ops, path, title="dynsnap demo: every quiesce, capture, wake and verification")
    except (TL.PlotsUnavailable, ValueError, OSError) as e:
        tl.check(False, f"timeline PNG not written: {e}")
        return
    tl.check(path.is_file(), f"timeline of {len(ops)} operations drawn: {path.resolve()} ({w}x{h} px)")
