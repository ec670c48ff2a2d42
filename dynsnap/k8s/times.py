"""Kubernetes time formats (layer: k8s; pure).

``metav1.Time`` is RFC 3339 to the second (``2026-11-30T13:15:37Z``); ``metav1.MicroTime``
(Lease ``acquireTime``/``renewTime``, Event ``eventTime``) carries exactly six fractional digits
(``2026-11-30T13:15:37.123456Z``). Both are written in UTC with a ``Z``; parsing accepts either,
and an explicit offset, so values written by other clients read back.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(?:([Zz])|([+-])(\d{2}):(\d{2}))$"
)


def now() -> datetime:
    return datetime.now(UTC)


def micro_time(when: datetime) -> str:
    """``metav1.MicroTime``: UTC, six fractional digits, ``Z``."""
    return _utc(when).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339(when: datetime) -> str:
    """``metav1.Time``: UTC to the second, ``Z``."""
    return _utc(when).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> datetime:
    """Parse ``Time`` or ``MicroTime`` (any fraction length, ``Z`` or an offset) into an aware UTC datetime."""
    m = _RFC3339.match(value.strip())
    if not m:
        raise ValueError(f"not an RFC 3339 time: {value!r}")
    year, month, day, hour, minute, second, frac, _z, sign, off_h, off_m = m.groups()
    # Go writes up to nine digits (nanoseconds); Python keeps six.
    micro = int((frac or "0")[:6].ljust(6, "0"))
    tz = UTC
    if sign:
        offset = timedelta(hours=int(off_h), minutes=int(off_m))
        tz = timezone(offset if sign == "+" else -offset)
    parsed = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), micro, tzinfo=tz)
    return parsed.astimezone(UTC)


def _utc(when: datetime) -> datetime:
    if when.tzinfo is None:
        raise ValueError("naive datetime: Kubernetes times are absolute; pass an aware datetime")
    return when.astimezone(UTC)
