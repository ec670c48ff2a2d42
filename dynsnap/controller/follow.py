"""`dynsnap status`, `dynsnap suspend POD`, `dynsnap wake POD`: what a person runs (layer: controller).

``status`` lists the WorkerSnapshots of a namespace (or all) through an ``Informer`` and prints a
table (``dynsnap.controller.userview``); with ``watch`` it keeps watching and prints again every
row whose content changed, until SIGINT/SIGTERM.

``request`` is the manual override: after checking that the pod exists and that dynsnap manages it
(it has a WorkerSnapshot naming its UID), it merge-patches the WorkerSnapshot's ``dynsnap.io/override``
annotation
(with the WorkerSnapshot's UID in the patch, so one made anew in between is refused, not written;
the pod is never written: the pod annotation ``dynsnap.io/desired-state`` of earlier releases is
deprecated) and follows the pod's WorkerSnapshot through an ``Informer`` (a field selector on its
name), printing what ``dynsnap.controller.progress.Tracker`` makes of each change, until its
outcome (exit 0 or 1), or ``timeout`` seconds (exit 3, with what was last seen). Bad input (no such
pod, a pod dynsnap does not manage, a bad name, a request RBAC refuses) is exit 2, nothing changed.

``wake_all`` (``dynsnap wake --all``) is ``request`` for every worker of a namespace (or all): every
override set first, then each followed; the Helm chart's pre-delete hook runs it before an uninstall
takes the agents and the controller away.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TextIO

from dynsnap.controller import timeline as TL
from dynsnap.controller import userview as U
from dynsnap.controller.progress import FAILED, OK, OVERRIDE_VALUE, TIMEOUT, USAGE, Outcome, Tracker
from dynsnap.controller.session import UsageError, check_name, connect, explain, preflight
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Invalid, K8sError, NotFound
from dynsnap.k8s.informer import Informer
from dynsnap.k8s.store import DELETED
from dynsnap.k8s.times import now as utcnow
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.workersnapshot import DNS1123_LABEL, DNS1123_SUBDOMAIN

# How long the first list may take before the command gives up: a person is waiting.
SYNC_TIMEOUT: Final = 60.0
# Pod reads for the DGD/component columns run at most this many at once: a fleet of thousands is
# read in a few seconds without a burst the API server's priority and fairness would throttle.
POD_READS: Final = 16
# `dynsnap wake --all` follows this many workers at once (one watch each): a fleet of thousands does
# not open thousands of watches at once, and every wake was requested before any is followed.
FOLLOW_AT_ONCE: Final = 16


# -- status ----------------------------------------------------------------------------------------

class _Pods:
    """Pod reads for the DGD/component columns: each pod read once (labels of a pod never change its
    graph), a few at a time; a pod that is gone or unreadable leaves the columns empty."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.cache: dict[str, Obj | None] = {}
        self.sem = asyncio.Semaphore(POD_READS)

    async def get(self, ws: Obj) -> Obj | None:
        meta = ws.get("metadata") or {}
        labels = meta.get("labels") or {}
        if P.LABEL_DGD_NAME in labels and P.LABEL_COMPONENT in labels:
            return None  # the WorkerSnapshot carries them: no read needed
        ns, name = meta.get("namespace"), (ws.get("spec") or {}).get("podName") or meta.get("name")
        key = f"{ns}/{name}/{(ws.get('spec') or {}).get('podUID')}"
        if key not in self.cache:
            async with self.sem:
                try:
                    self.cache[key] = await self.kube.get(R.PODS, str(name), namespace=ns)
                except K8sError:
                    self.cache[key] = None
        return self.cache[key]


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


async def status(kube: Kube, *, namespace: str | None, watch: bool, output: str, out: TextIO, err: TextIO,
                 stop: asyncio.Event | None = None) -> int:
    """Print the table (or JSON) of the workers in ``namespace`` (None: all); with ``watch``, then every
    changed row, until ``stop`` is set (SIGINT/SIGTERM set it)."""
    if namespace is not None:
        check_name("namespace", namespace, DNS1123_LABEL)
    await preflight(kube, namespace)
    stop = stop or asyncio.Event()
    _stop_on_signals(stop)
    pods = _Pods(kube)
    changes: asyncio.Queue[tuple[str, Obj]] = asyncio.Queue()
    informer = Informer(kube, R.WORKER_SNAPSHOTS, namespace=namespace, name="dynsnap-status")
    informer.add_handler(lambda typ, obj: changes.put_nowait((typ, obj)) if informer.synced else None)

    def emit(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    async with informer:
        await informer.wait_synced(SYNC_TIMEOUT)
        objs = informer.store.list()
        rows = [U.row(ws, pod) for ws, pod in zip(objs, await asyncio.gather(*map(pods.get, objs)), strict=True)]
        now = utcnow()
        namespaced = namespace is None
        shown: dict[str, Any] = {}
        for r in rows:
            shown[r.key] = U.as_json(r, now) | {"idleSeconds": None}
        if output == "json" and not watch:
            emit(json.dumps({"items": [U.as_json(r, now) for r in sorted(rows, key=U.sort_key)]}, indent=2))
            return OK
        if output == "json":
            for r in sorted(rows, key=U.sort_key):
                emit(json.dumps({"type": "ADDED", "row": U.as_json(r, now)}))
        elif rows:
            for line in U.table(rows, now, namespaced=namespaced):
                emit(line)
        else:
            err.write(f"No WorkerSnapshots in {'any namespace' if namespaced else f'namespace {namespace}'}.\n")
            err.flush()
            if not watch:
                return OK
        if not watch:
            return OK
        w = U.widths([U.HEADER, *(U.cells(r, now, namespaced=namespaced) for r in rows)])
        if not rows and output != "json":
            emit(U.format_line(U.HEADER, w))
        stopped = asyncio.ensure_future(stop.wait())
        watching = informer.start()  # the running task: it ends only by failing (InformerFailed)
        try:
            while not stop.is_set():
                got = asyncio.ensure_future(changes.get())
                await asyncio.wait([got, stopped, watching], return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    break
                typ, ws = got.result()
                r = U.row(ws, await pods.get(ws))
                now = utcnow()
                # Compare without the ages: a row is news when what it says changed, not its clock.
                sig = U.as_json(r, now) | {"idleSeconds": None}
                if typ != DELETED and shown.get(r.key) == sig:
                    continue
                shown[r.key] = sig
                if output == "json":
                    emit(json.dumps({"type": typ, "row": U.as_json(r, now)}))
                    continue
                cols = U.cells(r, now, namespaced=namespaced)
                if typ == DELETED:
                    shown.pop(r.key, None)
                    cols = (*cols[:3], "(deleted)", *cols[4:])
                w = [max(a, len(b)) for a, b in zip(w, cols, strict=True)]
                emit(U.format_line(cols, w))
        finally:
            stopped.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopped
        if informer.failure is not None:
            raise informer.failure
    return OK


async def timeline(kube: Kube, *, namespace: str, pod: str, path: Path, out: TextIO) -> int:
    """``dynsnap status --timeline POD``: the PNG timeline of the worker's last quiesce, capture, wake
    and verification, as its WorkerSnapshot records them (dynsnap/controller/timeline.py). Exit 0 when
    written, 1 when nothing is recorded yet (nothing written), 2 for a pod dynsnap does not manage."""
    check_name("namespace", namespace, DNS1123_LABEL)
    check_name("pod", pod, DNS1123_SUBDOMAIN)
    try:
        ws = await kube.get(R.WORKER_SNAPSHOTS, pod, namespace=namespace)
    except NotFound as e:
        raise UsageError(f"pod {namespace}/{pod} has no WorkerSnapshot: dynsnap does not manage it") from e
    except K8sError as e:
        raise UsageError(explain(e)) from e
    ops = TL.operations_of(ws)
    if not ops:
        out.write(f"{namespace}/{pod}: no quiesce, capture, wake or verification recorded yet; nothing written\n")
        out.flush()
        return FAILED
    w, h = TL.write_timeline(ops, path, title=f"dynsnap: {namespace}/{pod}, its last capture and wake")
    out.write(f"wrote {path} ({w}x{h} px): " + "; ".join(
        f"{op.label} {op.seconds:.2f}s{'' if op.ok is not False else ' FAILED'}" for op in ops) + "\n")
    out.flush()
    return OK


# -- suspend / wake ----------------------------------------------------------------------------------

async def _target(kube: Kube, namespace: str, pod: str) -> tuple[Obj, Obj]:
    """The pod and its WorkerSnapshot, or the reason there is nothing to act on."""
    try:
        obj = await kube.get(R.PODS, pod, namespace=namespace)
    except NotFound as e:
        hint = ""
        with contextlib.suppress(K8sError):
            listed = await kube.list(R.WORKER_SNAPSHOTS, namespace=namespace, limit=1)
            if not listed.get("items"):
                hint = f" (namespace {namespace!r} has no dynsnap workers: is it the right one? -n NAMESPACE)"
        raise UsageError(f"pod {namespace}/{pod} not found{hint}; nothing changed") from e
    except K8sError as e:
        raise UsageError(f"{explain(e)}; nothing changed") from e
    try:
        ws = await kube.get(R.WORKER_SNAPSHOTS, pod, namespace=namespace)
    except NotFound as e:
        raise UsageError(f"pod {namespace}/{pod} has no WorkerSnapshot: dynsnap does not manage it (its DGD "
                         f"component is not opted in with {P.ANN_ENABLED}: \"true\", or the controller has not "
                         "picked it up yet); nothing changed") from e
    except K8sError as e:
        raise UsageError(f"{explain(e)}; nothing changed") from e
    uid = obj["metadata"]["uid"]
    if (ws.get("spec") or {}).get("podUID") != uid:
        raise UsageError(f"the WorkerSnapshot {namespace}/{pod} names the pod with UID "
                         f"{(ws.get('spec') or {}).get('podUID')}, the pod now has UID {uid}: it was recreated "
                         "and the controller has not caught up yet; try again shortly. Nothing changed")
    return obj, ws


async def request(kube: Kube, *, action: str, namespace: str, pod: str, timeout: float, follow: bool,
                  out: TextIO, clock: Callable[[], float] = time.monotonic) -> int:
    """Set the override on ``pod`` and (``follow``) print progress until the outcome; the exit code."""
    started = clock()
    check_name("namespace", namespace, DNS1123_LABEL)
    check_name("pod", pod, DNS1123_SUBDOMAIN)
    ws = await _set_override(kube, action=action, namespace=namespace, pod=pod, out=out)
    if not follow:
        return OK
    return await _follow(kube, action=action, namespace=namespace, pod=pod, ws=ws, timeout=timeout, started=started,
                         out=out, clock=clock)


async def _set_override(kube: Kube, *, action: str, namespace: str, pod: str, out: TextIO) -> Obj:
    """The override on ``pod``'s WorkerSnapshot (its ``dynsnap.io/override`` annotation; after the checks of
    :func:`_target`);
    the WorkerSnapshot as it was before. The pod itself is not written: people who drive dynsnap need no
    right to patch pods (deploy/rbac/user.yaml)."""
    obj, ws = await _target(kube, namespace, pod)
    value = OVERRIDE_VALUE[action]
    before = (ws["metadata"].get("annotations") or {}).get(P.ANN_OVERRIDE)
    # The UID in the patch makes the API server refuse it (immutable field) if the WorkerSnapshot was made
    # anew since we read it (its pod recreated): the override goes on the worker that was checked, or nowhere.
    patch = {"metadata": {"uid": ws["metadata"]["uid"], "annotations": {P.ANN_OVERRIDE: value}}}
    try:
        await kube.merge_patch(R.WORKER_SNAPSHOTS, pod, patch, namespace=namespace)
    except Invalid as e:
        raise UsageError(f"the WorkerSnapshot {namespace}/{pod} was made anew while this ran ({e.message}); nothing "
                         "changed") from e
    except NotFound as e:
        raise UsageError(f"the WorkerSnapshot {namespace}/{pod} was deleted while this ran; nothing changed") from e
    except K8sError as e:
        raise UsageError(f"{explain(e)}; nothing changed") from e
    legacy = (obj["metadata"].get("annotations") or {}).get(P.ANN_DESIRED_STATE)
    out.write(f"pod {namespace}/{pod}: override {value} (was: {before or 'unset'})\n")
    if legacy is not None:
        out.write(f"note: the pod also carries the deprecated {P.ANN_DESIRED_STATE}={legacy}, which the override "
                  f"wins over; remove it: kubectl -n {namespace} annotate pod {pod} {P.ANN_DESIRED_STATE}-\n")
    out.flush()
    return ws


async def _follow(kube: Kube, *, action: str, namespace: str, pod: str, ws: Obj, timeout: float, started: float,
                  out: TextIO, clock: Callable[[], float]) -> int:
    """Print the progress of ``pod``'s WorkerSnapshot (``ws``: as it was before the request) until the
    outcome or ``timeout`` seconds after ``started``; the exit code."""

    def emit(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    tracker = Tracker(action, ws)
    emit(f"following WorkerSnapshot {namespace}/{pod} (timeout {timeout:.0f}s): "
         f"{U.summary(tracker.last, utcnow())}")
    seen: asyncio.Queue[tuple[str, Obj]] = asyncio.Queue()
    informer = Informer(kube, R.WORKER_SNAPSHOTS, namespace=namespace, field_selector=f"metadata.name={pod}",
                        name=f"dynsnap-{action}")
    informer.add_handler(lambda typ, o: seen.put_nowait((typ, o)))
    async with informer:
        while True:
            left = timeout - (clock() - started)
            if left <= 0:
                break
            try:
                typ, o = await asyncio.wait_for(seen.get(), timeout=left)
            except TimeoutError:
                break
            outcome: Outcome | None
            if typ == DELETED:
                outcome = tracker.deleted()
            else:
                upd = tracker.observe(o)
                for line in upd.lines:
                    emit(f"  {line}")
                outcome = upd.outcome
            if outcome is not None:
                emit(outcome.line)
                return outcome.code
    why = f" (watch failing: {informer.stats.last_error})" if informer.stats.consecutive_failures else ""
    emit(f"timed out after {timeout:.0f}s{why}; last seen: {U.summary(tracker.last, utcnow())}")
    return TIMEOUT


# -- wake --all -------------------------------------------------------------------------------------

async def _managed(kube: Kube, namespace: str | None) -> list[Obj]:
    """Every WorkerSnapshot in ``namespace`` (None: all), page by page."""
    items: list[Obj] = []
    token: str | None = None
    for _ in range(100_000):  # bounded: 500 per page
        page = await kube.list(R.WORKER_SNAPSHOTS, namespace=namespace, limit=500, continue_token=token)
        items += page.get("items") or []
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            break
    return items


async def _gone(kube: Kube, namespace: str, pod: str, uid: str | None) -> str | None:
    """Why ``pod`` has no worker of this WorkerSnapshot to wake (deleted, or recreated with another UID:
    the new pod started cold), or None when it is there."""
    try:
        obj = await kube.get(R.PODS, pod, namespace=namespace)
    except NotFound:
        return "its pod is gone"
    if obj["metadata"].get("uid") != uid:
        return "its pod was recreated (a new pod starts awake)"
    return None


async def wake_all(kube: Kube, *, namespace: str | None, timeout: float, follow: bool, out: TextIO,
                   clock: Callable[[], float] = time.monotonic) -> int:
    """``dynsnap wake --all``: the override ``active`` on every worker dynsnap manages in ``namespace``
    (None: every namespace), all set first (so the controller wakes them together and starts no other
    capture), then each followed as ``wake POD`` follows one, ``FOLLOW_AT_ONCE`` at a time, a worker's
    lines printed together when it is done. deploy/helm/dynsnap's pre-delete hook runs it before the
    agents and the controller are deleted, so no worker is left asleep with no one to wake it.

    A WorkerSnapshot whose pod is gone or was recreated has no sleeping worker: skipped, and said so.
    Exit 0 when every worker is awake, 1 when a wake failed or could not be requested, 3 when one was
    not done within ``timeout`` seconds (the bound of the whole run)."""
    started = clock()
    if namespace is not None:
        check_name("namespace", namespace, DNS1123_LABEL)
    await preflight(kube, namespace)
    where = f"namespace {namespace}" if namespace else "every namespace"
    wss = sorted(await _managed(kube, namespace),
                 key=lambda w: (w["metadata"]["namespace"], (w.get("spec") or {}).get("podName") or ""))
    out.write(f"waking every worker dynsnap manages in {where}: {len(wss)} WorkerSnapshots\n")
    out.flush()
    codes: dict[str, int] = {}  # "ns/pod" -> exit code of its wake
    requested: list[tuple[str, str, Obj]] = []
    skipped = 0
    for ws in wss:
        ns, pod = ws["metadata"]["namespace"], (ws.get("spec") or {}).get("podName") or ws["metadata"]["name"]
        why = await _gone(kube, ns, pod, (ws.get("spec") or {}).get("podUID"))
        if why is None:
            try:
                requested.append((ns, pod, await _set_override(kube, action="wake", namespace=ns, pod=pod, out=out)))
                codes[f"{ns}/{pod}"] = OK  # the override is set; with follow, its outcome replaces this
                continue
            except UsageError as e:
                why = await _gone(kube, ns, pod, (ws.get("spec") or {}).get("podUID"))
                if why is None:
                    out.write(f"pod {ns}/{pod}: {e}\n")
                    codes[f"{ns}/{pod}"] = FAILED
                    continue
        out.write(f"pod {ns}/{pod}: skipped, {why}\n")
        skipped += 1
    out.flush()
    if follow and requested:
        gate = asyncio.Semaphore(FOLLOW_AT_ONCE)

        async def one(ns: str, pod: str, ws: Obj) -> None:
            async with gate:
                buf = io.StringIO()
                try:
                    codes[f"{ns}/{pod}"] = await _follow(kube, action="wake", namespace=ns, pod=pod, ws=ws,
                                                         timeout=timeout, started=started, out=buf, clock=clock)
                except K8sError as e:
                    buf.write(f"pod {ns}/{pod}: {explain(e)}\n")
                    codes[f"{ns}/{pod}"] = FAILED
                out.write(buf.getvalue())
                out.flush()

        await asyncio.gather(*(one(ns, pod, ws) for ns, pod, ws in requested))
    failed = sorted(k for k, c in codes.items() if c == FAILED)
    late = sorted(k for k, c in codes.items() if c == TIMEOUT)
    done = sum(1 for c in codes.values() if c == OK)
    summary = f"{done} of {len(codes)} {'awake' if follow else 'asked to wake'}, {skipped} skipped"
    out.write(summary + (f"; failed: {', '.join(failed)}" if failed else "")
              + (f"; not done in {timeout:.0f}s: {', '.join(late)}" if late else "") + "\n")
    out.flush()
    return FAILED if failed else TIMEOUT if late else OK


# The exit codes, with the commands (the CLI maps errors to them).
__all__ = ["FAILED", "OK", "TIMEOUT", "USAGE", "UsageError", "connect", "explain", "request", "status", "wake_all"]
