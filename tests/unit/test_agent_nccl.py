"""The agent's NCCL preflight (dynsnap/agent/worker.py, unsafe_multi_gpu) against the bisection on the
H200 pair (issue 11, docs/BENCHMARKS.md "Two GPUs (issue 11)"): it lets through exactly the settings
under which two ranks were checkpointed and restored, refuses every other combination, and its
reason names each rank's settings and the sets that work.

The processes are a made-up /proc (maps and environ files), as the agent reads them; the GPU side of
the same check runs on two real GPUs in tests/gpu/test_two_gpus_gpu.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from dynsnap.agent import worker as W
from dynsnap.models.ids import HostPid, PodUID

LIBCUDA = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159\n"
LIBNCCL = "7f10-7f11 r-xp 0 08:01 2 /opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2\n"
P, S, C = ("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"), ("NCCL_CUMEM_ENABLE", "0")

# What the two runs on the H200 pair measured for each combination of the three switches (save, then
# resume of both ranks): True where the resume succeeded and the all-reduce and the pattern were right.
RESTORED = {(): False, (P,): False, (S,): False, (C,): False, (S, C): False,
            (P, C): True, (P, S): True, (P, S, C): True}


def worker(tmp_path: Path, envs: list[dict[str, str]], *, nccl: bool = True) -> W.WorkerProcs:
    pids = []
    for i, env in enumerate(envs):
        pid = 501 + i
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "maps").write_text(LIBCUDA + (LIBNCCL if nccl else ""))
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0"
                                             for k, v in {"PATH": "/usr/bin", **env}.items()))
        pids.append(HostPid(pid))
    return W.WorkerProcs(pod_uid=PodUID("u"), entrypoint=HostPid(500), pidns=1, control_dir="/run/dynsnap", info={},
                         procs=(), gpu=tuple(pids))


@pytest.mark.parametrize("switches", list(RESTORED), ids=lambda s: "+".join(k for k, _ in s) or "defaults")
def test_exactly_the_restorable_combinations_pass(tmp_path: Path, switches: tuple[tuple[str, str], ...]) -> None:
    env = dict(switches)
    why = W.unsafe_multi_gpu(worker(tmp_path, [env, env]), tmp_path)
    assert (why is None) == RESTORED[switches], why


def test_the_sets_are_the_smallest_restorable_ones() -> None:
    """Each set of NCCL_SAFE_ENVS was restored, and none of its proper subsets was."""
    for safe in W.NCCL_SAFE_ENVS:
        items = tuple(sorted(safe.items(), key=[P, S, C].index))
        assert RESTORED[items]
        for n in range(len(items)):
            for sub in itertools.combinations(items, n):
                assert not RESTORED[sub], sub
    assert dict([P, C]) == W.NCCL_SAFE_ENV  # the faster of the two is the one the reason recommends


def test_a_switch_with_another_value_does_not_count(tmp_path: Path) -> None:
    env = {"NCCL_P2P_DISABLE": "0", "NCCL_CUMEM_ENABLE": "0", "NCCL_SHM_DISABLE": "0"}
    assert W.unsafe_multi_gpu(worker(tmp_path, [env, env]), tmp_path) is not None


def test_the_reason_names_each_ranks_settings_and_the_sets_that_work(tmp_path: Path) -> None:
    w = worker(tmp_path, [{"NCCL_P2P_DISABLE": "1"}, dict([P, C])])

    why = W.unsafe_multi_gpu(w, tmp_path)

    assert why is not None
    assert why.startswith("2 GPU processes use NCCL with settings the CUDA driver cannot restore"), why
    # only the rank that lacks a set is named, with all three of its switches
    assert "pid 501: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=(unset) NCCL_CUMEM_ENABLE=(unset)" in why, why
    assert "pid 502" not in why, why
    assert why.endswith("run the worker with NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0 "
                        "(or NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, slower)"), why


def test_ranks_may_use_either_set(tmp_path: Path) -> None:
    assert W.unsafe_multi_gpu(worker(tmp_path, [dict([P, C]), dict([P, S])]), tmp_path) is None


def test_one_gpu_process_or_no_nccl_is_not_a_concern(tmp_path: Path) -> None:
    one, plain = tmp_path / "one", tmp_path / "plain"
    one.mkdir()
    plain.mkdir()
    assert W.unsafe_multi_gpu(worker(one, [{}]), one) is None
    assert W.unsafe_multi_gpu(worker(plain, [{}, {}], nccl=False), plain) is None
