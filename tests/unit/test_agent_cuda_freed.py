"""What a save freed, read from dynsnap-cuda's own per-pid records (the format write_records in
native/cuda/dynsnap-cuda.c writes): what a snapshot's manifest carries for the wake's free-memory
check, right also when the agent that ran the save died (tests/integration/node/test_agent_restart.py
shows that end to end against the real helper)."""

from __future__ import annotations

from pathlib import Path

from dynsnap.agent.cuda import CudaHelper
from dynsnap.models.ids import HostPid

A = "GPU-11111111-1111-1111-1111-111111111111"
B = "GPU-22222222-2222-2222-2222-222222222222"


def _helper(state_dir: Path) -> CudaHelper:
    return CudaHelper("dynsnap-cuda", env={"DYNSNAP_CUDA_STATE_DIR": str(state_dir)})


def test_one_call_for_several_pids_is_counted_once(tmp_path: Path) -> None:
    # One save of pids 10 and 11 measured 3 GiB freed on A and 1 GiB on B, in sum: both records say so.
    for pid in (10, 11):
        (tmp_path / str(pid)).write_text(f"group 900-1700000000\n{A} {3 << 30}\n{B} {1 << 30}\n")
    assert _helper(tmp_path).freed([HostPid(10), HostPid(11)]) == {A: 3 << 30, B: 1 << 30}


def test_separate_calls_add_up_and_pids_without_a_record_count_nothing(tmp_path: Path) -> None:
    (tmp_path / "10").write_text(f"group 900-1700000000\n{A} 100\n")
    (tmp_path / "11").write_text(f"group 901-1700000001\n{A} 50\n")
    (tmp_path / "12").write_text("group 902-1700000002\n")  # that call freed nothing measurable
    (tmp_path / "99").write_text(f"group 903-1700000003\n{A} 7\n")  # another process: not asked for
    pids = [HostPid(p) for p in (10, 11, 12, 13)]
    assert _helper(tmp_path).freed(pids) == {A: 150}


def test_no_records_is_nothing_freed(tmp_path: Path) -> None:
    assert _helper(tmp_path / "absent").freed([HostPid(10)]) == {}
