"""How `dynsnap demo` explains a failed load request (dynsnap/demo_story.py ``frontend_account``): the
frontend's own log lines that name the request's ``x-request-id`` (the whole id), colour codes stripped,
bounded per request; a request the frontend never logged is said to be missing, not passed over."""

from __future__ import annotations

from dynsnap.demo_story import frontend_account

# Two lines as Dynamo 1.6.1's frontend writes them (kubelet's CRI log prefix, ANSI colours), trimmed.
LOG = "\n".join([
    "2026-12-06T00:03:39.2Z stderr F \x1b[33m WARN\x1b[0m route request failed "
    'request.outcome="worker_disconnected" request_id=dynsnap-demo-burst-3-7 model="tiny"',
    "2026-12-06T00:03:39.3Z stderr F \x1b[31mERROR\x1b[0m http response sent status=503 "
    "request_id=dynsnap-demo-burst-3-7",
    "2026-12-06T00:03:39.4Z stderr F \x1b[32m INFO\x1b[0m http response sent status=200 "
    "request_id=dynsnap-demo-burst-3-70",
])


def test_the_lines_naming_each_failed_request_uncoloured() -> None:
    said = frontend_account(LOG, ["dynsnap-demo-burst-3-7", "dynsnap-demo-burst-1-2"])
    assert len(said) == 2
    first = said[0].splitlines()
    assert first[0] == "dynsnap-demo-burst-3-7: "
    assert 'WARN route request failed request.outcome="worker_disconnected"' in first[1]
    assert "status=503" in first[2] and "\x1b" not in said[0]
    assert len(first) == 3, "the id as a whole: burst-3-70's line is not burst-3-7's"
    assert said[1] == "dynsnap-demo-burst-1-2: not in the frontend's log"


def test_bounded_per_request() -> None:
    said = frontend_account(LOG, ["dynsnap-demo-burst-3-7"], per_request=1)
    assert len(said[0].splitlines()) == 2 and "route request failed" in said[0]
