"""The agent's NCCL preflight on two GPUs: ranks the driver could not restore are refused before any
lock, ranks with the settings it names are captured and woken (issue 11).

Runs only on a machine with two GPUs and the CUDA driver (the `gpu` marker; tests/conftest.py skips
it elsewhere), e.g. the `nvidia-h200-x2` machine, where bench/gpu/two_gpu.py runs it:
`python3 -m pytest tests/gpu/test_two_gpus_gpu.py -v`. It needs dynsnap importable (pydantic, which
bench/gpu/run_h200x2.sh installs from .device/wheels) and root (unshare).

A worker is two PyTorch ranks joined by NCCL (bench/gpu/nccl_rank.py: one process per GPU), started
by one launcher under dynsnap-entrypoint as PID 1 of its own pid and mount namespace, the way a
worker container runs; every capture and wake is one `dynsnap agent exec` call, the executor the
node agent runs step by step. With NCCL's defaults, or with only peer-to-peer off, the driver
checkpoints both ranks and then cannot restore them (docs/BENCHMARKS.md, "Two GPUs (issue 11)"): the
agent must refuse such a worker while it still runs, naming each rank's settings and the sets that
work; with exactly one of `NCCL_SAFE_ENVS` (dynsnap/agent/worker.py) it must capture and wake it.
Asserts outcomes: the agent's exit status and the reason and text it reports, the driver's state of
each rank, where nvidia-smi sees each rank's memory, the pattern and the all-reduce after.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
RANK = ROOT / "bench" / "gpu" / "nccl_rank.py"
NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_CUMEM_ENABLE", "NCCL_CUMEM_HOST_ENABLE")
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CLOSE_FDS = "import os, sys; os.closerange(3, 65536); os.execvp(sys.argv[1], sys.argv[1:])"


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(1 for ln in out.splitlines() if ln.startswith("GPU "))


@pytest.fixture(scope="module")
def built() -> Path:
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    subprocess.run(["make", "-s", "-C", str(ROOT / "native"), f"BUILD={BUILD}"], check=True)
    return BUILD


def wait_file(path: Path, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            text = path.read_text().strip()
            path.unlink()
            return text
        time.sleep(0.05)
    return "timeout"


class Worker:
    """Two NCCL ranks under dynsnap-entrypoint in their own pid + mount namespace."""

    def __init__(self, work: Path, nccl: dict[str, str], port: int) -> None:
        self.work = work
        work.mkdir(parents=True)
        self.ctl = [work / "0", work / "1"]
        env = {k: v for k, v in os.environ.items() if k not in NCCL_VARS}
        env.update(MULTICAST_OFF)
        env.update(nccl)
        cmd = (f"mkdir -p /run/dynsnap && mount -t tmpfs emptydir /run/dynsnap && exec {sys.executable} -c "
               f"'{CLOSE_FDS}' {BUILD}/dynsnap-entrypoint --control-dir /run/dynsnap --system-port {port + 1} "
               f"--probe-port {port + 2} -- {sys.executable} {RANK} launch --world 2 --port {port} --mib 1024 "
               f"--ctl {work}")
        self.log = (work / "container.log").open("wb")
        self.unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--propagation", "private",
             "--", "sh", "-c", cmd], env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.entrypoint = 0
        for _ in range(100):
            kids = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children")
            if kids.exists() and kids.read_text().split():
                self.entrypoint = int(kids.read_text().split()[0])
                break
            time.sleep(0.1)
        outs = [wait_file(c / "out", 240) for c in self.ctl]
        assert all(o.startswith("ready") for o in outs), (outs, (work / "container.log").read_text()[-3000:])
        # the ranks report their pids inside the container's namespace; the driver and nvidia-smi use the host's
        self.pids = [self.host_pid(int(o.split()[1])) for o in outs]
        self.uid = str(uuid.uuid4())

    def host_pid(self, ns_pid: int) -> int:
        ns = os.readlink(f"/proc/{self.entrypoint}/ns/pid")
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.readlink(d / "ns" / "pid") != ns:
                    continue
                nspid = next(ln.split()[1:] for ln in (d / "status").read_text().splitlines()
                             if ln.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            if int(nspid[-1]) == ns_pid:
                return int(d.name)
        raise AssertionError(f"no process with pid {ns_pid} in the container's namespace")

    def ask(self, cmd: str, timeout: float = 120) -> list[str]:
        for c in self.ctl:
            (c / "cmd.tmp").write_text(cmd + "\n")
            (c / "cmd.tmp").rename(c / "cmd")
        return [wait_file(c / "out", timeout) for c in self.ctl]

    def agent(self, action: str) -> tuple[int, list[dict[str, Any]], str]:
        criu = ROOT / ".device" / "criu" / "criu"
        p = subprocess.run(
            [sys.executable, "-m", "dynsnap", "agent", "--images-root", str(self.work / "images"),
             "--state-dir", str(self.work / "state"), "--cuda-helper", str(BUILD / "dynsnap-cuda"),
             "--criu", str(criu) if criu.exists() else "criu", "--tcp-established", "false", "--network-lock", "",
             "exec", action, "--pod-uid", self.uid, "--entrypoint-pid", str(self.entrypoint), "--tier", "suspend",
             "--quiesced"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        return p.returncode, lines, p.stderr

    def states(self) -> list[str]:
        return [subprocess.run([str(BUILD / "dynsnap-cuda"), "--get-state", "--pid", str(pid)], capture_output=True,
                               text=True).stdout.strip() for pid in self.pids]

    def stop(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.unshare.pid, 9)
        self.unshare.wait(timeout=30)


def placement() -> dict[int, str]:
    """pid -> GPU UUID of every process nvidia-smi lists as holding GPU memory."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {int(p): u.strip() for p, u in (ln.split(",") for ln in out.splitlines() if ln.strip())}


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


def safe_envs() -> list[dict[str, str]]:
    sys.path.insert(0, str(ROOT))
    from dynsnap.agent.worker import NCCL_SAFE_ENVS

    return [dict(e) for e in NCCL_SAFE_ENVS]


# the sets whose restore failed in the bisection: NCCL's defaults, and peer-to-peer alone off
@pytest.mark.parametrize("nccl", [{}, {"NCCL_P2P_DISABLE": "1"}], ids=["defaults", "p2p-off-only"])
def test_ranks_the_driver_could_not_restore_are_refused_while_they_run(built: Path, workers: list[Worker],
                                                                        tmp_path: Path, nccl: dict[str, str]) -> None:
    w = Worker(tmp_path / "unsafe", nccl, port=29610 if nccl else 29620)
    workers.append(w)
    assert w.ask("ar 3")[0].startswith("ok")
    on_gpu = placement()
    assert all(pid in on_gpu for pid in w.pids), on_gpu

    rc, lines, err = w.agent("capture")

    assert rc == 1, (lines, err)
    outcome = lines[-1]
    assert outcome["outcome"] == "failed" and outcome["state"] == "Active", outcome
    error = outcome["error"]
    assert error["reason"] == "UnsafeMultiGpu" and error["step"] == "quiesce" and error["changed"] is False, error
    assert "2 GPU processes use NCCL" in error["message"], error
    for safe in safe_envs():  # the reason names every set that works, and what each rank has
        assert " ".join(f"{k}={v}" for k, v in safe.items()) in error["message"], error
    for pid in w.pids:
        have = " ".join(f"{k}={nccl.get(k, '(unset)')}" for k in NCCL_VARS[:3])
        assert f"pid {pid}: {have}" in error["message"], error
    assert not any(rec.get("step") == "save" for rec in lines), lines  # no helper ever ran: no lock
    assert w.states() == ["running", "running"]
    assert all(pid in placement() for pid in w.pids)
    assert all(o.startswith("ok") for o in w.ask("ar 3")), "the collective after the refusal"
    assert all(o.startswith("ok") for o in w.ask("check"))


@pytest.mark.parametrize("which", [0, 1], ids=["recommended", "alternative"])
def test_ranks_with_a_set_that_works_are_captured_and_woken(built: Path, workers: list[Worker], tmp_path: Path,
                                                             which: int) -> None:
    w = Worker(tmp_path / "safe", safe_envs()[which], port=29630 + 10 * which)
    workers.append(w)
    assert all(o.startswith("ok") for o in w.ask("ar 3"))
    before = placement()
    homes = {pid: before[pid] for pid in w.pids}
    assert len(set(homes.values())) == 2, homes  # one rank per GPU

    rc, lines, err = w.agent("capture")

    assert rc == 0, (lines, err)
    assert lines[-1]["outcome"] == "ok" and lines[-1]["state"] == "Suspended", lines[-1]
    (save,) = [rec for rec in lines if rec.get("step") == "save"]
    assert sorted(h["pid"] for h in save["helper"]) == sorted(w.pids)
    assert all(h["ok"] and h["state_after"] == "checkpointed" for h in save["helper"]), save
    assert w.states() == ["checkpointed", "checkpointed"]
    asleep = placement()
    assert not any(pid in asleep for pid in w.pids), asleep  # no memory left on either GPU

    rc, lines, err = w.agent("wake")

    assert rc == 0, (lines, err)
    assert lines[-1]["outcome"] == "ok" and lines[-1]["state"] == "Active", lines[-1]
    assert w.states() == ["running", "running"]
    after = placement()
    assert {pid: after.get(pid) for pid in w.pids} == homes
    assert all(o.startswith("ok") for o in w.ask("check")), "the pattern and new work after the wake"
    assert all(o.startswith("ok") for o in w.ask("ar 5")), "the collective after the wake"
