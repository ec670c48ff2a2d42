"""dynsnap-cuda against the real driver: PyTorch processes (bench/gpu/worker.py) saved and resumed.

Runs only where a CUDA driver exists (the `gpu` marker; tests/conftest.py skips it elsewhere),
e.g. on the H200 machine: `python3 -m pytest tests/gpu -q`. Asserts outcomes: states, GPU
memory released as another process sees it, the pattern intact and new GPU work running after
the wake, and a busy process refused and rolled back rather than hung.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
WORKER = ROOT / "bench" / "gpu" / "worker.py"


@pytest.fixture(scope="module")
def cli() -> Path:
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "cuda"), f"BUILD={BUILD}"], check=True)
    return BUILD / "dynsnap-cuda"


class Worker:
    def __init__(self, gib: int, seed: int) -> None:
        self.p = subprocess.Popen([sys.executable, str(WORKER), "--gib", str(gib), "--seed", str(seed)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self.ask(None)
        assert line.startswith("ready"), line
        self.pid = self.p.pid

    def ask(self, cmd: str | None) -> str:
        assert self.p.stdin and self.p.stdout
        if cmd:
            self.p.stdin.write(cmd + "\n")
            self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def stop(self) -> None:
        self.p.kill()
        self.p.wait()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    pytest.importorskip("torch")
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


def run(cli: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DYNSNAP_CUDA_STATE_DIR": os.environ.get("DYNSNAP_CUDA_STATE_DIR", "/tmp/dynsnap-cuda")}
    return subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=timeout, env=env)


def used_mib() -> int:
    if not shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi not found")
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def test_save_releases_the_gpu_and_resume_brings_the_pattern_back(cli: Path, workers: list[Worker]) -> None:
    w = Worker(2, seed=3)
    workers.append(w)
    before = used_mib()
    r = run(cli, "--action", "save", "--pid", str(w.pid))
    assert r.returncode == 0, r.stderr
    assert run(cli, "--get-state", "--pid", str(w.pid)).stdout == "checkpointed\n"
    assert used_mib() < before - 2048
    r = run(cli, "--action", "resume", "--pid", str(w.pid))
    assert r.returncode == 0, r.stderr
    assert run(cli, "--get-state", "--pid", str(w.pid)).stdout == "running\n"
    assert w.ask("check").startswith("ok")


def test_two_processes_saved_and_resumed_together_with_an_identity_map(cli: Path,
                                                                       workers: list[Worker]) -> None:
    a, b = Worker(1, seed=4), Worker(1, seed=5)
    workers += [a, b]
    pids = f"{a.pid},{b.pid}"
    n = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, check=True).stdout)
    identity = ",".join(f"{i}={i}" for i in range(n))
    for _ in range(2):
        assert run(cli, "--action", "save", "--pid", pids).returncode == 0
        assert run(cli, "--get-state", "--pid", pids).stdout == f"{a.pid} checkpointed\n{b.pid} checkpointed\n"
        bad = run(cli, "--action", "resume", "--pid", pids, "--gpu-map", f"0={'f' * 32}")
        assert bad.returncode == 2
        assert run(cli, "--get-state", "--pid", pids).stdout == f"{a.pid} checkpointed\n{b.pid} checkpointed\n"
        r = run(cli, "--action", "resume", "--pid", pids, "--gpu-map", identity)
        assert r.returncode == 0, r.stderr
        assert a.ask("check").startswith("ok") and b.ask("check").startswith("ok")


def test_a_busy_process_is_refused_within_the_lock_timeout_and_the_rest_rolled_back(
        cli: Path, workers: list[Worker]) -> None:
    busy, idle = Worker(1, seed=6), Worker(1, seed=7)
    workers += [busy, idle]
    assert busy.ask("sleep 15") == "launched"
    time.sleep(0.5)
    r = run(cli, "--action", "save", "--pid", f"{busy.pid},{idle.pid}", "--timeout", "2000", timeout=60)
    assert r.returncode == 1 and "rolled back" in r.stderr, r.stderr
    assert run(cli, "--get-state", "--pid", f"{busy.pid},{idle.pid}").stdout == (
        f"{busy.pid} running\n{idle.pid} running\n")
    assert idle.ask("check").startswith("ok")
    assert busy.ask("sync") == "synced"
    assert busy.ask("check").startswith("ok")
