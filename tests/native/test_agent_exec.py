"""``dynsnap agent exec``: the agent's executor without Kubernetes, the way the GPU machine runs it
(bench/gpu/agent_h200.sh), here against the stub CUDA driver and real CRIU. A process that maps the
stub driver runs under dynsnap-entrypoint as PID 1 of its own pid and mount namespace (its control
directory on a tmpfs only that namespace sees); one `exec capture` and one `exec wake` per tier take
it to sleep and back, and it goes on counting from where it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynsnap.runtime.command import find_tool
from dynsnap.testenv.dynsnap_parts import StubDriver, build_stub_driver

ROOT = Path(__file__).resolve().parents[2]
NATIVE = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
GPU_UUID = "GPU-28fd6b9c-4fb2-cd33-0776-4018cd000d99"
COUNTER = """
import hashlib, os, sys, time
ctl = sys.argv[1]
# BALLAST MiB of private memory with a pattern (each MiB its index): pages for CRIU's restorer threads
mib = int(sys.argv[2]) if len(sys.argv) > 2 else 0
ballast = bytearray(mib << 20)
for i in range(mib):
    ballast[i << 20:(i << 20) + 8] = i.to_bytes(8, "little")
digest = hashlib.sha256(ballast).hexdigest()
n = 0
while True:
    n += 1
    tmp = os.path.join(ctl, "count.tmp")
    with open(tmp, "w") as f:
        f.write(str(n))
    os.replace(tmp, os.path.join(ctl, "count"))
    if os.path.exists(os.path.join(ctl, "verify")):
        with open(tmp, "w") as f:
            f.write("ok" if hashlib.sha256(ballast).hexdigest() == digest else "bad")
        os.unlink(os.path.join(ctl, "verify"))
        os.replace(tmp, os.path.join(ctl, "verified"))
    time.sleep(0.05)
"""


def _need() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root (namespaces, CRIU)")
    criu = os.environ.get("DYNSNAP_CRIU", "")
    if not os.access(criu, os.X_OK):
        pytest.fail("CRIU not built: DYNSNAP_CRIU is unset or not executable; run ./run setup")
    if not (NATIVE / "dynsnap-entrypoint").exists() or not (NATIVE / "dynsnap-cuda").exists():
        pytest.fail("native/build is not built: run make -C native")
    return criu


class Container:
    """The worker under the entrypoint in its own pid + mount namespace (a runtime's container)."""

    def __init__(self, work: Path, driver: StubDriver, ballast_mib: int = 0) -> None:
        self.ctl = work / "ctl"
        self.ctl.mkdir(parents=True)
        script = work / "counter.py"
        script.write_text(COUNTER)
        # Only stdio open, as a runtime starts a container: CRIU cannot dump a descriptor opened
        # outside the worker's mount namespace.
        close_fds = "import os, sys; os.closerange(3, 65536); os.execvp(sys.argv[1], sys.argv[1:])"
        inner = (f"mkdir -p /run/dynsnap && mount -t tmpfs emptydir /run/dynsnap && "
                 f"LD_PRELOAD={driver.libcuda} exec {sys.executable} -c '{close_fds}' "
                 f"{NATIVE / 'dynsnap-entrypoint'} --control-dir /run/dynsnap --system-port 9090 --probe-port 18081 "
                 f"-- {sys.executable} {script} {self.ctl} {ballast_mib}")
        self.proc = subprocess.Popen(
            [find_tool("unshare"), "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--propagation",
             "private", "--", "sh", "-c", inner],
            stdin=subprocess.DEVNULL, stdout=open(work / "container.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True, close_fds=True)
        self.entrypoint = 0
        for _ in range(100):
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            if kids and (self.ctl / "count").exists():
                self.entrypoint = int(kids[0])
                break
            time.sleep(0.1)
        assert self.entrypoint, (work / "container.log").read_text()

    def ballast_intact(self) -> bool:
        """The worker's own check of its ballast (every byte as it was written)."""
        (self.ctl / "verify").touch()
        for _ in range(200):
            if (self.ctl / "verified").exists():
                return (self.ctl / "verified").read_text() == "ok"
            time.sleep(0.05)
        raise TimeoutError("the worker did not check its ballast within 10 s")

    def count(self) -> int:
        return int((self.ctl / "count").read_text())

    def counting(self) -> bool:
        a = self.count()
        for _ in range(40):
            time.sleep(0.05)
            if self.count() > a:
                return True
        return False

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def container(tmp_path: Path) -> Iterator[tuple[Container, StubDriver]]:
    _need()
    driver = build_stub_driver(tmp_path / "stub")
    c = Container(tmp_path, driver)
    try:
        yield c, driver
    finally:
        c.stop()


def _exec(tmp_path: Path, driver: StubDriver, c: Container, uid: str, action: str, tier: str,
          *extra: str) -> tuple[int, list[dict[str, object]]]:
    argv = [sys.executable, "-m", "dynsnap", "agent", "--images-root", str(tmp_path / "images"),
            "--state-dir", str(tmp_path / "state"), "--cuda-helper", str(NATIVE / "dynsnap-cuda"),
            "--criu", os.environ["DYNSNAP_CRIU"], "--nsexec", str(NATIVE / "dynsnap-nsexec"),
            "--tcp-established", "false", "--network-lock", ""]
    for k, v in driver.env().items():
        argv += ["--cuda-env", f"{k}={v}"]
    argv += ["exec", action, "--pod-uid", uid, "--entrypoint-pid", str(c.entrypoint), "--tier", tier, *extra]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return r.returncode, lines


@pytest.mark.parametrize("tier", ["suspend", "snapshot"])
def test_exec_captures_and_wakes_without_kubernetes(container: tuple[Container, StubDriver], tmp_path: Path,
                                                   tier: str) -> None:
    c, driver = container
    uid = str(uuid.uuid4())
    rc, out = _exec(tmp_path, driver, c, uid, "capture", tier, "--quiesced")
    assert rc == 0 and out[-1]["outcome"] == "ok" and out[-1]["state"] == "Suspended", out
    steps = [o["step"] for o in out[:-1]]
    assert steps == (["quiesce", "save", "settle-suspended"] if tier == "suspend"
                     else ["quiesce", "save", "dump", "seal", "settle-snapshotted"])
    before = c.count()
    time.sleep(0.3)
    if tier == "snapshot":
        assert c.count() == before, "the dumped tree is gone: it does not count while asleep"
        assert any((tmp_path / "images").rglob("core-*.img"))
    assert 2 in driver.states().values()  # checkpointed (the stub driver)
    rc, out = _exec(tmp_path, driver, c, uid, "wake", tier)
    assert rc == 0 and out[-1]["outcome"] == "ok" and out[-1]["state"] == "Active", out
    assert c.counting() and c.count() > before
    assert set(driver.states().values()) == {0}  # every GPU process running again
    assert not any((tmp_path / "images").rglob("*.img")), "the woken-from images are deleted"


def test_a_snapshot_wake_reads_the_pages_back_with_several_threads(tmp_path: Path) -> None:
    """hack/patches/criu/0002 on the agent's path: CRIU run by the agent in the worker's namespaces, the
    entrypoint as PID 1 with its pid floor, a worker of 256 MiB. The restore step says how the pages came
    back (threads: one per CPU, at most 16), and the worker's memory is intact."""
    _need()
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one CPU: CRIU reads with its stock loop")
    driver = build_stub_driver(tmp_path / "stub")
    c = Container(tmp_path, driver, ballast_mib=256)
    try:
        uid = str(uuid.uuid4())
        rc, out = _exec(tmp_path, driver, c, uid, "capture", "snapshot", "--quiesced")
        assert rc == 0 and out[-1]["state"] == "Suspended", out
        rc, out = _exec(tmp_path, driver, c, uid, "wake", "snapshot")
        assert rc == 0 and out[-1]["state"] == "Active", out
        (restore,) = [o for o in out if o.get("step") == "restore"]
        read = restore["pagesRead"]
        assert read is not None, restore  # None: CRIU's one-thread loop read them
        assert read["threads"] == min(cpus, 16) and read["bytes"] >= 256 << 20 and read["processes"] >= 1, read
        assert c.counting() and c.ballast_intact()
    finally:
        c.stop()


def test_exec_records_each_gpus_free_memory_as_the_helper_read_it(container: tuple[Container, StubDriver],
                                                                  tmp_path: Path) -> None:
    """The save and resume steps record each GPU's free memory before and after (status ``gpus``)
    from the helper's own reading around its driver calls, not from helpers of their own."""
    c, driver = container
    gib = 1 << 30
    (driver.state_dir / "devices").write_text(f"{GPU_UUID.removeprefix('GPU-').replace('-', '')} {10 * gib} "
                                              f"{80 * gib}\n")
    worker = int(Path(f"/proc/{c.entrypoint}/task/{c.entrypoint}/children").read_text().split()[0])
    driver.control(f"mem {worker} 0 {4 * gib}")  # its checkpoint frees 4 GiB, its restore takes them
    uid = str(uuid.uuid4())
    rc, out = _exec(tmp_path, driver, c, uid, "capture", "suspend", "--quiesced")
    assert rc == 0 and out[-1]["outcome"] == "ok", out
    (save,) = [o for o in out if o.get("step") == "save"]
    assert save["gpus"] == [{"uuid": GPU_UUID, "freeBefore": 10 * gib, "freeAfter": 14 * gib}], save
    rc, out = _exec(tmp_path, driver, c, uid, "wake", "suspend")
    assert rc == 0 and out[-1]["outcome"] == "ok", out
    (resume,) = [o for o in out if o.get("step") == "resume"]
    assert resume["gpus"] == [{"uuid": GPU_UUID, "freeBefore": 14 * gib, "freeAfter": 10 * gib}], resume
    assert c.counting()


def test_a_look_at_a_sleeping_worker_does_not_ask_the_driver(container: tuple[Container, StubDriver],
                                                             tmp_path: Path) -> None:
    """While the entrypoint says suspended, the planner's next step does not depend on the driver's
    answer (tests/unit/test_agent_plan.py), so a look at a sleeping worker runs no helper: every
    resync of every sleeping worker on a node would otherwise start one per GPU process. The wake
    still asks, for the step that resumes it."""
    c, driver = container
    uid = str(uuid.uuid4())
    rc, out = _exec(tmp_path, driver, c, uid, "capture", "suspend", "--quiesced")
    assert rc == 0 and out[-1]["state"] == "Suspended", out
    n = len(driver.queries())
    rc, out = _exec(tmp_path, driver, c, uid, "capture", "suspend", "--quiesced")  # already asleep: a look
    assert rc == 0 and out[-1]["state"] == "Suspended" and len(out) == 1, out
    assert driver.queries()[n:] == [], "a look at a suspended worker asked the driver"
    rc, out = _exec(tmp_path, driver, c, uid, "wake", "suspend")
    assert rc == 0 and [o.get("step") for o in out[:-1]] == ["wake", "resume", "settle-active"], out
    assert any(state == 2 for _, state in driver.queries()[n:]), "the wake resumed without asking"
    assert c.counting()


def test_exec_refuses_a_capture_not_confirmed_out_of_serving(container: tuple[Container, StubDriver],
                                                             tmp_path: Path) -> None:
    c, driver = container
    rc, out = _exec(tmp_path, driver, c, str(uuid.uuid4()), "capture", "suspend")
    assert rc == 1 and out[-1]["error"]["reason"] == "WorkerServing" and out[-1]["state"] == "Active", out
    assert out[-1]["error"]["changed"] is False and not driver.calls()
    assert c.counting()
