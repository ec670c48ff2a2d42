"""The CRIU the project builds carries its patches (hack/patches/criu/), and each does what it
claims on this kernel.

0001: a private anonymous mapping the process had marked MADV_HUGEPAGE (what libdynsnap-thp
does to the CUDA driver's host copy) comes back from ``criu restore`` on huge pages, with its
bytes intact. Stock CRIU 4.2.1 marks it only after reading the pages in, so the restored
mapping is on 4 KiB pages (AnonHugePages 0 right after the restore; measured against the
unpatched build, docs/CRIU_PATCHES.md), which is both the slower restore and the slower CUDA
resume after it (docs/BENCHMARKS.md, "CRIU's restore onto huge pages").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SIZE_MIB = 64  # 32 huge pages

# The process the CRIU restore bench dumps and restores (a MADV_HUGEPAGE mapping with a pattern, its
# AnonHugePages and a pattern check on request), as tests/gpu runs bench/gpu/worker.py.
HOLDER = Path(__file__).resolve().parents[2] / "bench" / "criu_restore" / "holder.py"


def _criu() -> Path:
    criu = os.environ.get("DYNSNAP_CRIU", "")
    if not criu or not os.access(criu, os.X_OK):
        pytest.fail("CRIU not built: DYNSNAP_CRIU is unset or not executable; run ./run setup")
    return Path(criu)


def _thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1:text.index("]")]


def _wait(path: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"no {path.name} within {timeout:.0f} s")


def test_a_hugepage_mapping_is_restored_on_huge_pages(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU dumps and restores as root")
    if _thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this kernel ('never'): nothing to restore onto")
    criu = _criu()
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    holder = subprocess.Popen([sys.executable, str(HOLDER), str(tmp_path), str(SIZE_MIB)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, cwd=tmp_path)
    restored = 0
    try:
        before = _wait(tmp_path / "ready")
        if before["anon_huge_kib"] < SIZE_MIB * 1024 // 2:
            pytest.skip(f"the kernel gave the live process only {before['anon_huge_kib']} KiB of huge pages "
                        "(fragmented memory): nothing to compare the restore with")
        subprocess.run([str(criu), "dump", "-t", str(holder.pid), "-D", str(images), "-o", "dump.log"],
                       check=True, timeout=120, stdin=subprocess.DEVNULL)
        holder.wait(timeout=30)
        subprocess.run([str(criu), "restore", "-D", str(images), "-o", "restore.log", "--restore-detached",
                        "--pidfile", str(tmp_path / "restored.pid")], check=True, timeout=120,
                       stdin=subprocess.DEVNULL)
        restored = int((tmp_path / "restored.pid").read_text())
        (tmp_path / "verify").touch()
        after = _wait(tmp_path / "verified")
        assert after["pid"] == before["pid"] == restored
        assert after["ok"], "the restored mapping's bytes differ from the dumped ones"
        # Right after the restore, before khugepaged could collapse anything: on huge pages as
        # when dumped (stock CRIU: 0 KiB here).
        assert after["anon_huge_kib"] >= before["anon_huge_kib"] * 9 // 10, (before, after)
    finally:
        for pid in (holder.pid, restored):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if holder.poll() is None:
            holder.wait(timeout=30)
