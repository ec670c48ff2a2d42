"""Harness for dynsnap-cuda's tests: the built CLI, the stub driver, and a view of what the
stub recorded.

The stub driver is two libraries: stub_libcuda/stub_libcuda.c stands in for libcuda (the
checkpoint API, device enumeration, a primary context's cuMemGetInfo), stub_nvml/stub_nvml.c for
NVML (free memory without a context). They share one state directory (stub_libcuda/stub_files.h):
the same fake devices and free memory, control file and call log. Both are compiled once per
session with gcc. Each test gets its own stub directory, so per-pid state, the call log,
injected faults and the fake devices never leak between tests. Tests assert outcomes: exit
codes, stdout/JSON, the per-pid state the stub ends in, and the recorded call log.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
STUB_SRC = Path(__file__).resolve().parent / "stub_libcuda" / "stub_libcuda.c"
# The library is two translation units: the checkpoint API and what a process calls on its own behalf.
STUB_SRCS = [STUB_SRC, STUB_SRC.parent / "stub_process.c"]
NVML_SRC = Path(__file__).resolve().parent / "stub_nvml" / "stub_nvml.c"

RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
STATE_WORDS = {RUNNING: "running", LOCKED: "locked", CHECKPOINTED: "checkpointed", FAILED: "failed"}
# CUresult codes the tests inject or expect.
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_READY = 600

SHORT = {
    "cuCheckpointProcessLock": "lock",
    "cuCheckpointProcessCheckpoint": "checkpoint",
    "cuCheckpointProcessRestore": "restore",
    "cuCheckpointProcessUnlock": "unlock",
}


def cuda_include() -> Path:
    """cuda.h of CUDA 13 (hack/lib-cudahdr.sh exports DYNSNAP_CUDA_INCLUDE)."""
    cands = [os.environ.get("DYNSNAP_CUDA_INCLUDE", "")]
    cache = os.environ.get("DYNSNAP_CACHE", os.path.expanduser("~/.cache/dynsnap"))
    cands += sorted(glob.glob(f"{cache}/cuda-headers-*/include"), reverse=True)
    cands.append("/usr/local/cuda/include")
    for c in cands:
        if c and (Path(c) / "cuda.h").is_file():
            return Path(c)
    pytest.fail("no cuda.h of CUDA 13: run hack/setup.sh (setup_cuda_headers) or set DYNSNAP_CUDA_INCLUDE")


def build_cli() -> Path:
    """The CLI from native/build, (re)built by its Makefile so a test run sees the current source."""
    env = {**os.environ, "DYNSNAP_CUDA_INCLUDE": str(cuda_include())}
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "cuda"), f"BUILD={BUILD}"], env=env,
                   check=True, capture_output=True)
    return BUILD / "dynsnap-cuda"


def build_stub(out: Path) -> Path:
    lib = out / "libcuda_stub.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{cuda_include()}",
                    "-o", str(lib), *map(str, STUB_SRCS)], check=True)
    return lib


def build_stub_nvml(out: Path) -> Path:
    lib = out / "libnvidia-ml_stub.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
                    f"-I{STUB_SRC.parent}", "-o", str(lib), str(NVML_SRC)], check=True)
    return lib


@dataclass
class Call:
    fn: str
    pid: int
    rc: int
    timeout: int | None
    pairs: list[tuple[str, str]] | None


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def json(self) -> list[dict]:
        """Every JSON line but the ``{"gpus": [...]}`` one (the per-pid records; --mem-info's lines)."""
        return [r for r in self.lines() if "gpus" not in r]

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.out.splitlines()]

    def gpus(self) -> list[dict] | None:
        """The ``{"gpus": [...]}`` line of a --json save or resume: each GPU's free memory before and
        after the call; None when the helper printed none."""
        found = [r["gpus"] for r in self.lines() if "gpus" in r]
        assert len(found) <= 1, self.out
        return found[0] if found else None


class Stub:
    """One test's stub driver: its state directory and the environment that points the CLI at it."""

    def __init__(self, tmp: Path, cli: Path, lib: Path, nvml: Path) -> None:
        self.dir = tmp / "stub"
        self.dir.mkdir()
        self.cli = cli
        self.records = tmp / "records"
        # DYNSNAP_LIBNVML is always set, so a machine's real NVML is never picked up.
        self.env = {**os.environ, "DYNSNAP_STUB_DIR": str(self.dir), "DYNSNAP_LIBCUDA": str(lib),
                    "DYNSNAP_LIBNVML": str(nvml), "DYNSNAP_CUDA_STATE_DIR": str(self.records)}

    def run(self, *args: str, name: str = "dynsnap-cuda", timeout: float = 60) -> Result:
        p = subprocess.run([str(self.cli.parent / name), *args], env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        return Result(p.returncode, p.stdout, p.stderr)

    def control(self, *lines: str) -> None:
        with (self.dir / "control").open("a") as f:
            f.writelines(line + "\n" for line in lines)

    def set_state(self, state: int, *pids: int) -> None:
        cur = self.states()
        cur.update(dict.fromkeys(pids, state))
        (self.dir / "state").write_text("".join(f"{p} {s}\n" for p, s in cur.items()))

    def states(self) -> dict[int, int]:
        f = self.dir / "state"
        if not f.exists():
            return {}
        return {int(p): int(s) for p, s in (line.split() for line in f.read_text().splitlines())}

    def state(self, pid: int) -> int:
        return self.states().get(pid, RUNNING)

    def set_devices(self, *devs: tuple[str, int, int]) -> None:
        """(uuid in any spelling, free bytes, total bytes) per visible GPU, in index order."""
        lines = [f"{re.sub('[^0-9a-fA-F]', '', u.removeprefix('GPU-'))} {fr} {tot}\n" for u, fr, tot in devs]
        (self.dir / "devices").write_text("".join(lines))

    def free(self, index: int) -> int:
        return int((self.dir / "devices").read_text().splitlines()[index].split()[1])

    def log(self) -> list[str]:
        f = self.dir / "log"
        return f.read_text().splitlines() if f.exists() else []

    def fns(self) -> list[str]:
        """Every logged call's function, in order: the checkpoint API, the primary-context
        memory reading (cuDevicePrimaryCtxRetain/Release, cuMemGetInfo) and NVML's."""
        return [line.split()[0] for line in self.log()]

    def calls(self) -> list[Call]:
        """Checkpoint-API calls in the order they returned."""
        out = []
        for line in self.log():
            fn, *kv = line.split()
            if not fn.startswith("cuCheckpointProcess"):
                continue
            d = dict(x.split("=", 1) for x in kv)
            pairs = None
            if "pairs" in d:
                pairs = [tuple(p.split(">")) for p in d["pairs"].split(";") if p]
            out.append(Call(SHORT.get(fn, fn), int(d["pid"]), int(d["rc"]),
                            int(d["timeout"]) if "timeout" in d else None, pairs))  # type: ignore[arg-type]
        return out

    def ops(self) -> list[tuple[str, int]]:
        return [(c.fn, c.pid) for c in self.calls()]


def hexid(uuid: str) -> str:
    """A UUID as the stub logs it: 32 lowercase hex digits."""
    return re.sub("[^0-9a-f]", "", uuid.lower().removeprefix("gpu-"))


# Fixtures; test modules import them by name.


@pytest.fixture(scope="session")
def cuda_cli() -> Path:
    return build_cli()


@pytest.fixture(scope="session")
def stub_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_stub(tmp_path_factory.mktemp("stub-libcuda"))


@pytest.fixture(scope="session")
def stub_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_stub_nvml(tmp_path_factory.mktemp("stub-nvml"))


@pytest.fixture
def stub(tmp_path: Path, cuda_cli: Path, stub_lib: Path, stub_nvml_lib: Path) -> Stub:
    return Stub(tmp_path, cuda_cli, stub_lib, stub_nvml_lib)
