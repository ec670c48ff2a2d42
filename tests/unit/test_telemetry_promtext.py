"""One reader of Prometheus text for the controller and the agent (dynsnap/telemetry/promtext.py, over
prometheus_client's parser): only the metrics asked for, by their exact name; a line the parser refuses
skipped, not the page; NaN, infinite and negative values left out; labels as the parser reads them
(the worker's ``worker_id`` label is its instance id in hex). And both readers built on it keep what
they promised (tests/unit/test_frontend_parse.py, test_agent_idle.py)."""

from __future__ import annotations

import pytest

from dynsnap.agent.idle import MetricsUnavailable, Sample, parse_metrics
from dynsnap.controller.frontend import parse_demand
from dynsnap.controller.plan import Demand
from dynsnap.telemetry import promtext

WORKER = """\
# HELP dynamo_component_inflight_requests in flight
# TYPE dynamo_component_inflight_requests gauge
dynamo_component_inflight_requests{dynamo_endpoint="generate",worker_id="43710f49c0cff"} 2
dynamo_component_inflight_requests{dynamo_endpoint="clear_kv_blocks",worker_id="43710f49c0cff"} 0
dynamo_component_inflight_requests_total{worker_id="43710f49c0cff"} 70
dynamo_component_requests_total{dynamo_endpoint="generate",worker_id="43710f49c0cff"} 4.1e1 1796000000000
dynamo_component_requests_total{dynamo_endpoint="odd \\"quoted\\", name",worker_id="43710f49c0cff"} 1
"""


def test_only_the_named_metrics_by_their_exact_name_with_their_labels() -> None:
    found = promtext.samples(WORKER, ["dynamo_component_inflight_requests", "dynamo_component_requests_total"])
    assert [(s.name, s.value) for s in found] == [
        ("dynamo_component_inflight_requests", 2.0), ("dynamo_component_inflight_requests", 0.0),
        ("dynamo_component_requests_total", 41.0), ("dynamo_component_requests_total", 1.0)]
    assert found[0].labels == {"dynamo_endpoint": "generate", "worker_id": "43710f49c0cff"}  # hex, as a string
    assert found[3].labels["dynamo_endpoint"] == 'odd "quoted", name'
    assert promtext.total(found, "dynamo_component_inflight_requests") == 2.0
    assert promtext.total(found, "nothing") is None


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1", "not-a-number"])
def test_a_value_that_counts_no_requests_is_left_out_and_the_rest_read(value: str) -> None:
    page = f'm{{a="x"}} {value}\nm{{a="y"}} 3\n'
    assert [(s.labels["a"], s.value) for s in promtext.samples(page, ["m"])] == [("y", 3.0)]


def test_a_line_the_parser_refuses_is_skipped_not_the_page() -> None:
    page = 'm{a="x"} 1\nm{a="unterminated} 2\nm 4\nm{a="z"} 5 not-a-timestamp\n'
    assert [s.value for s in promtext.samples(page, ["m"])] == [1.0, 4.0]


def test_both_readers_leave_out_what_counts_no_requests() -> None:
    # The agent's reader once took NaN only: +Inf in flight raised OverflowError, -1 made a busy worker idle.
    page = ('dynamo_component_inflight_requests{worker_id="1f"} +Inf\n'
            'dynamo_component_inflight_requests{worker_id="1f"} -1\n'
            'dynamo_component_inflight_requests{worker_id="1f"} 2\n'
            'dynamo_component_requests_total{worker_id="1f"} NaN\n'
            'dynamo_component_requests_total{worker_id="1f"} 9\n')
    assert parse_metrics(page) == Sample(inflight=2, requests=9.0)
    with pytest.raises(MetricsUnavailable):
        parse_metrics('dynamo_component_inflight_requests{worker_id="1f"} NaN\n')
    assert parse_demand('dynamo_frontend_inflight_requests{model="a"} -Inf\n'
                        'dynamo_frontend_queued_requests{model="a"} 2\n') == Demand(inflight=0.0, queued=2.0)
