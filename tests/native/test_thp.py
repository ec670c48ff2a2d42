"""libdynsnap-thp.so (native/thp/dynsnap-thp.c) in a small process of its own: which mmap calls it takes
over and what the caller gets back.

Each case is a fresh Python process with the library in LD_PRELOAD that makes one mmap call through
libc (ctypes: the dynamic symbol, as the CUDA driver calls it) and reports the address, errno, which
pages are resident (mincore: exact for the range, whatever the kernel merged it with) and the
mapping's smaps entry. Failures are produced on demand with a seccomp filter in that process that
answers one system call with one errno (an old kernel without MADV_POPULATE_WRITE answers EINVAL).
The checkpoint path itself (the stub driver's host copy inside a worker under dynsnap-entrypoint) is
tests/native/test_entrypoint.py.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
MIB = 1 << 20

PRIVATE, SHARED, ANON, POPULATE, FIXED = 0x02, 0x01, 0x20, 0x8000, 0x10
RW, RO = 3, 1
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
# seccomp_data: nr at 0, args[i] at 16 + 8 * i (low word first, little-endian)
NR = {"x86_64": {"mmap": 9, "madvise": 28}, "aarch64": {"mmap": 222, "madvise": 233}}.get(platform.machine())

PROBE = textwrap.dedent(r'''
    import ctypes, json, os, struct, sys
    req = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    if req["deny"]:
        # classic BPF: the named syscall with every (offset, value) matching gets the errno, the rest pass
        nr, conds, err = req["deny"]
        prog = [(0x20, 0, 0, 0), (0x15, 0, 0, nr)]
        for off, val in conds:
            prog += [(0x20, 0, 0, off), (0x15, 0, 0, val)]
        prog += [(0x06, 0, 0, 0x00050000 | err), (0x06, 0, 0, 0x7FFF0000)]
        allow = len(prog) - 1
        prog = [(c, 0, allow - i - 1, k) if c == 0x15 else (c, t, f, k) for i, (c, t, f, k) in enumerate(prog)]
        raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
        buf = ctypes.create_string_buffer(raw)
        fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(buf))
        assert libc.prctl(38, 1, 0, 0, 0) == 0                       # PR_SET_NO_NEW_PRIVS
        assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER
    ctypes.set_errno(4321)  # what the caller had before the call: must be what it has after a success
    addr = libc.mmap(None, req["len"], req["prot"], req["flags"], -1, 0)
    err = ctypes.get_errno()
    out = {"addr": addr, "errno": err}
    if addr not in (None, ctypes.c_void_p(-1).value):
        pages = (req["len"] + 4095) // 4096
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(ctypes.c_void_p(addr), req["len"], vec) == 0
        out["resident"] = sum(b & 1 for b in vec.raw) * 4096
        if req["prot"] & 2:
            ctypes.memset(addr + req["len"] - 1, 7, 1)  # usable: the last byte takes a write
        cur = None
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = {"lo": lo, "hi": hi} if lo <= addr < hi else None
                if cur:
                    out["vma"] = cur
            elif cur is not None:
                k, _, v = line.partition(":")
                cur[k] = v.strip()
    print(json.dumps(out))
''')


@pytest.fixture(scope="session")
def thp_lib() -> Path:
    subprocess.run(["make", "-s", "-C", str(ROOT / "native"), f"BUILD={BUILD}", "thp"], check=True)
    return BUILD / "libdynsnap-thp.so"


def thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return re.search(r"\[(\w+)\]", text).group(1)  # type: ignore[union-attr]


def probe(lib: Path | None, length: int, flags: int, *, prot: int = RW, env: dict[str, str] | None = None,
          deny: tuple[str, list[tuple[int, int]], int] | None = None) -> dict[str, Any]:
    spec = None
    if deny:
        assert NR is not None, f"no syscall numbers for {platform.machine()}"
        spec = [NR[deny[0]], deny[1], deny[2]]
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DYNSNAP_THP_MIN")}
    if lib:
        full["LD_PRELOAD"] = str(lib)
    full.update(env or {})
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps({"len": length, "prot": prot, "flags": flags,
                                                                 "deny": spec})],
                       env=full, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def huge(out: dict[str, Any]) -> bool:
    return "hg" in out["vma"]["VmFlags"].split()


def anon_huge(out: dict[str, Any]) -> int:
    return int(out["vma"]["AnonHugePages"].split()[0]) << 10


def test_a_large_private_populate_mapping_lands_on_huge_pages_fully_resident(thp_lib: Path) -> None:
    n = 128 * MIB
    out = probe(thp_lib, n, PRIVATE | ANON | POPULATE)  # 0x8022: the driver's host copy
    assert out["errno"] == 4321
    assert out["resident"] == n  # MAP_POPULATE's promise, kept by the prefault
    assert huge(out)
    assert (out["vma"]["lo"], out["vma"]["hi"]) == (out["addr"], out["addr"] + n)
    if thp_mode() != "never":
        assert anon_huge(out) > 0, out["vma"]
    # the same call without the library: resident too, never marked, no huge page where THP is madvise
    plain = probe(None, n, PRIVATE | ANON | POPULATE)
    assert plain["resident"] == n and not huge(plain)
    if thp_mode() == "madvise":
        assert anon_huge(plain) == 0


@pytest.mark.parametrize(("length", "flags", "prot", "resident"), [
    (32 * MIB, PRIVATE | ANON | POPULATE, RW, True),    # below the 64 MiB threshold
    (128 * MIB, PRIVATE | ANON, RW, False),              # sparse: huge pages would make it resident
    (128 * MIB, SHARED | ANON | POPULATE, RW, True),     # shared memory: not a private copy
    (128 * MIB, PRIVATE | ANON | POPULATE, RO, None),    # not writable: nothing to copy into
], ids=["below-threshold", "no-populate", "shared", "read-only"])
def test_other_mappings_are_left_exactly_as_asked(thp_lib: Path, length: int, flags: int, prot: int,
                                                  resident: bool | None) -> None:
    out = probe(thp_lib, length, flags, prot=prot)
    assert out["errno"] == 4321
    assert not huge(out)
    if resident is not None:
        assert out["resident"] == (length if resident else 0)


def test_the_threshold_comes_from_the_environment(thp_lib: Path) -> None:
    out = probe(thp_lib, 32 * MIB, PRIVATE | ANON | POPULATE, env={"DYNSNAP_THP_MIN": str(16 * MIB)})
    assert huge(out) and out["resident"] == 32 * MIB


@pytest.mark.parametrize("refused", [MADV_HUGEPAGE, MADV_POPULATE_WRITE], ids=["hugepage", "populate-write"])
def test_a_refused_madvise_falls_back_to_the_callers_own_populate_mapping(thp_lib: Path, refused: int) -> None:
    n = 96 * MIB
    out = probe(thp_lib, n, PRIVATE | ANON | POPULATE, deny=("madvise", [(32, refused)], errno.EINVAL))
    assert out["addr"] is not None and out["errno"] == 4321  # the caller sees a success, errno untouched
    assert out["resident"] == n                              # faulted in by the caller's own MAP_POPULATE
    assert not huge(out)                                     # our marked mapping was replaced, not kept


def test_a_failed_mapping_without_populate_makes_the_callers_own_call(thp_lib: Path) -> None:
    n = 96 * MIB
    out = probe(thp_lib, n, PRIVATE | ANON | POPULATE,
                deny=("mmap", [(24, n), (40, PRIVATE | ANON)], errno.ENOMEM))
    assert out["errno"] == 4321 and out["resident"] == n and not huge(out)


def test_the_library_loads_with_any_glibc(thp_lib: Path) -> None:
    # A preloaded library that needs a symbol version the worker image's glibc lacks stops the worker
    # from starting. glibc's first versions: 2.2.5 on x86_64, 2.17 on aarch64; dlsym is 2.34 today.
    out = subprocess.run(["readelf", "--version-info", "--wide", str(thp_lib)], capture_output=True, text=True,
                         check=True).stdout
    needed = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"Name: GLIBC_([0-9.]+)", out)}
    assert needed, out
    assert max(needed) <= (2, 17), out


def test_a_call_that_fails_fails_with_its_own_errno(thp_lib: Path) -> None:
    out = probe(thp_lib, 1 << 60, PRIVATE | ANON | POPULATE)  # more address space than there is
    assert out["addr"] == 2**64 - 1  # MAP_FAILED
    assert out["errno"] == errno.ENOMEM
