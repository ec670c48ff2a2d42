"""dynsnap-cuda against the stub libcuda: CRIU-plugin compatibility, save/resume ordering and
rollback, pid parsing, the free-memory check and the JSON result.

The ordering assertions are the load-bearing ones: an interleaved lock+checkpoint still passes
on every single-process workload and only shows as a hang with several ranks, so it is checked
here on the recorded call order (docs/NATIVE.md lists the mutations that turn these red).
"""

from __future__ import annotations

import pytest
from cuda_harness import (
    CHECKPOINTED,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_OUT_OF_MEMORY,
    FAILED,
    LOCKED,
    RUNNING,
    STATE_WORDS,
    Stub,
)

GIB = 1 << 30
MODES = [pytest.param([], id="parallel"), pytest.param(["--serial"], id="serial")]


# ---- drop-in for CRIU's CUDA plugin ----


@pytest.mark.parametrize("name", ["dynsnap-cuda", "cuda-checkpoint"])
def test_help_lists_action_under_both_names(stub: Stub, name: str) -> None:
    r = stub.run("-h", name=name)
    assert r.rc == 0
    assert "--action" in r.out and "--get-state" in r.out and "--get-restore-tid" in r.out


@pytest.mark.parametrize("state", [RUNNING, LOCKED, CHECKPOINTED, FAILED])
def test_get_state_prints_the_bare_word_for_one_pid(stub: Stub, state: int) -> None:
    stub.set_state(state, 42)
    r = stub.run("--get-state", "--pid", "42", name="cuda-checkpoint")
    assert (r.rc, r.out, r.err) == (0, STATE_WORDS[state] + "\n", "")


def test_get_restore_tid_prints_the_tid(stub: Stub) -> None:
    r = stub.run("--get-restore-tid", "--pid", "42", name="cuda-checkpoint")
    assert (r.rc, r.out, r.err) == (0, "1042\n", "")


def test_get_state_of_a_process_without_cuda_fails_with_one_line(stub: Stub) -> None:
    stub.control("nocuda 42")
    for flag in ("--get-state", "--get-restore-tid"):
        r = stub.run(flag, "--pid", "42", name="cuda-checkpoint")
        assert r.rc != 0 and r.out == ""
        assert len(r.err.splitlines()) == 1 and "42" in r.err and "CUDA_ERROR_NOT_FOUND" in r.err


def test_several_pids_print_pid_and_state(stub: Stub) -> None:
    stub.set_state(LOCKED, 6)
    r = stub.run("--get-state", "--pid", "5,6", "--pid", "7")
    assert (r.rc, r.out) == (0, "5 running\n6 locked\n7 running\n")


def test_single_pid_plugin_sequence(stub: Stub) -> None:
    """The four calls CRIU's plugin makes, one exec each: silent on success, state follows."""
    for action, after in [("lock", LOCKED), ("checkpoint", CHECKPOINTED), ("restore", LOCKED),
                          ("unlock", RUNNING)]:
        args = ["--action", action, "--pid", "42"] + (["--timeout", "5000"] if action == "lock" else [])
        r = stub.run(*args, name="cuda-checkpoint")
        assert (r.rc, r.out, r.err) == (0, "", ""), action
        assert stub.state(42) == after
    assert stub.ops() == [("lock", 42), ("checkpoint", 42), ("restore", 42), ("unlock", 42)]
    assert stub.calls()[0].timeout == 5000


@pytest.mark.parametrize("spelling", [["--pid", "42"], ["-p", "42"], ["--pid", "42", "--serial"]])
def test_single_pid_failure_is_the_same_whatever_the_spelling(stub: Stub, spelling: list[str]) -> None:
    stub.control(f"fail cuCheckpointProcessLock 42 {CUDA_ERROR_OUT_OF_MEMORY}")
    r = stub.run("--action", "lock", *spelling, name="cuda-checkpoint")
    assert (r.rc, r.out) == (1, "")
    assert r.err == "cuda-checkpoint: lock pid 42: lock failed: CUDA_ERROR_OUT_OF_MEMORY (2)\n"
    assert stub.state(42) == RUNNING


def test_wrong_state_is_the_drivers_error_not_a_crash(stub: Stub) -> None:
    r = stub.run("--action", "checkpoint", "--pid", "42")
    assert r.rc == 1 and "CUDA_ERROR_ILLEGAL_STATE" in r.err and len(r.err.splitlines()) == 1


def test_missing_libcuda_exits_4(stub: Stub) -> None:
    stub.env["DYNSNAP_LIBCUDA"] = "/nonexistent/libcuda.so.1"
    r = stub.run("--get-state", "--pid", "42")
    assert r.rc == 4 and "cannot load" in r.err


# ---- save: every lock before any checkpoint ----


@pytest.mark.parametrize("mode", MODES)
def test_save_locks_every_pid_before_any_checkpoint(stub: Stub, mode: list[str]) -> None:
    r = stub.run("--action", "save", "--pid", "11,12", "--pid", "13", *mode)
    assert r.rc == 0, r.err
    ops = stub.ops()
    locks = [i for i, (fn, _) in enumerate(ops) if fn == "lock"]
    ckpts = [i for i, (fn, _) in enumerate(ops) if fn == "checkpoint"]
    assert len(locks) == 3 and len(ckpts) == 3
    assert max(locks) < min(ckpts), ops
    assert {stub.state(p) for p in (11, 12, 13)} == {CHECKPOINTED}


def test_save_has_a_default_lock_timeout_and_passes_an_explicit_one(stub: Stub) -> None:
    stub.run("--action", "save", "--pid", "11")
    stub.run("--action", "resume", "--pid", "11")
    stub.run("--action", "save", "--pid", "11", "--timeout", "250")
    assert [c.timeout for c in stub.calls() if c.fn == "lock"] == [10000, 250]


@pytest.mark.parametrize("mode", MODES)
def test_save_lock_failure_unlocks_the_pids_already_locked(stub: Stub, mode: list[str]) -> None:
    stub.control(f"fail cuCheckpointProcessLock 12 {CUDA_ERROR_OUT_OF_MEMORY}")
    r = stub.run("--action", "save", "--pid", "11,12,13", *mode, "--json")
    assert r.rc == 1
    assert "rolled back" in r.err and "pid 12" in r.err and len(r.err.splitlines()) == 1
    assert not [c for c in stub.calls() if c.fn == "checkpoint"]
    assert sorted(p for fn, p in stub.ops() if fn == "unlock") == [11, 13]
    assert {stub.state(p) for p in (11, 12, 13)} == {RUNNING}
    res = {x["pid"]: x for x in r.json()}
    assert res[12]["ok"] is False and "CUDA_ERROR_OUT_OF_MEMORY" in res[12]["error"]
    assert {x["state_after"] for x in res.values()} == {"running"}


def test_save_of_a_busy_pid_gives_up_at_the_lock_timeout_and_rolls_back(stub: Stub) -> None:
    """A rank that cannot be locked (stuck in a collective) must not hang the capture."""
    stub.control("hang cuCheckpointProcessLock 12 600000")
    r = stub.run("--action", "save", "--pid", "11,12", "--timeout", "300", timeout=30)
    assert r.rc == 1 and "CUDA_ERROR_NOT_READY" in r.err and "rolled back" in r.err
    assert [c.rc for c in stub.calls() if c.fn == "lock" and c.pid == 12] == [CUDA_ERROR_NOT_READY]
    assert [p for fn, p in stub.ops() if fn == "unlock"] == [11]
    assert stub.state(11) == RUNNING and stub.state(12) == RUNNING


def test_save_checkpoint_failure_stops_at_once_and_keeps_the_locks(stub: Stub) -> None:
    stub.control(f"fail cuCheckpointProcessCheckpoint 12 {CUDA_ERROR_OUT_OF_MEMORY}")
    r = stub.run("--action", "save", "--pid", "11,12,13", "--serial", "--json")
    assert r.rc == 1
    assert [p for fn, p in stub.ops() if fn == "checkpoint"] == [11, 12]
    assert not [c for c in stub.calls() if c.fn == "unlock"]
    assert (stub.state(11), stub.state(12), stub.state(13)) == (CHECKPOINTED, LOCKED, LOCKED)
    assert "11=checkpointed 12=locked 13=locked" in r.err and "checkpoint pid 12" in r.err
    res = {x["pid"]: x for x in r.json()}
    assert res[13]["ok"] is False and "skipped" in res[13]["error"]
    assert res[11]["ok"] is True and res[11]["state_after"] == "checkpointed"


def test_parallel_save_checkpoint_failure_keeps_the_locks_too(stub: Stub) -> None:
    stub.control(f"fail cuCheckpointProcessCheckpoint 12 {CUDA_ERROR_OUT_OF_MEMORY}")
    r = stub.run("--action", "save", "--pid", "11,12,13")
    assert r.rc == 1
    assert not [c for c in stub.calls() if c.fn == "unlock"]
    assert stub.state(12) == LOCKED
    assert stub.state(11) == CHECKPOINTED and stub.state(13) == CHECKPOINTED


# ---- resume: restore every pid, then unlock every pid ----


@pytest.mark.parametrize("mode", MODES)
def test_resume_restores_every_pid_before_unlocking_any(stub: Stub, mode: list[str]) -> None:
    stub.set_state(CHECKPOINTED, 11, 12, 13)
    r = stub.run("--action", "resume", "--pid", "11,12,13", *mode)
    assert r.rc == 0, r.err
    ops = stub.ops()
    restores = [i for i, (fn, _) in enumerate(ops) if fn == "restore"]
    unlocks = [i for i, (fn, _) in enumerate(ops) if fn == "unlock"]
    assert len(restores) == 3 and len(unlocks) == 3 and max(restores) < min(unlocks)
    assert {stub.state(p) for p in (11, 12, 13)} == {RUNNING}


def test_resume_restore_failure_unlocks_nothing(stub: Stub) -> None:
    """A rank running while a peer failed to restore would hang in its next collective."""
    stub.set_state(CHECKPOINTED, 11, 12)
    stub.control(f"fail cuCheckpointProcessRestore 12 {CUDA_ERROR_OUT_OF_MEMORY}")
    r = stub.run("--action", "resume", "--pid", "11,12")
    assert r.rc == 1 and "restore pid 12" in r.err
    assert not [c for c in stub.calls() if c.fn == "unlock"]
    assert (stub.state(11), stub.state(12)) == (LOCKED, CHECKPOINTED)


def test_plain_actions_apply_to_every_pid(stub: Stub) -> None:
    r = stub.run("--action", "lock", "--pid", "1,2", "--pid", "3")
    assert r.rc == 0
    assert sorted(p for fn, p in stub.ops() if fn == "lock") == [1, 2, 3]
    assert {stub.state(p) for p in (1, 2, 3)} == {LOCKED}


# ---- pid parsing ----


@pytest.mark.parametrize("args,pids", [
    (["--pid", "7"], [7]),
    (["--pid", "7,8,9"], [7, 8, 9]),
    (["--pid", "7", "--pid", "8,9"], [7, 8, 9]),
    (["-p", "7", "-p", "8"], [7, 8]),
    (["--pid", " 7, 8"], [7, 8]),
    (["--pid", "2147483647"], [2147483647]),
])
def test_pid_lists_are_accepted(stub: Stub, args: list[str], pids: list[int]) -> None:
    r = stub.run("--action", "lock", *args)
    assert r.rc == 0, r.err
    assert sorted(p for _, p in stub.ops()) == pids


@pytest.mark.parametrize("value", ["", "x", "7,,8", ",7", "7,", "0", "-3", "7x", "2147483648",
                                   "99999999999999999999", "7,7", "1.5"])
def test_bad_pid_lists_are_refused_before_any_call(stub: Stub, value: str) -> None:
    r = stub.run("--action", "lock", "--pid", value)
    assert r.rc == 2 and len(r.err.splitlines()) == 1
    assert stub.calls() == []


def test_duplicate_pid_across_flags_is_refused(stub: Stub) -> None:
    r = stub.run("--action", "save", "--pid", "7,8", "--pid", "8")
    assert r.rc == 2 and "twice" in r.err and stub.calls() == []


@pytest.mark.parametrize("args", [["--action", "lock"], ["--action", "nap", "--pid", "1"],
                                  ["--get-state", "--action", "lock", "--pid", "1"],
                                  ["--action", "lock", "--pid", "1", "--timeout", "-1"],
                                  ["--action", "lock", "--pid", "1", "--bogus"],
                                  ["--action", "lock", "--pid", "1", "stray"], ["-x", "--action", "lock", "--pid", "1"],
                                  ["--action", "lock", "--pid", "1", "--json=yes"], ["--action", "lock", "--pid"]])
def test_usage_errors_exit_2(stub: Stub, args: list[str]) -> None:
    r = stub.run(*args)
    assert r.rc == 2 and stub.calls() == []
    assert len(r.err.splitlines()) == 1 and r.err.startswith("dynsnap-cuda: "), r.err


# ---- JSON ----


def test_json_reports_each_pid(stub: Stub) -> None:
    stub.set_devices(("GPU-28fd6b9c-4fb2-cd33-0776-4018cd000d99", 10 * GIB, 80 * GIB))
    stub.control(f"mem 21 0 {3 * GIB}")
    r = stub.run("--action", "save", "--pid", "21", "--json")
    assert r.rc == 0
    (res,) = r.json()
    assert res["pid"] == 21 and res["action"] == "save" and res["ok"] is True and res["error"] is None
    assert (res["state_before"], res["state_after"]) == ("running", "checkpointed")
    assert set(res["ms"]) == {"lock", "checkpoint"}
    assert res["bytes"] == 3 * GIB
    r = stub.run("--action", "resume", "--pid", "21", "--json")
    (res,) = r.json()
    assert (res["state_before"], res["state_after"], set(res["ms"])) == (
        "checkpointed", "running", {"restore", "unlock"})


# ---- free-memory check before restore ----

UUID0 = "GPU-28fd6b9c-4fb2-cd33-0776-4018cd000d99"


def test_restore_is_refused_when_the_gpu_lacks_what_the_checkpoint_freed(stub: Stub) -> None:
    stub.set_devices((UUID0, 10 * GIB, 80 * GIB))
    stub.control(f"mem 21 0 {8 * GIB}")
    assert stub.run("--action", "save", "--pid", "21").rc == 0
    assert stub.free(0) == 18 * GIB
    stub.set_devices((UUID0, 2 * GIB, 80 * GIB))  # another workload took the GPU meanwhile
    r = stub.run("--action", "resume", "--pid", "21")
    assert r.rc == 3
    assert "2048 MiB free" in r.err and "8192 MiB" in r.err and "--force" in r.err
    assert [fn for fn, _ in stub.ops()] == ["lock", "checkpoint"]
    assert stub.state(21) == CHECKPOINTED
    stub.set_devices((UUID0, 20 * GIB, 80 * GIB))
    r = stub.run("--action", "resume", "--pid", "21")
    assert r.rc == 0 and stub.state(21) == RUNNING


def test_force_skips_the_free_memory_check(stub: Stub) -> None:
    stub.set_devices((UUID0, 10 * GIB, 80 * GIB))
    stub.control(f"mem 21 0 {8 * GIB}")
    stub.run("--action", "save", "--pid", "21")
    stub.set_devices((UUID0, 2 * GIB, 80 * GIB))
    r = stub.run("--action", "resume", "--pid", "21", "--force")
    assert r.rc == 0 and stub.state(21) == RUNNING


def test_need_bytes_sets_the_requirement(stub: Stub) -> None:
    stub.set_devices((UUID0, 4 * GIB, 80 * GIB))
    stub.set_state(CHECKPOINTED, 21)
    r = stub.run("--action", "restore", "--pid", "21", "--need-bytes", str(5 * GIB))
    assert r.rc == 3 and "4096 MiB free" in r.err and "5120 MiB" in r.err
    assert stub.calls() == [] and stub.state(21) == CHECKPOINTED
    r = stub.run("--action", "restore", "--pid", "21", "--need-bytes", str(3 * GIB))
    assert r.rc == 0 and stub.state(21) == LOCKED


def test_checkpoint_on_one_gpu_does_not_demand_memory_on_another(stub: Stub) -> None:
    stub.set_devices((UUID0, 10 * GIB, 80 * GIB),
                     ("GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", 1 * GIB, 80 * GIB))
    stub.control(f"mem 21 0 {8 * GIB}")
    stub.run("--action", "save", "--pid", "21")
    r = stub.run("--action", "resume", "--pid", "21")
    assert r.rc == 0, r.err


def test_driver_out_of_memory_on_restore_is_reported(stub: Stub) -> None:
    stub.set_state(CHECKPOINTED, 21)
    stub.control(f"fail cuCheckpointProcessRestore 21 {CUDA_ERROR_INVALID_VALUE}")
    r = stub.run("--action", "resume", "--pid", "21")
    assert r.rc == 1 and "CUDA_ERROR_INVALID_VALUE" in r.err and stub.state(21) == CHECKPOINTED


def test_skip_mem_records_nothing_and_checks_nothing(stub: Stub) -> None:
    stub.set_devices((UUID0, 10 * GIB, 80 * GIB))
    stub.control(f"mem 21 0 {8 * GIB}")
    r = stub.run("--action", "save", "--pid", "21", "--json", "--skip-mem")
    assert r.rc == 0 and r.json()[0]["bytes"] is None
    assert not stub.records.exists() or not list(stub.records.iterdir())
    stub.set_devices((UUID0, 1 * GIB, 80 * GIB))
    r = stub.run("--action", "resume", "--pid", "21", "--need-bytes", str(4 * GIB), "--skip-mem")
    assert r.rc == 0 and stub.state(21) == RUNNING


def test_timing_names_each_stage_on_stderr_only_when_asked(stub: Stub) -> None:
    """DYNSNAP_CUDA_TIMING=1: a stderr line per stage, in order, and the same stdout as without it."""
    stub.set_devices(("GPU-28fd6b9c-4fb2-cd33-0776-4018cd000d99", 10 * GIB, 80 * GIB))
    assert stub.run("--action", "save", "--pid", "21").rc == 0
    plain = stub.run("--action", "resume", "--pid", "21", "--json", "--skip-mem")
    assert plain.rc == 0 and "timing" not in plain.err
    assert stub.run("--action", "save", "--pid", "21").rc == 0
    stub.env["DYNSNAP_CUDA_TIMING"] = "1"
    r = stub.run("--action", "resume", "--pid", "21", "--json", "--skip-mem")
    def without_ms(res: object) -> list[dict]:
        return [{k: v for k, v in rec.items() if k != "ms"} for rec in res.json()]  # type: ignore[attr-defined]

    assert r.rc == 0 and without_ms(r) == without_ms(plain)
    stages = [line.split(" ms ", 1)[1] for line in r.err.splitlines() if line.startswith("timing +")]
    assert stages == ["start", "driver loaded", "state before", "free memory before", "restore", "unlock",
                      "free memory after", "state after", "printed"], r.err


def _inits(stub: Stub) -> list[str]:
    f = stub.dir / "inits"
    return f.read_text().splitlines() if f.exists() else []


def test_the_checkpoint_calls_make_no_cuinit(stub: Stub) -> None:
    """cuInit is made only where a device or a context is needed: with the only CUDA process on the
    GPU checkpointed it took 100-185 ms on the H200 (10 ms while it ran), and every look at a
    sleeping worker (--get-state) paid it."""
    stub.set_state(CHECKPOINTED, 21)
    for args in (["--get-state", "--pid", "21"], ["--get-restore-tid", "--pid", "21"],
                 ["--action", "restore", "--pid", "21", "--skip-mem"], ["--action", "unlock", "--pid", "21"],
                 ["--action", "lock", "--pid", "21"], ["--action", "unlock", "--pid", "21"]):
        r = stub.run(*args)
        assert r.rc == 0, (args, r.err)
    assert _inits(stub) == [] and stub.state(21) == RUNNING
    stub.set_devices(("GPU-28fd6b9c-4fb2-cd33-0776-4018cd000d99", 10 * GIB, 80 * GIB))
    assert stub.run("--action", "save", "--pid", "21", "--json").rc == 0  # reads memory: enumerates
    assert _inits(stub) == ["cuInit rc=0"]


def test_a_driver_that_wants_cuinit_gets_it_and_the_call_is_made_again(stub: Stub) -> None:
    stub.control("needinit all * 1")
    stub.set_state(CHECKPOINTED, 21)
    r = stub.run("--get-state", "--pid", "21")
    assert r.rc == 0 and r.out.strip() == "checkpointed" and _inits(stub) == ["cuInit rc=0"]
    r = stub.run("--action", "resume", "--pid", "21", "--skip-mem", "--json")
    assert r.rc == 0 and r.json()[0]["ok"] is True and stub.state(21) == RUNNING, r.err
    assert r.json()[0]["state_before"] == "checkpointed"  # its first call, refused, then made after cuInit
    assert stub.ops() == [("restore", 21), ("unlock", 21)] and [c.rc for c in stub.calls()] == [0, 0]
    assert len(_inits(stub)) == 2  # one per process
    # A driver call that is the process's first (its state query failing otherwise) gets it too.
    assert stub.run("--action", "save", "--pid", "21").rc == 0
    stub.control("fail cuCheckpointProcessGetState 21 999")
    n = len(stub.calls())
    r = stub.run("--action", "resume", "--pid", "21", "--skip-mem", "--json")
    assert r.rc == 0 and r.json()[0]["state_before"] == "unknown", r.err
    assert [(c.fn, c.rc) for c in stub.calls()[n:]] == [("restore", 3), ("restore", 0), ("unlock", 0)]
    assert stub.states()[21] == RUNNING


# ---- a pid pinned from the caller's look to the act (issue 38) ----


def test_a_pinned_pid_that_is_another_process_now_is_never_handed_to_the_driver(stub: Stub) -> None:
    """``PID@START``: the agent saw the process start at START; right before each driver call the helper
    reads the pid's start time again, and another process at that pid (the one seen exited, its pid
    reused) is refused by name, the driver never called for it. The same pid with its own start works."""
    import os

    from dynsnap.runtime import procfs

    me = os.getpid()
    start = procfs.start_time(me)
    assert start is not None
    r = stub.run("--action", "lock", "--pid", f"{me}@{start + 1}", "--json")
    assert r.rc == 1 and f"pid {me} is not the process checked (started at {start}, not {start + 1})" in r.err
    assert stub.ops() == [], "the driver was called for another process"
    r = stub.run("--action", "save", "--pid", f"{me}@{start}", "--json")
    assert r.rc == 0, r.err
    assert stub.ops() == [("lock", me), ("checkpoint", me)]


@pytest.mark.parametrize("bad", ["42@", "42@x", "42@-1", "@5"])
def test_a_malformed_pin_is_a_usage_error(stub: Stub, bad: str) -> None:
    r = stub.run("--action", "lock", "--pid", bad)
    assert r.rc == 2 and "invalid pid" in r.err
    assert stub.ops() == []
