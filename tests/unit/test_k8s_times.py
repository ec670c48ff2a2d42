"""Kubernetes Time and MicroTime formatting and parsing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from dynsnap.k8s.times import micro_time, parse_time, rfc3339


def test_micro_time_has_six_digits_and_z() -> None:
    when = datetime(2026, 11, 30, 13, 15, 37, 123456, tzinfo=UTC)
    assert micro_time(when) == "2026-11-30T13:15:37.123456Z"
    assert micro_time(when.replace(microsecond=0)) == "2026-11-30T13:15:37.000000Z"
    assert rfc3339(when) == "2026-11-30T13:15:37Z"
    # Another zone is written as UTC.
    plus2 = timezone(timedelta(hours=2))
    assert micro_time(datetime(2026, 11, 30, 15, 15, 37, 5, tzinfo=plus2)) == "2026-11-30T13:15:37.000005Z"


def test_naive_datetimes_are_refused() -> None:
    with pytest.raises(ValueError):
        micro_time(datetime(2026, 11, 30, 13, 15, 37))  # naive: the point of the test


def test_parse_round_trips_and_accepts_what_go_writes() -> None:
    when = datetime(2026, 11, 30, 13, 15, 37, 123456, tzinfo=UTC)
    assert parse_time(micro_time(when)) == when
    assert parse_time("2026-11-30T13:15:37Z") == when.replace(microsecond=0)
    assert parse_time("2026-11-30T13:15:37.123456789Z") == when  # nanoseconds: truncated
    assert parse_time("2026-11-30T13:15:37.1Z").microsecond == 100000
    assert parse_time("2026-11-30T15:15:37.123456+02:00") == when
    assert parse_time("2026-11-30T08:15:37.123456-05:00") == when
    for bad in ("2026-11-30 13:15:37", "2026-11-30T13:15:37", "yesterday"):
        with pytest.raises(ValueError):
            parse_time(bad)
