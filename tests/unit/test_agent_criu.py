"""How the agent names CRIU's files to a CRIU running in a worker's mount namespace
(dynsnap/agent/criu.py): the loader from the binary's PT_INTERP, the library directories from the
loader's ``--list``, everything as ``/proc/self/fd/N`` of descriptors opened for the run and closed
after it; a script by path.
The real CRIU in a worker without any of it: tests/integration/node/test_agent.py (the real node)."""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import tempfile
from pathlib import Path

import pytest

from dynsnap.agent import criu as criu_mod
from dynsnap.agent.criu import (
    CriuError,
    CriuOptions,
    NotElf,
    PagesRead,
    _common,
    _env,
    _Files,
    _launch,
    elf_interpreter,
    library_dirs,
    pages_read,
)
from dynsnap.models.ids import HostPid, NsPid
from dynsnap.runtime.command import CommandResult


def _elf(path: Path, *, cls: int, endian: str, interp: bytes | None) -> Path:
    """A minimal ELF file: header, one program header (PT_INTERP, or PT_LOAD when ``interp`` is None)."""
    e = "<" if endian == "little" else ">"
    if cls == 2:
        ehdr = bytearray(64)
        phsize, phoff = 56, 64
        struct.pack_into(e + "Q", ehdr, 0x20, phoff)
        struct.pack_into(e + "HH", ehdr, 0x36, phsize, 1)
        ph = bytearray(phsize)
        data_at = phoff + phsize
        struct.pack_into(e + "I", ph, 0, 3 if interp else 1)
        struct.pack_into(e + "Q", ph, 8, data_at)
        struct.pack_into(e + "Q", ph, 0x20, len(interp or b"") + 1)
    else:
        ehdr = bytearray(52)
        phsize, phoff = 32, 52
        struct.pack_into(e + "I", ehdr, 0x1C, phoff)
        struct.pack_into(e + "HH", ehdr, 0x2A, phsize, 1)
        ph = bytearray(phsize)
        data_at = phoff + phsize
        struct.pack_into(e + "I", ph, 0, 3 if interp else 1)
        struct.pack_into(e + "I", ph, 4, data_at)
        struct.pack_into(e + "I", ph, 0x10, len(interp or b"") + 1)
    ehdr[:6] = b"\x7fELF" + bytes([cls, 1 if endian == "little" else 2])
    path.write_bytes(bytes(ehdr) + bytes(ph) + (interp or b"") + b"\0")
    return path


def _interp_of(path: Path) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return elf_interpreter(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("cls", "endian"), [(2, "little"), (2, "big"), (1, "little"), (1, "big")])
def test_elf_interpreter_reads_pt_interp_or_none_for_a_static_binary(tmp_path: Path, cls: int, endian: str) -> None:
    dynamic = _elf(tmp_path / "dyn", cls=cls, endian=endian, interp=b"/opt/agent/ld.so")
    static = _elf(tmp_path / "static", cls=cls, endian=endian, interp=None)
    assert _interp_of(dynamic) == "/opt/agent/ld.so"
    assert _interp_of(static) is None


def test_elf_interpreter_refuses_a_script(tmp_path: Path) -> None:
    script = tmp_path / "criu"
    script.write_text("#!/bin/sh\nexec criu \"$@\"\n")
    with pytest.raises(NotElf):
        _interp_of(script)


def test_library_dirs_in_order_without_the_vdso_or_the_loader() -> None:
    listing = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibbsd.so.0 => /opt/criu/lib/libbsd.so.0 (0x00007f01)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f02)
\tlibnl-3.so.200 => /opt/criu/lib/libnl-3.so.200 (0x00007f03)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f04)
"""
    assert library_dirs(listing) == ["/opt/criu/lib", "/lib/x86_64-linux-gnu"]
    with pytest.raises(ValueError, match=r"libnet\.so\.1 is not found"):
        library_dirs("\tlibnet.so.1 => not found\n")


def _real_dynamic_binary() -> str:
    exe = os.path.realpath(sys.executable)
    fd = os.open(exe, os.O_RDONLY)
    try:
        if elf_interpreter(fd) is None:
            pytest.skip("this Python is linked statically")
    finally:
        os.close(fd)
    return exe


def _fd_path(arg: str) -> int:
    assert arg.startswith("/proc/self/fd/"), arg
    return int(arg.removeprefix("/proc/self/fd/"))


def test_a_dynamic_criu_is_named_by_descriptors_opened_for_the_run(tmp_path: Path) -> None:
    exe = _real_dynamic_binary()
    images, plugins = tmp_path / "images", tmp_path / "plugins"
    images.mkdir()
    plugins.mkdir()
    files = _Files()
    try:
        at = asyncio.run(_launch(CriuOptions(binary=exe, libdir=str(plugins)), images, files, timeout=30,
                                 log_path=images / "dump.log"))
        loader, inhibit, flag, lib_path, argv0_flag, argv0, binary = at.argv
        assert (inhibit, flag, argv0_flag, argv0) == ("--inhibit-cache", "--library-path", "--argv0", exe)
        fds = {_fd_path(loader), _fd_path(binary), _fd_path(at.images), _fd_path(str(at.libdir)),
               *(_fd_path(d) for d in lib_path.split(":"))}
        assert fds == set(files.fds)
        with open(exe, "rb") as f:
            assert os.path.realpath(f"/proc/self/fd/{_fd_path(loader)}") == os.path.realpath(
                elf_interpreter(f.fileno()) or "")
        assert os.path.realpath(f"/proc/self/fd/{_fd_path(binary)}") == exe
        assert os.readlink(at.images) == str(images)
        assert os.readlink(str(at.libdir)) == str(plugins)
        assert all(os.get_inheritable(fd) is False for fd in files.fds)  # passed to CRIU's nsenter alone
    finally:
        held = list(files.fds)
        files.close()
    for fd in held:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_without_a_plugin_directory_none_is_named(tmp_path: Path) -> None:
    exe = _real_dynamic_binary()
    files = _Files()
    try:
        at = asyncio.run(_launch(CriuOptions(binary=exe), tmp_path, files, timeout=30, log_path=tmp_path / "dump.log"))
        assert at.libdir is None
    finally:
        files.close()


def test_a_script_is_refused(tmp_path: Path) -> None:
    """A wrapper script could only run by its path, a file of the worker's container: refused, nothing
    left open."""
    script = tmp_path / "fake_criu"
    script.write_text("#!/bin/sh\nexec criu \"$@\"\n")
    script.chmod(0o755)
    files = _Files()
    with pytest.raises(CriuError, match=r"is not an ELF binary: the agent starts CRIU .* from descriptors"):
        asyncio.run(_launch(CriuOptions(binary=str(script), libdir="/opt/criu/lib/criu"), tmp_path, files,
                            timeout=30, log_path=tmp_path / "dump.log"))
    files.close()


def test_a_missing_criu_is_a_criu_error(tmp_path: Path) -> None:
    files = _Files()
    with pytest.raises(CriuError, match="No such file"):
        asyncio.run(_launch(CriuOptions(binary=str(tmp_path / "nope")), tmp_path, files, timeout=30,
                            log_path=tmp_path / "dump.log"))
    assert files.fds == []


def test_pages_read_sums_the_restorers_lines_and_is_none_for_stocks_loop(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    log.write_text("(00.04) pie: 15: dynsnap: reading 545361920 bytes of pages with 4 threads\n"
                   "(00.11) pie: 15: dynsnap: read 545361920 bytes of pages with 4 threads\n"
                   "(00.12) pie: 16: dynsnap: read 1048576 bytes of pages with 2 threads\n")
    assert pages_read(log) == PagesRead(bytes=545361920 + 1048576, threads=4, processes=2)
    log.write_text("(00.04) pie: 15: Preadv 0x7f00:4096... (3 iovs)\n")  # stock CRIU's loop, at -v4
    assert pages_read(log) is None
    assert pages_read(tmp_path / "missing.log") is None


def test_criu_reads_no_configuration_file_of_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU runs in the worker's mount namespace: its default files (/etc/criu/default.conf,
    $HOME/.criu/default.conf) and a CRIU_CONFIG_FILE path would be the pod author's files. Every run
    says --no-default-config, and neither the agent's environment nor the options pass CRIU_CONFIG_FILE,
    CRIU_LIBS_DIR (a plugin directory, looked up there too) or LD_LIBRARY_PATH on."""
    monkeypatch.setenv("CRIU_CONFIG_FILE", "/etc/criu/planted.conf")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/elsewhere")
    monkeypatch.setenv("CRIU_LIBS_DIR", "/usr/lib/criu")
    opts = CriuOptions(binary="criu", env={"CRIU_CONFIG_FILE": "/x.conf", "LD_LIBRARY_PATH": "/y", "KEEP": "1"})
    assert "--no-default-config" in _common(opts)
    env = _env(opts, "/opt/criu/bin")
    assert "CRIU_CONFIG_FILE" not in env and "LD_LIBRARY_PATH" not in env and "CRIU_LIBS_DIR" not in env
    assert env["KEEP"] == "1" and env["PATH"] == "/opt/criu/bin"


def _seen_by_criu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, opts: CriuOptions) -> dict[str, object]:
    """What one dump hands its CRIU (argv, environment, descriptors), and what the PATH it gets holds
    while it runs; nothing is run (run_command replaced)."""
    seen: dict[str, object] = {}

    async def fake_run(argv: list[str], **kw: object) -> CommandResult:
        if "--list" in argv:  # the loader's account of CRIU's libraries: none needed here
            return CommandResult(0, "", "")
        env = kw["env"]
        assert isinstance(env, dict)
        seen.update(argv=argv, env=env, fds=list(kw["pass_fds"]))
        path = env["PATH"]
        seen["path_holds"] = os.listdir(path) if os.path.isdir(path) else None
        return CommandResult(0, "", "")
    monkeypatch.setattr(criu_mod, "run_command", fake_run)
    asyncio.run(criu_mod.criu_dump(criu_mod.NamespaceTarget(HostPid(1)), NsPid(10000), tmp_path / "img",
                                   opts=opts, timeout=30))
    return seen


def test_criu_gets_a_path_with_nothing_of_the_workers_on_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CRIU runs in the worker's mount namespace as the node's root: a PATH of directories would name the
    container's files (its CUDA plugin runs cuda-checkpoint from it), as would its compiled-in plugin
    directory. With no PATH and no plugin directory in the options (the plugin off), CRIU's PATH and
    --libdir are one empty directory of the agent's, named by a descriptor handed to CRIU alone, and gone
    after the run."""
    exe = _real_dynamic_binary()
    before = set(Path(tempfile.gettempdir()).glob("dynsnap-criu-path-*"))  # (those of agents killed mid-run)
    seen = _seen_by_criu(monkeypatch, tmp_path, CriuOptions(binary=exe))
    env = seen["env"]
    assert isinstance(env, dict)
    path = env["PATH"]
    assert path.startswith("/proc/self/fd/") and ":" not in path, path
    assert int(path.removeprefix("/proc/self/fd/")) in seen["fds"]
    assert seen["path_holds"] == [], "an empty directory"
    argv = seen["argv"]
    assert isinstance(argv, list)
    # No plugin directory in the options: the same empty directory, never CRIU's compiled-in one (which
    # CRIU would look up in the container).
    assert argv[argv.index("--libdir") + 1] == path
    assert set(Path(tempfile.gettempdir()).glob("dynsnap-criu-path-*")) == before, "removed after the run"
    # Named in the options (the plugin on: the helper's directory alone), it is what CRIU gets.
    seen = _seen_by_criu(monkeypatch, tmp_path, CriuOptions(binary=exe, path="/opt/dynsnap/bin"))
    assert seen["env"]["PATH"] == "/opt/dynsnap/bin"
