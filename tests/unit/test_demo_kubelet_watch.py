"""What `dynsnap demo` takes as kubelet's word that a sleeper left serving only through its gate
(dynsnap/demo_story.py ``KubeletWatch.through_gate``): over the (serving gate, Ready) states kubelet
reported, repeats dropped, the pod not Ready after it first was only while its gate was False or
just after (the probe's lag on the way back), and Ready again after it was not. A probe failing while
the gate was True, a pod never Ready, or one never back, is not. The watch begins as the pods start
(before the controller lets them serve): what it saw before a first Ready is not held against them."""

from __future__ import annotations

import pytest

from dynsnap.demo_story import KubeletWatch


def _watch(states: list[tuple[str, bool]]) -> KubeletWatch:
    w = KubeletWatch(api=None, pods={"w-0": "ns"})  # type: ignore[arg-type]  # through_gate reads no API
    w.states["w-0"] = states
    return w


@pytest.mark.parametrize(("states", "held"), [
    ([("True", True), ("False", True), ("False", False), ("True", False), ("True", True)], True),
    ([("True", True), ("False", False), ("True", True)], True),  # every step between two looks
    ([("False", True), ("False", False), ("True", True)], True),  # first look after the gate went False
    ([("True", True), ("True", False), ("False", False), ("True", True)], False),  # a probe before the gate
    ([("True", True), ("False", False), ("True", True), ("True", False), ("True", True)], False),  # later
    ([("True", True), ("False", False)], False),  # never back
    ([("True", True), ("False", False), ("True", True), ("False", False)], True),  # back, then asleep again
    ([("False", False), ("True", False)], False),  # never Ready
    ([("True", True)], False),  # never left, so never back
    ([("Unset", False), ("True", False), ("True", True), ("False", False), ("True", True)], True),  # from its start
    ([("Unset", False), ("True", False), ("True", True), ("True", False), ("True", True)], False),
], ids=["the-way", "fast", "first-look-late", "probe-first", "probe-later", "left-out", "again", "never-ready",
        "awake", "from-start", "from-start-probe"])
def test_out_of_serving_only_through_the_gate(states: list[tuple[str, bool]], held: bool) -> None:
    assert _watch(states).through_gate("w-0") is held


def test_the_states_since_the_first_ready_look() -> None:
    w = _watch([("Unset", False), ("True", False), ("True", True), ("False", False), ("True", True)])
    assert w.since_ready("w-0") == [("True", True), ("False", False), ("True", True)]
    assert _watch([("Unset", False), ("True", False)]).since_ready("w-0") == []
