"""Backoff delays, the failure-rate bound, and Retry-After parsing."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from dynsnap.k8s.backoff import RETRY_AFTER_CAP, Backoff, FailureBudget, parse_retry_after


def test_backoff_doubles_up_to_its_cap_with_bounded_jitter() -> None:
    b = Backoff(base=0.5, cap=8.0, jitter=0.5)
    rng = random.Random(7)
    for n, raw in enumerate([0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0], start=1):
        for _ in range(50):
            assert raw / 2 < b.delay(n, rng=rng) <= raw
    assert b.delay(10_000, rng=rng) <= 8.0  # no overflow far past the cap
    assert Backoff(base=1.0, cap=1.0, jitter=0.0).delay(3) == 1.0


def test_retry_after_is_a_floor_with_a_cap() -> None:
    b = Backoff(base=0.5, cap=8.0)
    assert b.delay(1, retry_after=7.0) == 7.0
    assert b.delay(1, retry_after=0.0) <= 0.5
    assert b.delay(1, retry_after=86_400.0) == RETRY_AFTER_CAP
    assert 4.0 <= Backoff(base=8.0, cap=8.0).delay(1, retry_after=0.1) <= 8.0  # our own backoff when longer


def test_bad_backoff_settings_are_refused() -> None:
    for kwargs in ({"base": 0.0, "cap": 1.0}, {"base": 2.0, "cap": 1.0}, {"base": 1.0, "cap": 2.0, "jitter": 1.0}):
        with pytest.raises(ValueError):
            Backoff(**kwargs)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_budget_gives_up_only_on_a_burst_without_success() -> None:
    clock = Clock()
    budget = FailureBudget(max_failures=3, window=60.0, clock=clock)
    for _ in range(3):
        budget.failure()
        clock.t += 1
    assert not budget.exhausted
    budget.failure()
    assert budget.exhausted and budget.consecutive == 4
    budget.success()
    assert not budget.exhausted and budget.consecutive == 0


def test_budget_never_gives_up_on_rare_failures() -> None:
    clock = Clock()
    budget = FailureBudget(max_failures=3, window=300.0, clock=clock)
    for _ in range(10_000):  # one failure an hour, no success in between, for over a year
        assert budget.failure() == 1
        assert not budget.exhausted
        clock.t += 3600


def test_budget_window_slides() -> None:
    clock = Clock()
    budget = FailureBudget(max_failures=2, window=10.0, clock=clock)
    for t in (0.0, 6.0, 12.0, 18.0):  # never more than two inside any 10 s
        clock.t = t
        budget.failure()
        assert not budget.exhausted
    clock.t = 19.0
    assert budget.failure() == 3 and budget.exhausted


def test_parse_retry_after() -> None:
    now = datetime(2026, 11, 30, 13, 15, 37, tzinfo=UTC)
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("Mon, 30 Nov 2026 13:15:47 GMT", now=now) == 10.0
    assert parse_retry_after("Mon, 30 Nov 2026 13:15:27 GMT", now=now) == 0.0  # a date in the past: now
    for bad in (None, "", "soon", "nan", "inf"):
        assert parse_retry_after(bad) is None
