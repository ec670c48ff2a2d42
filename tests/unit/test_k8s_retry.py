"""The retry policy: what is retried, Retry-After, caps on attempts and time, the instant switch."""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import aiohttp
import pytest

from dynsnap.k8s import retry
from dynsnap.k8s.backoff import Backoff
from dynsnap.k8s.errors import ApiError, Conflict, RetryExhausted, TooManyRequests, error_for


@pytest.fixture
def events() -> Iterator[list[retry.RetryEvent]]:
    seen: list[retry.RetryEvent] = []
    retry.set_instant(True)
    retry.add_hook(seen.append)
    yield seen
    retry.remove_hook(seen.append)
    retry.set_instant(None)


def _api(status: int, *, retry_after: str | None = None, body: str = "") -> ApiError:
    return error_for(status, body, method="GET", path="/x", headers={"Retry-After": retry_after} if retry_after else {})


def test_classification() -> None:
    conn_key = aiohttp.client_reqrep.ConnectionKey("h", 1, True, True, None, None, None, None)
    retried: list[BaseException] = [_api(429), _api(500), _api(502), _api(503), _api(504), _api(599),
               aiohttp.ServerDisconnectedError(), aiohttp.ClientOSError(104, "reset"),
               aiohttp.ClientConnectorError(conn_key, ConnectionRefusedError(111, "refused")),
               aiohttp.ClientPayloadError("cut"), aiohttp.SocketTimeoutError(), ConnectionResetError(),
               TimeoutError()]
    never: list[BaseException] = [*(_api(s) for s in (400, 401, 403, 404, 409, 410, 422, 501)),
             aiohttp.ClientConnectorCertificateError(conn_key, ssl.SSLCertVerificationError("bad")),
             ValueError("bug"), KeyError("bug"), FileNotFoundError()]
    assert [e for e in retried if not retry.is_retryable(e)] == []
    assert [e for e in never if retry.is_retryable(e)] == []


def test_api_error_carries_retry_after_from_header_or_status_details() -> None:
    assert isinstance(_api(429, retry_after="3"), TooManyRequests)
    assert _api(429, retry_after="3").retry_after == 3.0
    body = '{"kind":"Status","reason":"TooManyRequests","message":"slow down","details":{"retryAfterSeconds":5}}'
    err = _api(429, body=body)
    assert err.retry_after == 5.0 and err.reason == "TooManyRequests" and err.message == "slow down"
    assert _api(429, retry_after="1", body=body).retry_after == 1.0  # the header wins
    assert _api(503).retry_after is None


async def test_transient_failures_then_success(events: list[retry.RetryEvent]) -> None:
    failures = [_api(503), _api(429, retry_after="4"), aiohttp.ServerDisconnectedError()]

    async def call() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    policy = retry.RetryPolicy("unit", attempts=5, timeout=60.0, backoff=Backoff(base=0.1, cap=1.0))
    assert await policy.call("GET /x", call) == "ok"
    assert [(e.policy, e.what, e.attempt) for e in events] == [("unit", "GET /x", n) for n in (1, 2, 3)]
    assert events[1].delay == 4.0  # the server's Retry-After
    assert events[0].delay <= 0.1 and events[2].delay <= 0.4


async def test_non_retryable_errors_pass_through_at_once(events: list[retry.RetryEvent]) -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise error_for(409, "", method="PUT", path="/x")

    with pytest.raises(Conflict):
        await retry.DEFAULT.call("PUT /x", call)
    assert calls == 1 and events == []


async def test_gives_up_after_its_attempts_with_a_named_error(events: list[retry.RetryEvent]) -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise _api(503)

    policy = retry.RetryPolicy("unit-attempts", attempts=3, timeout=600.0)
    with pytest.raises(RetryExhausted) as err:
        await policy.call("GET /x", call)
    assert calls == 3 and err.value.attempts == 3 and err.value.policy == "unit-attempts"
    assert isinstance(err.value.__cause__, ApiError) and "unit-attempts" in str(err.value)
    assert [e.gave_up for e in events] == [False, False, True]


async def test_gives_up_when_the_next_wait_would_pass_the_time_cap(events: list[retry.RetryEvent]) -> None:
    # Retry-After 20 s twice fits a 50 s budget; a third 20 s would end past it, so it stops there,
    # in instant mode exactly as it would in real time (skipped sleeps count against the cap).
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise _api(429, retry_after="20")

    policy = retry.RetryPolicy("unit-time", attempts=100, timeout=50.0)
    with pytest.raises(RetryExhausted) as err:
        await policy.call("GET /x", call)
    assert calls == 3 and err.value.attempts == 3
    assert [e.delay for e in events if not e.gave_up] == [20.0, 20.0]


async def test_instant_switch_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    retry.set_instant(None)
    monkeypatch.delenv(retry.INSTANT_ENV, raising=False)
    assert not retry.is_instant()
    monkeypatch.setenv(retry.INSTANT_ENV, "1")
    assert retry.is_instant()
    assert await retry.sleep(3600.0) == 3600.0  # skipped, and said so
    retry.set_instant(False)
    assert not retry.is_instant()  # the explicit switch beats the environment
    assert await retry.sleep(0.0) == 0.0
    retry.set_instant(None)


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError):
        retry.RetryPolicy("x", attempts=0)
    with pytest.raises(ValueError):
        retry.RetryPolicy("x", timeout=0)
