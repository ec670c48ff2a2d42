"""dynsnap-cuda's GPU map against the stub libcuda: every accepted spelling reaches the driver
as the right (old, new) pairs in the given order, and every bad map is refused before any
process changes state.

Pairs are read back from what the stub's cuCheckpointProcessRestore received, so a map that
parses but is transposed (it would migrate onto the wrong device) fails here.
"""

from __future__ import annotations

import pytest
from cuda_harness import (
    CHECKPOINTED,
    LOCKED,
    RUNNING,
    Stub,
    hexid,
)

GIB = 1 << 30
U0 = "GPU-28fd6b9c-4fb2-cd33-0776-4018cd000d99"
U1 = "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
FOREIGN_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"  # GPUs of another node: sources only
FOREIGN_B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"


def bare(u: str) -> str:
    return u.removeprefix("GPU-").replace("-", "")


@pytest.fixture
def two_gpus(stub: Stub) -> Stub:
    stub.set_devices((U0, 40 * GIB, 80 * GIB), (U1, 40 * GIB, 80 * GIB))
    stub.set_state(CHECKPOINTED, 5)
    return stub


def pairs_of(stub: Stub) -> list[tuple[str, str]]:
    (call,) = [c for c in stub.calls() if c.fn == "restore"]
    assert call.pairs is not None
    return call.pairs


@pytest.mark.parametrize("spec,expected", [
    ("0=1,1=0", [(U0, U1), (U1, U0)]),
    ("0=0,1=1", [(U0, U0), (U1, U1)]),
    ("1=1,0=0", [(U1, U1), (U0, U0)]),
    (f"{U0}={U1},{U1}={U0}", [(U0, U1), (U1, U0)]),
    (f"{bare(U0)}={bare(U1)},{bare(U1)}={bare(U0)}", [(U0, U1), (U1, U0)]),
    (f"{U0.upper()}={U1.upper()},{U1}={U0}", [(U0, U1), (U1, U0)]),
    (f"gpu-{bare(U0).upper()}=1,{U1[4:]}=0", [(U0, U1), (U1, U0)]),
    (f"0={bare(U1)}, {U1} = 0", [(U0, U1), (U1, U0)]),
    (f"{FOREIGN_A}=0,{FOREIGN_B}=1", [(FOREIGN_A, U0), (FOREIGN_B, U1)]),
    (f"{FOREIGN_A}=1,{FOREIGN_B}=0", [(FOREIGN_A, U1), (FOREIGN_B, U0)]),
])
def test_accepted_maps_reach_the_driver_as_pairs_in_order(two_gpus: Stub, spec: str,
                                                          expected: list[tuple[str, str]]) -> None:
    r = two_gpus.run("--action", "restore", "--pid", "5", "--gpu-map", spec)
    assert r.rc == 0, r.err
    assert pairs_of(two_gpus) == [(hexid(a), hexid(b)) for a, b in expected]
    assert two_gpus.state(5) == LOCKED


def test_device_map_is_the_same_option(two_gpus: Stub) -> None:
    r = two_gpus.run("--action", "restore", "--pid", "5", "--device-map", "0=1,1=0")
    assert r.rc == 0
    assert pairs_of(two_gpus) == [(hexid(U0), hexid(U1)), (hexid(U1), hexid(U0))]


def test_indices_resolve_against_this_enumeration(stub: Stub) -> None:
    """Index 0 is whatever this process enumerates first, not a fixed device."""
    stub.set_devices((U1, 40 * GIB, 80 * GIB), (U0, 40 * GIB, 80 * GIB))
    stub.set_state(CHECKPOINTED, 5)
    assert stub.run("--action", "restore", "--pid", "5", "--gpu-map", "0=1,1=0").rc == 0
    assert pairs_of(stub) == [(hexid(U1), hexid(U0)), (hexid(U0), hexid(U1))]


def test_no_map_passes_no_pairs(two_gpus: Stub) -> None:
    assert two_gpus.run("--action", "restore", "--pid", "5").rc == 0
    (call,) = two_gpus.calls()
    assert call.pairs is None


def test_resume_passes_the_map_to_every_restore(two_gpus: Stub) -> None:
    two_gpus.set_state(CHECKPOINTED, 6)
    r = two_gpus.run("--action", "resume", "--pid", "5,6", "--gpu-map", "0=1,1=0")
    assert r.rc == 0
    restores = [c for c in two_gpus.calls() if c.fn == "restore"]
    assert sorted(c.pid for c in restores) == [5, 6]
    assert all(c.pairs == [(hexid(U0), hexid(U1)), (hexid(U1), hexid(U0))] for c in restores)
    assert two_gpus.state(5) == RUNNING and two_gpus.state(6) == RUNNING


@pytest.mark.parametrize("spec,reason", [
    ("0=1", "must cover every visible GPU"),                       # miscounted: short
    ("0=0,1=1,2=0", "GPU index 2 does not exist"),                 # index past the end
    (f"0=0,1=1,{FOREIGN_A}=0", "used twice"),                      # miscounted: long
    ("0=1,1=1", "used twice"),                                     # duplicate target
    (f"0=1,{U0}=0", "mapped twice"),                               # duplicate source
    (f"0={FOREIGN_A},1=0", "not a visible GPU"),                   # target does not exist
    ("0=5,1=0", "GPU index 5 does not exist"),
    ("0=zz,1=0", "neither a GPU index nor a GPU UUID"),            # malformed side
    (f"0={bare(U1)[:-1]},1=0", "neither a GPU index nor a GPU UUID"),   # 31 hex digits
    (f"0={bare(U1)}0,1=0", "neither a GPU index nor a GPU UUID"),       # 33 hex digits
    ("0=1=0,1=0", "not OLD=NEW"),
    ("01,1=0", "not OLD=NEW"),
    ("", "must cover every visible GPU"),
    ("0=,1=0", "neither a GPU index nor a GPU UUID"),
    # an empty item is refused like an empty --pid item, not folded away: a pair was lost on its way
    ("0=1,,1=0", "item 2 of the map is empty"),
    ("0=1,1=0,", "item 3 of the map is empty"),                    # trailing comma
    (",0=1,1=0", "item 1 of the map is empty"),                    # leading comma
    ("0=1, ,1=0", "item 2 of the map is empty"),                   # blank item
    (",", "item 1 of the map is empty"),
])
def test_bad_maps_are_refused_before_any_state_change(two_gpus: Stub, spec: str, reason: str) -> None:
    two_gpus.set_state(CHECKPOINTED, 6)
    for action in ("restore", "resume"):
        r = two_gpus.run("--action", action, "--pid", "5,6", "--gpu-map", spec)
        assert r.rc == 2, (action, r.err)
        assert reason in r.err and len(r.err.splitlines()) == 1
    assert two_gpus.calls() == []
    assert two_gpus.state(5) == CHECKPOINTED and two_gpus.state(6) == CHECKPOINTED


def test_single_gpu_map_must_name_the_one_gpu(stub: Stub) -> None:
    stub.set_devices((U0, 40 * GIB, 80 * GIB))
    stub.set_state(CHECKPOINTED, 5)
    assert stub.run("--action", "resume", "--pid", "5", "--gpu-map", "0=1").rc == 2
    assert stub.run("--action", "resume", "--pid", "5", "--gpu-map", f"0={U1}").rc == 2
    assert stub.calls() == []
    assert stub.run("--action", "resume", "--pid", "5", "--gpu-map", f"{bare(U0)}=0").rc == 0
    assert pairs_of(stub) == [(hexid(U0), hexid(U0))]


@pytest.mark.parametrize("action", ["lock", "checkpoint", "save"])
def test_map_is_ignored_with_a_diagnostic_on_capture(stub: Stub, action: str) -> None:
    if action == "checkpoint":
        stub.set_state(LOCKED, 5)
    r = stub.run("--action", action, "--pid", "5", "--gpu-map", "not-even-a-map")
    assert r.rc == 0
    assert "--gpu-map ignored" in r.err
    assert all(c.pairs is None for c in stub.calls())


def test_map_needs_device_enumeration(two_gpus: Stub) -> None:
    two_gpus.control("fail cuDeviceGetCount * 3")
    r = two_gpus.run("--action", "resume", "--pid", "5", "--gpu-map", "0=0,1=1")
    assert r.rc == 2 and "enumerate" in r.err and two_gpus.calls() == []


def test_remapped_restore_checks_memory_on_the_target(two_gpus: Stub) -> None:
    """The free-memory check follows the map: the memory is needed where the process lands."""
    two_gpus.set_state(RUNNING, 5)
    two_gpus.set_devices((U0, 40 * GIB, 80 * GIB), (U1, 2 * GIB, 80 * GIB))
    two_gpus.control(f"mem 5 0 {8 * GIB}")
    assert two_gpus.run("--action", "save", "--pid", "5").rc == 0
    r = two_gpus.run("--action", "resume", "--pid", "5", "--gpu-map", "0=1,1=0")
    assert r.rc == 3 and U1 in r.err
    assert two_gpus.state(5) == CHECKPOINTED
    r = two_gpus.run("--action", "resume", "--pid", "5", "--gpu-map", "0=0,1=1")
    assert r.rc == 0 and two_gpus.state(5) == RUNNING
