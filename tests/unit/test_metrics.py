"""dynsnap's Prometheus metrics (dynsnap/telemetry/metrics.py): every name in the table is exposed,
the text parses as Prometheus exposition, and what is recorded is what is rendered."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from dynsnap.telemetry.metrics import METRIC_NAMES, METRICS, WORKER_STATES, Metrics, family_of


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_render_names_every_metric_of_the_table() -> None:
    text = Metrics().render()
    helped = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    assert helped == set(METRIC_NAMES)
    assert {m.name for m in METRICS} == METRIC_NAMES and len(METRICS) == len(METRIC_NAMES)
    assert all(n.startswith("dynsnap_") for n in METRIC_NAMES)


def test_histograms_observe() -> None:
    m = Metrics()
    m.operation_finished("capture", "snapshot", ok=True, seconds=23.8)
    m.operation_finished("capture", "snapshot", ok=True, seconds=0.4)
    m.operation_finished("capture", "snapshot", ok=False, seconds=3.0)  # counted, not timed
    m.operation_finished("wake", "suspend", ok=True, seconds=0.3)
    m.observe_verify("ok", 0.2)
    s = _samples(m.render())
    snap = (("tier", "snapshot"),)
    assert s[("dynsnap_capture_duration_seconds_count", snap)] == 2
    assert s[("dynsnap_capture_duration_seconds_sum", snap)] == 23.8 + 0.4
    assert s[("dynsnap_capture_duration_seconds_bucket", (("le", "0.5"), *snap))] == 1
    assert s[("dynsnap_capture_duration_seconds_bucket", (("le", "30.0"), *snap))] == 2
    assert s[("dynsnap_capture_duration_seconds_bucket", (("le", "120.0"), *snap))] == 2
    assert s[("dynsnap_wake_duration_seconds_count", (("tier", "suspend"),))] == 1
    assert s[("dynsnap_verify_duration_seconds_count", (("result", "ok"),))] == 1
    assert s[("dynsnap_operations_total", (("operation", "capture"), ("result", "failed"), ("tier", "snapshot")))] == 1
    assert s[("dynsnap_operations_total", (("operation", "capture"), ("result", "ok"), ("tier", "snapshot")))] == 2


def test_counters_and_snapshot_gauges() -> None:
    m = Metrics()
    freed = [1 << 30]
    m.add_refresh(lambda: m.set_gpu_bytes_freed(freed[0]))
    m.reconciled("agent", "ok")
    m.reconciled("agent", "ok")
    m.set_queue_depth("controller", 3)
    m.frontend_scrape("error")
    m.api_request("patch")
    m.set_workers({"Suspended": 2, "Active": 1})
    s = _samples(m.render())
    assert s[("dynsnap_reconciles_total", (("controller", "agent"), ("result", "ok")))] == 2
    assert s[("dynsnap_queue_depth", (("controller", "controller"),))] == 3
    assert s[("dynsnap_frontend_scrapes_total", (("result", "error"),))] == 1
    assert s[("dynsnap_api_requests_total", (("verb", "PATCH"),))] == 1
    assert s[("dynsnap_gpu_bytes_freed", ())] == 1 << 30
    workers = {dict(k[1])["state"]: v for k, v in s.items() if k[0] == "dynsnap_workers"}
    assert workers == {**dict.fromkeys(WORKER_STATES, 0.0), "Suspended": 2, "Active": 1}
    m.set_workers({"Active": 3})  # a snapshot: states absent from it go to 0
    freed[0] = 0
    s = _samples(m.render())
    assert s[("dynsnap_workers", (("state", "Suspended"),))] == 0
    assert s[("dynsnap_workers", (("state", "Active"),))] == 3
    assert s[("dynsnap_gpu_bytes_freed", ())] == 0


def test_a_failing_refresh_does_not_take_metrics_down() -> None:
    m = Metrics()

    def broken() -> None:
        raise RuntimeError("store gone")
    m.add_refresh(broken)
    assert "dynsnap_workers" in m.render()


def test_each_registry_is_its_own() -> None:
    a, b = Metrics(), Metrics()
    a.reconciled("agent", "ok")
    assert ("dynsnap_reconciles_total", (("controller", "agent"), ("result", "ok"))) not in _samples(b.render())


def test_family_of_maps_series_back_to_the_table() -> None:
    assert family_of("dynsnap_capture_duration_seconds_bucket") == "dynsnap_capture_duration_seconds"
    assert family_of("dynsnap_capture_duration_seconds_count") == "dynsnap_capture_duration_seconds"
    assert family_of("dynsnap_reconciles_total") == "dynsnap_reconciles_total"
    assert family_of("dynsnap_reconciles_created") == "dynsnap_reconciles_total"
    assert family_of("dynsnap_workers") == "dynsnap_workers"
    assert family_of("dynsnap_capture_seconds") is None
    assert family_of("dynamo_component_inflight_requests") is None
