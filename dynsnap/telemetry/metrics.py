"""Prometheus metrics of the agent and the controller, served on the health port's ``/metrics``.

Layer: ``dynsnap.telemetry`` (the only user of prometheus_client; above ``models``, below ``k8s``).

Every metric is named once, in :data:`METRICS`; :data:`METRIC_NAMES` is what a dashboard or an
alert may refer to (issue 10's Grafana dashboard is checked against it, :func:`family_of` maps
a series such as ``dynsnap_capture_duration_seconds_bucket`` back to its name). Each
:class:`Metrics` has its own registry (no process-global state: a test builds as many as it
likes); its methods are the only way values change, and :meth:`Metrics.render` is the text
exposition a ``HealthServer`` serves. Gauges that describe a snapshot of the world (workers by
state, GPU memory freed) are set by refresh callbacks that run at each render.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dynsnap.models.protocol import ObservedState

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "histogram"]

# A capture or wake of a big worker takes tens of seconds (a 16 GiB worker dumped in 23.8 s and
# restored in 17.7 s on the H200, docs/BENCHMARKS.md); a suspend-tier one well under a second.
OPERATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0)
# A verification is a few pinned requests through the frontend: sub-second when healthy, up to its
# timeout when not.
VERIFY_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exposed: counters end in _total
    kind: Kind
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


METRICS: Final[tuple[MetricSpec, ...]] = (
    MetricSpec("dynsnap_reconciles_total", "counter", ("controller", "result"),
               "Reconciles by controller (agent, controller, ...) and result (ok, error, ...)."),
    MetricSpec("dynsnap_queue_depth", "gauge", ("controller",),
               "Keys waiting in the controller's work queue."),
    MetricSpec("dynsnap_capture_duration_seconds", "histogram", ("tier",),
               "Seconds from a capture's start to the worker asleep (successful captures).", OPERATION_BUCKETS),
    MetricSpec("dynsnap_wake_duration_seconds", "histogram", ("tier",),
               "Seconds from a wake's start to the worker active again (successful wakes).", OPERATION_BUCKETS),
    MetricSpec("dynsnap_operations_total", "counter", ("operation", "tier", "result"),
               "Finished captures and wakes by operation (capture, wake), tier and result (ok, failed)."),
    MetricSpec("dynsnap_verify_duration_seconds", "histogram", ("result",),
               "Seconds a wake's verification took, by result (verified, or the Reason that failed it).",
               VERIFY_BUCKETS),
    MetricSpec("dynsnap_workers", "gauge", ("state",),
               "Workers with a WorkerSnapshot by observed state (status.state), as this process sees them."),
    MetricSpec("dynsnap_gpu_bytes_freed", "gauge", (),
               "Bytes of GPU memory freed by the workers asleep now (what their captures freed)."),
    MetricSpec("dynsnap_frontend_scrapes_total", "counter", ("result",),
               "Scrapes of the Dynamo frontend's metrics (demand) by result (ok, error)."),
    MetricSpec("dynsnap_api_requests_total", "counter", ("verb",),
               "Requests to the Kubernetes API server by HTTP verb."),
)
METRIC_NAMES: Final[frozenset[str]] = frozenset(m.name for m in METRICS)

# The states dynsnap_workers always shows (0 when none): a dashboard's series do not come and go.
WORKER_STATES: Final = tuple(s.value for s in ObservedState)

_SUFFIXES: Final = ("_bucket", "_count", "_sum", "_created")


def family_of(series: str) -> str | None:
    """The :data:`METRICS` name a series belongs to (``..._bucket``, ``..._count``, ``..._sum`` of a
    histogram, ``..._created`` of a counter or histogram), or None when it is none of dynsnap's."""
    if series in METRIC_NAMES:
        return series
    for suffix in _SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and (base in METRIC_NAMES or base + "_total" in METRIC_NAMES):
            return base if base in METRIC_NAMES else base + "_total"
    return None


class Metrics:
    """One process's metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._refresh: list[Callable[[], None]] = []
        made: dict[str, Counter | Gauge | Histogram] = {}
        for m in METRICS:
            if m.kind == "counter":
                # prometheus_client appends _total itself
                made[m.name] = Counter(m.name.removesuffix("_total"), m.help, m.labels, registry=self.registry)
            elif m.kind == "gauge":
                made[m.name] = Gauge(m.name, m.help, m.labels, registry=self.registry)
            else:
                made[m.name] = Histogram(m.name, m.help, m.labels, registry=self.registry, buckets=m.buckets)
        self._m = made
        for state in WORKER_STATES:
            self._gauge("dynsnap_workers").labels(state=state).set(0)
        self._gauge("dynsnap_gpu_bytes_freed").set(0)

    def _counter(self, name: str) -> Counter:
        c = self._m[name]
        assert isinstance(c, Counter)
        return c

    def _gauge(self, name: str) -> Gauge:
        g = self._m[name]
        assert isinstance(g, Gauge)
        return g

    def _histogram(self, name: str) -> Histogram:
        h = self._m[name]
        assert isinstance(h, Histogram)
        return h

    # -- events ---------------------------------------------------------------------------------

    def reconciled(self, controller: str, result: str) -> None:
        self._counter("dynsnap_reconciles_total").labels(controller=controller, result=result).inc()

    def set_queue_depth(self, controller: str, depth: int) -> None:
        self._gauge("dynsnap_queue_depth").labels(controller=controller).set(depth)

    def operation_finished(self, operation: Literal["capture", "wake"], tier: str, *, ok: bool,
                           seconds: float | None) -> None:
        """A capture or wake ended: counted by result; a successful one's duration observed (a failed
        one's time says how soon it failed, which would only blur the distribution)."""
        self._counter("dynsnap_operations_total").labels(operation=operation, tier=tier,
                                                         result="ok" if ok else "failed").inc()
        if ok and seconds is not None:
            name = "dynsnap_capture_duration_seconds" if operation == "capture" else "dynsnap_wake_duration_seconds"
            self._histogram(name).labels(tier=tier).observe(max(seconds, 0.0))

    def observe_capture(self, tier: str, seconds: float) -> None:
        self._histogram("dynsnap_capture_duration_seconds").labels(tier=tier).observe(max(seconds, 0.0))

    def observe_wake(self, tier: str, seconds: float) -> None:
        self._histogram("dynsnap_wake_duration_seconds").labels(tier=tier).observe(max(seconds, 0.0))

    def observe_verify(self, result: str, seconds: float) -> None:
        self._histogram("dynsnap_verify_duration_seconds").labels(result=result).observe(max(seconds, 0.0))

    def frontend_scrape(self, result: str) -> None:
        self._counter("dynsnap_frontend_scrapes_total").labels(result=result).inc()

    def api_request(self, verb: str) -> None:
        self._counter("dynsnap_api_requests_total").labels(verb=verb.upper()).inc()

    # -- snapshots ------------------------------------------------------------------------------

    def set_workers(self, counts: Mapping[str, int]) -> None:
        """Workers by state, from a snapshot: every known state is set (0 when absent from ``counts``)."""
        for state in {*WORKER_STATES, *counts}:
            self._gauge("dynsnap_workers").labels(state=state).set(counts.get(state, 0))

    def set_gpu_bytes_freed(self, n: int) -> None:
        self._gauge("dynsnap_gpu_bytes_freed").set(max(n, 0))

    def add_refresh(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` before each render (it sets the snapshot gauges from the process's stores)."""
        self._refresh.append(fn)

    def render(self) -> str:
        """The Prometheus text exposition (what ``/metrics`` answers)."""
        for fn in self._refresh:
            try:
                fn()
            except Exception:  # a stale gauge is better than no /metrics at all
                log.exception("refreshing metrics")
        return generate_latest(self.registry).decode()
