"""Idle facts from a worker's own metrics: parsed from Dynamo's exposition, and written only when
they change (a quiet fleet writes nothing)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from dynsnap.agent.idle import MetricsUnavailable, Sample, advance, parse_metrics
from dynsnap.models.workersnapshot import IdleFacts

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
METRICS = """# HELP dynamo_component_inflight_requests in flight
# TYPE dynamo_component_inflight_requests gauge
dynamo_component_inflight_requests{dynamo_endpoint="generate",worker_id="43710f49c0cff"} 2
dynamo_component_inflight_requests{dynamo_endpoint="clear_kv_blocks",worker_id="43710f49c0cff"} 0
dynamo_component_requests_total{dynamo_endpoint="generate",worker_id="43710f49c0cff"} 41
dynamo_component_requests_total{dynamo_endpoint="clear_kv_blocks",worker_id="43710f49c0cff"} 1
dynamo_component_request_duration_seconds_sum{dynamo_endpoint="generate"} 3.5
"""


def test_parse_sums_every_series() -> None:
    assert parse_metrics(METRICS) == Sample(inflight=2, requests=42.0)


def test_metrics_without_the_inflight_series_are_unusable() -> None:
    with pytest.raises(MetricsUnavailable, match="dynamo_component_inflight_requests"):
        parse_metrics("dynamo_component_requests_total 3\n")


def test_first_quiet_sample_sets_idle_since() -> None:
    facts = advance(None, Sample(0, 5.0), now=T0, granularity=30)
    assert facts == IdleFacts(inflight=0, requests_total=5.0, last_activity=None, idle_since=T0)


def test_quiet_worker_writes_nothing_more() -> None:
    prev = IdleFacts(inflight=0, requests_total=5.0, idle_since=T0)
    assert advance(prev, Sample(0, 5.0), now=T0 + timedelta(minutes=9), granularity=30) is None


def test_activity_clears_idle_since_at_once() -> None:
    prev = IdleFacts(inflight=0, requests_total=5.0, idle_since=T0)
    now = T0 + timedelta(seconds=3)
    assert advance(prev, Sample(0, 6.0), now=now, granularity=30) == IdleFacts(
        inflight=0, requests_total=6.0, last_activity=now, idle_since=None)
    assert advance(prev, Sample(1, 5.0), now=now, granularity=30) is not None


def test_busy_worker_rewrites_last_activity_at_most_once_per_granularity() -> None:
    prev = IdleFacts(inflight=3, requests_total=10.0, last_activity=T0)
    assert advance(prev, Sample(2, 20.0), now=T0 + timedelta(seconds=10), granularity=30) is None
    later = advance(prev, Sample(2, 30.0), now=T0 + timedelta(seconds=31), granularity=30)
    assert later is not None and later.last_activity == T0 + timedelta(seconds=31)


def test_going_quiet_dates_idleness_from_the_last_activity() -> None:
    prev = IdleFacts(inflight=0, requests_total=10.0, last_activity=T0)
    facts = advance(prev, Sample(0, 10.0), now=T0 + timedelta(minutes=1), granularity=30)
    assert facts is not None and facts.idle_since == T0


def test_a_counter_reset_is_activity() -> None:
    prev = IdleFacts(inflight=0, requests_total=10.0, idle_since=T0)
    facts = advance(prev, Sample(0, 0.0), now=T0 + timedelta(minutes=1), granularity=30)
    assert facts is not None and facts.idle_since is None
