"""A component's dynsnap policy from ``dynsnap.io/`` annotations (dynsnap/models/policy.py): every
annotation's good values and its bad ones, each refused with the key, the value and why; min-active 0
refused because a model with no live worker answers 404; an unknown ``dynsnap.io/`` key (a typo)
refused rather than ignored; the component's value wins over the DGD's, key by key; a policy with any
problem is no policy at all."""

from __future__ import annotations

import pytest

from dynsnap.models import protocol as P
from dynsnap.models.policy import Policy, Problem, parse_duration, parse_override, parse_policy
from dynsnap.models.protocol import DesiredState, Tier


def test_no_annotations_is_the_default_policy_not_opted_in() -> None:
    parsed = parse_policy({}, {})
    assert parsed.ok and parsed.policy == Policy() and parsed.problems == ()
    assert parsed.policy.enabled is False and parsed.policy.min_active == 1
    assert parsed.policy.tier == Tier.SUSPEND and parsed.policy.on_failed_wake == "restart"


@pytest.mark.parametrize(("key", "value", "field", "want"), [
    (P.ANN_ENABLED, "true", "enabled", True),
    (P.ANN_ENABLED, " FALSE ", "enabled", False),
    (P.ANN_IDLE_AFTER, "90s", "idle_after", 90.0),
    (P.ANN_IDLE_AFTER, "5m", "idle_after", 300.0),
    (P.ANN_IDLE_AFTER, "1h30m", "idle_after", 5400.0),
    (P.ANN_IDLE_AFTER, "250ms", "idle_after", 0.25),
    (P.ANN_IDLE_AFTER, "300", "idle_after", 300.0),
    (P.ANN_IDLE_AFTER, "168h", "idle_after", 7 * 24 * 3600.0),
    (P.ANN_TIER, "snapshot", "tier", Tier.SNAPSHOT),
    (P.ANN_TIER, "suspend", "tier", Tier.SUSPEND),
    (P.ANN_TIER, "engine", "tier", Tier.ENGINE),
    (P.ANN_TIER, "auto", "tier", Tier.AUTO),
    (P.ANN_ENGINE_SLEEP_LEVEL, "1", "engine_sleep_level", 1),
    (P.ANN_ENGINE_SLEEP_LEVEL, "3", "engine_sleep_level", 3),
    (P.ANN_WAKE_ON_REQUEST, "true", "wake_on_request", True),
    (P.ANN_WAKE_ON_REQUEST, "false", "wake_on_request", False),
    (P.ANN_MIN_ACTIVE, "1", "min_active", 1),
    (P.ANN_MIN_ACTIVE, "3", "min_active", 3),
    (P.ANN_VERIFY_REQUESTS, "1", "verify_requests", 1),
    (P.ANN_VERIFY_REQUESTS, "100", "verify_requests", 100),
    (P.ANN_WAKE_AT_INFLIGHT, "2.5", "wake_at_inflight", 2.5),
    (P.ANN_ON_FAILED_WAKE, "none", "on_failed_wake", "none"),
    (P.ANN_ON_FAILED_WAKE, "restart", "on_failed_wake", "restart"),
])
def test_each_annotation_parses_its_good_values(key: str, value: str, field: str, want: object) -> None:
    parsed = parse_policy({key: value}, {})
    assert parsed.ok, parsed.message()
    assert getattr(parsed.policy, field) == want


MIN_ACTIVE_0 = ("must be at least 1: a model with no live worker disappears from the frontend and answers 404 "
                "(0 is allowed with dynsnap.io/wake-on-request: \"true\", tier suspend)")


@pytest.mark.parametrize(("key", "value", "why"), [
    (P.ANN_ENABLED, "yes", "must be true or false"),
    (P.ANN_ENABLED, "", "must be true or false"),
    (P.ANN_IDLE_AFTER, "soon", "not a duration (examples: 90s, 5m, 1h30m)"),
    (P.ANN_IDLE_AFTER, "5 m", "not a duration (examples: 90s, 5m, 1h30m)"),
    (P.ANN_IDLE_AFTER, "-5m", "not a duration (examples: 90s, 5m, 1h30m)"),
    (P.ANN_IDLE_AFTER, "2d", "not a duration (examples: 90s, 5m, 1h30m)"),
    (P.ANN_IDLE_AFTER, "", "not a duration (examples: 90s, 5m, 1h30m)"),
    (P.ANN_IDLE_AFTER, "0s", "must be more than 0 and at most 7 days"),
    (P.ANN_IDLE_AFTER, "0", "must be more than 0 and at most 7 days"),
    (P.ANN_IDLE_AFTER, "169h", "must be more than 0 and at most 7 days"),
    (P.ANN_TIER, "hibernate", "must be one of suspend, snapshot, engine, auto"),
    (P.ANN_TIER, "Snapshot", "must be one of suspend, snapshot, engine, auto"),
    (P.ANN_MIN_ACTIVE, "0", MIN_ACTIVE_0),
    (P.ANN_MIN_ACTIVE, " 0 ", MIN_ACTIVE_0),
    (P.ANN_MIN_ACTIVE, "-1", "not a whole number"),
    (P.ANN_MIN_ACTIVE, "1.5", "not a whole number"),
    (P.ANN_MIN_ACTIVE, "two", "not a whole number"),
    (P.ANN_MIN_ACTIVE, "10001", "must be between 1 and 10000"),
    (P.ANN_VERIFY_REQUESTS, "0", "must be between 1 and 100"),
    (P.ANN_VERIFY_REQUESTS, "101", "must be between 1 and 100"),
    (P.ANN_VERIFY_REQUESTS, "3x", "not a whole number"),
    (P.ANN_WAKE_AT_INFLIGHT, "0", "must be more than 0"),
    (P.ANN_WAKE_AT_INFLIGHT, "-2", "must be more than 0"),
    (P.ANN_WAKE_AT_INFLIGHT, "many", "not a number"),
    (P.ANN_ON_FAILED_WAKE, "delete", "must be restart or none"),
    (P.ANN_ON_FAILED_WAKE, "", "must be restart or none"),
    (P.ANN_ENGINE_SLEEP_LEVEL, "0", "must be between 1 and 3"),
    (P.ANN_ENGINE_SLEEP_LEVEL, "4", "must be between 1 and 3"),
    (P.ANN_ENGINE_SLEEP_LEVEL, "one", "not a whole number"),
    (P.ANN_WAKE_ON_REQUEST, "yes", "must be true or false"),
])
def test_each_bad_value_is_refused_with_key_value_and_why(key: str, value: str, why: str) -> None:
    for dgd, comp in (({key: value}, {}), ({}, {key: value})):  # on the DGD or on the component
        parsed = parse_policy(dgd, comp)
        assert not parsed.ok and parsed.policy is None
        assert parsed.problems == (Problem(key, value, why),)
        assert parsed.message() == f"{key}={value!r}: {why}"


def test_min_active_0_names_the_404_it_would_cause() -> None:
    for off in ({}, {P.ANN_WAKE_ON_REQUEST: "false"}):
        parsed = parse_policy({P.ANN_ENABLED: "true", **off}, {P.ANN_MIN_ACTIVE: "0"})
        assert parsed.policy is None
        assert "answers 404" in parsed.message() and "dynsnap.io/min-active='0'" in parsed.message()


def test_min_active_0_with_wake_on_request_on_tier_suspend() -> None:
    parsed = parse_policy({P.ANN_ENABLED: "true", P.ANN_WAKE_ON_REQUEST: "true"}, {P.ANN_MIN_ACTIVE: "0"})
    assert parsed.policy is not None, parsed.message()
    assert parsed.policy.min_active == 0 and parsed.policy.wake_on_request and parsed.policy.tier == Tier.SUSPEND


@pytest.mark.parametrize(("tier", "why"), [
    ("snapshot", "a dumped worker holds no listener"),
    ("engine", "the engine's sleep unregisters its endpoint, so the model leaves the frontend"),
    ("auto", "auto may pick engine, whose sleep unregisters the endpoint"),
])
def test_wake_on_request_is_refused_with_a_tier_that_cannot_sleep_routable(tier: str, why: str) -> None:
    for where in ("dgd", "component"):
        keys = {P.ANN_WAKE_ON_REQUEST: "true", P.ANN_TIER: tier, P.ANN_MIN_ACTIVE: "0"}
        parsed = parse_policy(keys, {}) if where == "dgd" else parse_policy({}, keys)
        assert parsed.policy is None
        assert parsed.problems == (Problem(P.ANN_WAKE_ON_REQUEST, "true",
                                           f"wake-on-request needs tier suspend: a worker that sleeps routable must "
                                           f"keep its listener and its registration, and tier {tier} does not "
                                           f"({why})"),)


@pytest.mark.parametrize("typo", ["dynsnap.io/min-actve", "dynsnap.io/idle_after", "dynsnap.io/Tier",
                                  "dynsnap.io/enable"])
def test_an_unknown_dynsnap_key_is_refused_not_ignored(typo: str) -> None:
    for dgd, comp in (({typo: "2"}, {}), ({}, {typo: "2"})):
        parsed = parse_policy({P.ANN_ENABLED: "true", **dgd}, comp)
        assert parsed.policy is None
        assert len(parsed.problems) == 1 and parsed.problems[0].key == typo
        assert parsed.problems[0].why.startswith("unknown dynsnap.io/ annotation (known: enabled, idle-after, tier, "
                                                 "min-active, verify-requests, wake-at-inflight, on-failed-wake, "
                                                 "engine-sleep-level, wake-on-request")


def test_keys_that_are_not_policy_are_left_alone() -> None:
    # Other prefixes belong to others; the manual override and the trace context are not policy.
    parsed = parse_policy({"nvidia.com/whatever": "x", "dynsnap.io.other/key": "y", P.ANN_ENABLED: "true"},
                          {P.ANN_DESIRED_STATE: "suspended", P.ANN_TRACEPARENT: "00-ab-cd-01", "app": "z"})
    assert parsed.ok, parsed.message()
    assert parsed.policy == Policy(enabled=True)


def test_the_component_wins_over_the_dgd_key_by_key() -> None:
    dgd = {P.ANN_ENABLED: "true", P.ANN_TIER: "snapshot", P.ANN_MIN_ACTIVE: "2", P.ANN_IDLE_AFTER: "10m"}
    comp = {P.ANN_MIN_ACTIVE: "3", P.ANN_ON_FAILED_WAKE: "none"}
    parsed = parse_policy(dgd, comp)
    assert parsed.policy == Policy(enabled=True, tier=Tier.SNAPSHOT, min_active=3, idle_after=600.0,
                                   on_failed_wake="none")
    # The component may opt itself out of a graph that opted in.
    assert parse_policy(dgd, {P.ANN_ENABLED: "false"}).policy == Policy(
        enabled=False, tier=Tier.SNAPSHOT, min_active=2, idle_after=600.0)
    # A bad value on the DGD that the component overrides is not in effect: no problem.
    assert parse_policy({P.ANN_MIN_ACTIVE: "0"}, {P.ANN_MIN_ACTIVE: "1"}).ok
    # A bad value on the component is one, whatever the DGD says.
    assert parse_policy({P.ANN_MIN_ACTIVE: "1"}, {P.ANN_MIN_ACTIVE: "0"}).problems == (
        Problem(P.ANN_MIN_ACTIVE, "0", MIN_ACTIVE_0),)


def test_every_problem_is_reported_at_once() -> None:
    parsed = parse_policy({P.ANN_TIER: "deep", "dynsnap.io/nope": "1"}, {P.ANN_VERIFY_REQUESTS: "0"})
    assert parsed.policy is None
    assert [p.key for p in parsed.problems] == [P.ANN_TIER, P.ANN_VERIFY_REQUESTS, "dynsnap.io/nope"]
    assert parsed.message().count("; ") == 2


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("5m", 300), ("1h", 3600), ("1h30m", 5400),
                                               ("1m30s", 90), ("1.5h", 5400), ("250ms", 0.25), ("2m500ms", 120.5),
                                               ("300", 300), ("0.5", 0.5), (" 45s ", 45)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "m", "5x", "5 m", "5m5h", "ms", "1d", "-1s", "1e3"])
def test_not_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(("value", "want", "problem"), [
    (None, None, None), ("suspended", DesiredState.SUSPENDED.value, None),
    (" Active ", DesiredState.ACTIVE.value, None),
    ("asleep", None, "dynsnap.io/desired-state='asleep': must be suspended or active"),
])
def test_the_manual_override(value: str | None, want: str | None, problem: str | None) -> None:
    assert parse_override(value) == (want, problem)
