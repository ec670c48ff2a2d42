"""What the controller reads from a Dynamo frontend, as pure functions (dynsnap/controller/frontend.py):
the demand on its ``/metrics`` page (in-flight and queued requests, each summed over its models, the
queue a part of in-flight; a page
that is no frontend's refused), the headers that pin a request (decimal ids), and whether a pinned
answer names every worker it was pinned to (a decode worker's answer: both ids)."""

from __future__ import annotations

import pytest

from dynsnap.controller.frontend import FrontendError, PinnedAnswer, parse_demand, pin_headers
from dynsnap.controller.plan import Demand
from dynsnap.models import protocol as P
from dynsnap.models.ids import InstanceId

# The shape of ai-dynamo 1.6.1's frontend page: HELP/TYPE lines, one series per model, histograms.
PAGE = """\
# HELP dynamo_frontend_inflight_requests Number of inflight requests
# TYPE dynamo_frontend_inflight_requests gauge
dynamo_frontend_inflight_requests{model="tiny"} 3
dynamo_frontend_inflight_requests{model="other"} 2
# HELP dynamo_frontend_queued_requests Number of requests in HTTP processing queue
# TYPE dynamo_frontend_queued_requests gauge
dynamo_frontend_queued_requests{model="tiny"} 2
# HELP dynamo_frontend_requests_total Total number of LLM requests processed
# TYPE dynamo_frontend_requests_total counter
dynamo_frontend_requests_total{endpoint="chat_completions",model="tiny",request_type="unary",status="success"} 917
# HELP dynamo_frontend_request_duration_seconds Duration of LLM requests
# TYPE dynamo_frontend_request_duration_seconds histogram
dynamo_frontend_request_duration_seconds_bucket{model="tiny",le="0.005"} 12
dynamo_frontend_request_duration_seconds_sum{model="tiny"} 81.5
dynamo_frontend_inflight_requests_total{model="tiny"} 999
"""


def test_demand_is_in_flight_over_every_model_its_queue_among_them() -> None:
    d = parse_demand(PAGE)
    assert d == Demand(inflight=5.0, queued=2.0)
    assert d.total == 5.0  # a request before its first token is in both gauges: counted once


def test_a_frontend_that_has_served_nothing_yet_has_no_demand() -> None:
    # The gauges appear once a model has been asked for; the page is still a frontend's.
    page = ("# HELP dynamo_frontend_model_workers Number of workers\n"
            "# TYPE dynamo_frontend_model_workers gauge\n")
    assert parse_demand(page) == Demand(0.0, 0.0)
    assert parse_demand('dynamo_frontend_inflight_requests{model="tiny"} 0\n') == Demand(0.0, 0.0)


@pytest.mark.parametrize("page", ["", "<html>503 Service Unavailable</html>",
                                  "# HELP process_cpu_seconds_total CPU\nprocess_cpu_seconds_total 3.2\n",
                                  'dynamo_component_inflight_requests{worker_id="1f"} 4\n'])
def test_a_page_that_is_no_frontends_is_refused(page: str) -> None:
    with pytest.raises(FrontendError, match="no dynamo_frontend_inflight_requests or "):
        parse_demand(page)


def test_only_the_two_gauges_count_and_bad_lines_are_skipped() -> None:
    page = ('dynamo_frontend_inflight_requests{model="a"} 2 1796000000000\n'  # a timestamp after the value
            "dynamo_frontend_inflight_requests 1\n"  # no labels
            'dynamo_frontend_queued_requests{model="a"} not-a-number\n'
            'dynamo_frontend_inflight_requests_total{model="a"} 50\n'  # another metric sharing the prefix
            'xdynamo_frontend_queued_requests{model="a"} 70\n'
            "\n   \n")
    assert parse_demand(page) == Demand(inflight=3.0, queued=0.0)


def test_pin_headers_are_decimal_and_only_those_asked_for() -> None:
    wid, pid = 7469491169997647, 6571980058719281
    assert pin_headers(worker_id=wid, prefill_id=None) == {P.HEADER_WORKER_INSTANCE_ID: "7469491169997647"}
    assert pin_headers(worker_id=None, prefill_id=pid) == {P.HEADER_PREFILL_INSTANCE_ID: "6571980058719281"}
    assert pin_headers(worker_id=wid, prefill_id=pid) == {P.HEADER_WORKER_INSTANCE_ID: str(wid),
                                                         P.HEADER_PREFILL_INSTANCE_ID: str(pid)}
    assert pin_headers(worker_id=None, prefill_id=None) == {}


W, W2, PF, PF2 = InstanceId(101), InstanceId(102), InstanceId(201), InstanceId(202)


@pytest.mark.parametrize(("answer", "worker_id", "prefill_id", "mine"), [
    # an aggregated worker, pinned with the worker header
    (PinnedAnswer(200, W, None), W, None, True),
    (PinnedAnswer(200, W2, None), W, None, False),
    (PinnedAnswer(200, None, None), W, None, False),  # an answer that names nobody proves nothing
    (PinnedAnswer(504, None, None, "deadline"), W, None, False),
    (PinnedAnswer(400, W, None), W, None, False),  # not answered, whatever it names
    # a prefill worker, pinned with the prefill header only: the decode half is the frontend's choice
    (PinnedAnswer(200, W2, PF), None, PF, True),
    (PinnedAnswer(200, W, PF2), None, PF, False),
    (PinnedAnswer(200, W, None), None, PF, False),
    # a decode worker of a disaggregated graph, pinned with both: both must be named
    (PinnedAnswer(200, W, PF), W, PF, True),
    (PinnedAnswer(200, W, PF2), W, PF, False),
    (PinnedAnswer(200, W2, PF), W, PF, False),
    (PinnedAnswer(200, W, None), W, PF, False),
    (PinnedAnswer(500, W, PF), W, PF, False),
])
def test_a_pinned_answer_is_this_workers_only_when_it_names_every_pinned_id(
        answer: PinnedAnswer, worker_id: int | None, prefill_id: int | None, mine: bool) -> None:
    assert answer.answered_by(worker_id=worker_id, prefill_id=prefill_id) is mine


def test_non_finite_or_negative_gauges_are_not_demand() -> None:
    text = ('dynamo_frontend_inflight_requests{model="a"} NaN\n'
            'dynamo_frontend_inflight_requests{model="b"} +Inf\n'
            'dynamo_frontend_queued_requests{model="a"} -3\n'
            'dynamo_frontend_inflight_requests{model="c"} 2\n')
    d = parse_demand(text)
    assert (d.inflight, d.queued) == (2.0, 0.0)
