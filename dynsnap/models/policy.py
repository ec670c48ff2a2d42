"""A component's dynsnap policy, parsed from ``dynsnap.io/`` annotations on the DGD and on the
component (component wins, key by key) into a validated model. Pure (bottom layer).

A value that does not parse is never guessed at: :func:`parse_policy` returns every problem,
named by key, value and why, and the controller then changes nothing for that component (an
Event and a ``PolicyValid=False`` condition say what to fix). An unknown ``dynsnap.io/`` key is a
problem too: a typo (``dynsnap.io/min-actve``) would otherwise be silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from dynsnap.models import protocol as P
from dynsnap.models.protocol import Tier

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+)ms)?$")
_TRUE = {"true": True, "false": False}
# Keys on a worker pod that are not policy (the manual override) and keys the controller itself sets.
_NOT_POLICY = {P.ANN_DESIRED_STATE, P.ANN_TRACEPARENT}

MAX_VERIFY_REQUESTS = 100
MAX_IDLE_AFTER = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Policy:
    """What one component's annotations ask for (defaults: DESIGN.md section 1)."""

    enabled: bool = False
    idle_after: float = 300.0  # seconds of no traffic before a worker may be captured
    tier: Tier = Tier.SUSPEND
    min_active: int = 1  # never fewer awake workers (a model with none disappears from the frontend: 404)
    verify_requests: int = 3
    wake_at_inflight: float = 4.0  # demand per awake worker above which one more is woken
    on_failed_wake: Literal["restart", "none"] = "restart"
    engine_sleep_level: int = 1  # tier engine: vLLM's level 1 (weights to host, KV cache dropped)
    # min-active 0: the last worker sleeps routable (tier suspend: its listener stays), woken by a request
    wake_on_request: bool = False


@dataclass(frozen=True)
class Problem:
    key: str
    value: str
    why: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.why}"


@dataclass(frozen=True)
class ParsedPolicy:
    policy: Policy | None  # None when any problem was found: nothing is done for the component
    problems: tuple[Problem, ...] = ()

    @property
    def ok(self) -> bool:
        return self.policy is not None

    def message(self) -> str:
        return "; ".join(str(p) for p in self.problems)


def parse_duration(text: str) -> float:
    """Seconds in ``text``: Go-style ``90s``, ``5m``, ``1h30m``, ``250ms``, or plain seconds (``300``)."""
    t = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    m = _DURATION.match(t)
    if not t or m is None or not any(m.groups()):
        raise ValueError("not a duration (examples: 90s, 5m, 1h30m)")
    h, mi, s, ms = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s + ms / 1000


def _int(text: str, lo: int, hi: int) -> int:
    if not re.fullmatch(r"\d+", text.strip()):
        raise ValueError("not a whole number")
    v = int(text)
    if not lo <= v <= hi:
        raise ValueError(f"must be between {lo} and {hi}")
    return v


def merged_annotations(dgd: Mapping[str, str], component: Mapping[str, str]) -> dict[str, str]:
    """The dynsnap.io/ policy keys in effect: the DGD's, overridden key by key by the component's."""
    out = {k: v for k, v in dgd.items() if k.startswith(P.ANNOTATION_PREFIX) and k not in _NOT_POLICY}
    out.update({k: v for k, v in component.items() if k.startswith(P.ANNOTATION_PREFIX) and k not in _NOT_POLICY})
    return out


def parse_policy(dgd: Mapping[str, str], component: Mapping[str, str]) -> ParsedPolicy:
    """The component's policy, or every problem with its annotations."""
    ann = merged_annotations(dgd, component)
    problems: list[Problem] = []
    fields: dict[str, object] = {}

    def take(key: str, name: str, conv: object) -> None:
        if key not in ann:
            return
        try:
            fields[name] = conv(ann[key])  # type: ignore[operator]
        except ValueError as e:
            problems.append(Problem(key, ann[key], str(e)))

    def enabled(v: str) -> bool:
        if v.strip().lower() not in _TRUE:
            raise ValueError("must be true or false")
        return _TRUE[v.strip().lower()]

    def idle_after(v: str) -> float:
        s = parse_duration(v)
        if not 0 < s <= MAX_IDLE_AFTER:
            raise ValueError("must be more than 0 and at most 7 days")
        return s

    def tier(v: str) -> Tier:
        try:
            return Tier(v.strip())
        except ValueError:
            raise ValueError(f"must be one of {', '.join(t.value for t in Tier)}") from None

    def min_active(v: str) -> int:
        if v.strip() == "0":
            return 0  # allowed only with wake-on-request (checked with the other keys below)
        return _int(v, 1, 10_000)

    def wake_at(v: str) -> float:
        try:
            f = float(v)
        except ValueError:
            raise ValueError("not a number") from None
        if not 0 < f <= 1e6:
            raise ValueError("must be more than 0")
        return f

    def on_failed(v: str) -> str:
        if v.strip() not in ("restart", "none"):
            raise ValueError("must be restart or none")
        return v.strip()

    take(P.ANN_ENABLED, "enabled", enabled)
    take(P.ANN_IDLE_AFTER, "idle_after", idle_after)
    take(P.ANN_TIER, "tier", tier)
    take(P.ANN_MIN_ACTIVE, "min_active", min_active)
    take(P.ANN_VERIFY_REQUESTS, "verify_requests", lambda v: _int(v, 1, MAX_VERIFY_REQUESTS))
    take(P.ANN_WAKE_AT_INFLIGHT, "wake_at_inflight", wake_at)
    take(P.ANN_ON_FAILED_WAKE, "on_failed_wake", on_failed)
    take(P.ANN_ENGINE_SLEEP_LEVEL, "engine_sleep_level", lambda v: _int(v, 1, 3))
    take(P.ANN_WAKE_ON_REQUEST, "wake_on_request", enabled)
    problems += _combination_problems(ann, fields)
    known = ", ".join(k.removeprefix(P.ANNOTATION_PREFIX) for k in P.POLICY_ANNOTATIONS)
    for key in sorted(set(ann) - set(P.POLICY_ANNOTATIONS)):
        problems.append(Problem(key, ann[key], f"unknown dynsnap.io/ annotation (known: {known})"))
    if problems:
        return ParsedPolicy(None, tuple(problems))
    return ParsedPolicy(Policy(**fields))  # type: ignore[arg-type]


MIN_ACTIVE_0 = ("must be at least 1: a model with no live worker disappears from the frontend and answers 404 "
                f"(0 is allowed with {P.ANN_WAKE_ON_REQUEST}: \"true\", tier suspend)")
ROUTABLE_TIER = ("wake-on-request needs tier suspend: a worker that sleeps routable must keep its listener "
                 "and its registration, and {tier} does not ({why})")
_NOT_ROUTABLE = {Tier.SNAPSHOT: "a dumped worker holds no listener",
                 Tier.ENGINE: "the engine's sleep unregisters its endpoint, so the model leaves the frontend",
                 Tier.AUTO: "auto may pick engine, whose sleep unregisters the endpoint"}


def _combination_problems(ann: Mapping[str, str], fields: Mapping[str, object]) -> list[Problem]:
    """What the keys cannot mean together: min-active 0 without wake-on-request (the model would go from
    the frontend), wake-on-request with a tier whose sleeping worker cannot be reached."""
    out: list[Problem] = []
    routable = fields.get("wake_on_request") is True
    if fields.get("min_active") == 0 and not routable:
        out.append(Problem(P.ANN_MIN_ACTIVE, ann[P.ANN_MIN_ACTIVE], MIN_ACTIVE_0))
    tier = fields.get("tier", Tier.SUSPEND)
    if routable and isinstance(tier, Tier) and tier in _NOT_ROUTABLE:
        out.append(Problem(P.ANN_WAKE_ON_REQUEST, ann[P.ANN_WAKE_ON_REQUEST],
                           ROUTABLE_TIER.format(tier=f"tier {tier.value}", why=_NOT_ROUTABLE[tier])))
    return out


def parse_override(value: str | None, *, key: str = P.ANN_DESIRED_STATE) -> tuple[str | None, str | None]:
    """A manual override's value (``key``: where it was read): (``"Suspended"``/``"Active"``/None, problem or
    None); either case."""
    if value is None:
        return None, None
    v = value.strip().lower()
    if v == "suspended":
        return P.DesiredState.SUSPENDED.value, None
    if v == "active":
        return P.DesiredState.ACTIVE.value, None
    return None, f"{key}={value!r}: must be suspended or active"
