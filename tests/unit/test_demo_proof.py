"""What `dynsnap demo` takes as the proof that a sleeper came back (dynsnap/demo_story.py ``proof_of_wake``):
the controller's passed verification of its last wake, or of a recall that started after that wake
(a quiesce called off: the controller proves the return again and that record replaces the wake's,
which a demo run in CI met on 2026-12-01 and waited out). Never a failed one, nor one from before."""

from __future__ import annotations

from typing import Any

import pytest

from dynsnap.demo_story import proof_of_wake as _proof_of_wake

WAKE = {"id": "w1764571502000", "started": "2026-12-01T06:45:02Z", "finished": "2026-12-01T06:45:02.300000Z"}


def _ws(wake_id: str, ok: bool | None, started: str, wake: dict[str, Any] | None = WAKE) -> dict[str, Any]:
    v = {"wakeId": wake_id, "ok": ok, "started": started, "answered": 3, "requests": 3}
    return {"metadata": {"name": "w-0"}, "status": {"lastWake": wake, "controller": {"verification": v}}}


@pytest.mark.parametrize(("ws", "proven"), [
    (_ws(WAKE["id"], True, "2026-12-01T06:45:02.400000Z"), True),  # the wake itself
    (_ws("recall-q1764571502800", True, "2026-12-01T06:45:02.900000Z"), True),  # a recall after it
    (_ws("recall-q1764571400000", True, "2026-12-01T06:43:20Z"), False),  # a recall before the wake
    (_ws(WAKE["id"], False, "2026-12-01T06:45:02.400000Z"), False),  # failed
    (_ws(WAKE["id"], None, "2026-12-01T06:45:02.400000Z"), False),  # still verifying
    (_ws("w1764571000000", True, "2026-12-01T06:36:40Z"), False),  # an earlier wake's
    (_ws(WAKE["id"], True, "2026-12-01T06:45:02.400000Z", wake={**WAKE, "finished": None}), False),
], ids=["wake", "recall-after", "recall-before", "failed", "verifying", "earlier-wake", "wake-unfinished"])
def test_a_sleeper_is_proven_by_its_wakes_verification_or_a_later_recalls(ws: dict[str, Any], proven: bool) -> None:
    got = _proof_of_wake(ws)
    assert (got is not None) == proven
    if proven:
        assert got == ws["status"]["controller"]["verification"]
