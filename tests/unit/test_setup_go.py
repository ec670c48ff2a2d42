"""How setup gets a go new enough for its builds (hack/lib-gotoolchain.sh): fake `go`
scripts on PATH print old versions, apt-get and curl are stubs that record their argv,
and the one real download is a fake golang.org/toolchain zip served from 127.0.0.1.
Nothing here contacts the network or touches the real cache."""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PINS = dict(re.findall(r"^(GO_\w+)=(\S+)", (ROOT / "hack/versions.env").read_text(), re.M))
GO_VERSION, GO_MIN = _PINS["GO_VERSION"], _PINS["GO_MIN_VERSION"]
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), "")
SYS_PATH = "/usr/bin:/bin"


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _bash(script: str, tmp: Path, *, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """Source hack/setup.sh and run script with only these variables set."""
    base = {"PATH": path or f"{tmp / 'stub'}:{SYS_PATH}", "HOME": str(tmp), "LC_ALL": "C.UTF-8",
            "DYNSNAP_CACHE": str(tmp / "cache"), "DYNSNAP_PYTHON": sys.executable, "ROOT": str(ROOT),
            "CALLS": str(tmp / "calls.log")}
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "$ROOT/hack/setup.sh"\n{script}'],
                          env=base | env, capture_output=True, text=True, timeout=60, check=False)


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _fake_go(path: Path, version: str, *, switches: bool = False) -> Path:
    """A go that logs its calls to $CALLS; with switches, GOTOOLCHAIN=goX makes it report X."""
    report = f"v=go{version}\n"
    if switches:
        report += '[ -n "$GOTOOLCHAIN" ] && [ "${GOTOOLCHAIN#go1}" != "$GOTOOLCHAIN" ] && v=$GOTOOLCHAIN\n'
    return _script(path, 'echo "go GOTOOLCHAIN=$GOTOOLCHAIN $*" >> "$CALLS"\n' + report +
                   'case "$1" in\n'
                   '  version) echo "go version $v linux/amd64" ;;\n'
                   '  env) [ "$2" = GOSUMDB ] && echo sum.golang.org; [ "$2" = GOPROXY ] && echo direct ;;\n'
                   '  *) exit 2 ;;\n'
                   'esac\n')


def _recorder(path: Path, name: str, rc: int = 0) -> None:
    _script(path, f'echo "{name} $*" >> "$CALLS"\nexit {rc}\n')


def _calls(tmp: Path) -> list[str]:
    f = tmp / "calls.log"
    return f.read_text().splitlines() if f.exists() else []


def _env_after(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


SHOW = 'setup_go; echo "GOTOOLCHAIN=${GOTOOLCHAIN:-}"; echo "GOROOT=${GOROOT:-}"; echo "PATH=$PATH"; ' \
       'echo "DYNSNAP_GO=$DYNSNAP_GO"'


# --- deciding --------------------------------------------------------------------------


@pytest.mark.parametrize(("out", "want"), [
    ("go version go1.19.8 linux/amd64", "1.19.8"),
    ("go version go1.19 linux/amd64", "1.19.0"),
    ("go version go1.26.8 linux/arm64", "1.26.8"),
    ("go version go1.27rc1 linux/amd64", "1.27.0"),
])
def test_go_version_is_read_as_three_numbers(tmp_path: Path, out: str, want: str) -> None:
    _script(tmp_path / "stub" / "go", f"echo {_q(out)}\n")
    proc = _bash("_go_version", tmp_path)
    assert (proc.returncode, proc.stdout) == (0, want + "\n"), proc.stderr


@pytest.mark.parametrize(("a", "b", "ge"), [
    ("1.26.8", "1.26.0", True), ("1.26.0", "1.26.0", True), ("1.25.9", "1.26.0", False),
    ("1.9.0", "1.21.0", False), ("1.21.0", "1.21.0", True), ("1.100.0", "1.26.0", True),
])
def test_version_order(tmp_path: Path, a: str, b: str, ge: bool) -> None:
    assert (_bash(f"_version_ge {a} {b}", tmp_path).returncode == 0) is ge


def test_go_at_or_above_the_minimum_is_used_as_is(tmp_path: Path) -> None:
    stub = tmp_path / "stub"
    go = _fake_go(stub / "go", GO_MIN)
    _recorder(stub / "curl", "curl", 7)
    _recorder(stub / "apt-get", "apt-get", 100)
    proc = _bash(SHOW, tmp_path)
    assert proc.returncode == 0, proc.stderr
    env = _env_after(proc)
    assert env["GOTOOLCHAIN"] == "" and env["GOROOT"] == ""
    assert env["PATH"] == f"{stub}:{SYS_PATH}"
    assert env["DYNSNAP_GO"] == str(go)
    assert _calls(tmp_path) == ["go GOTOOLCHAIN= version"]
    assert f"go {GO_MIN}: {go} (>= {GO_MIN} needed)" in proc.stderr


def test_go_1_21_or_later_but_too_old_switches_toolchain(tmp_path: Path) -> None:
    stub = tmp_path / "stub"
    _fake_go(stub / "go", "1.22.1", switches=True)
    _recorder(stub / "curl", "curl", 7)
    _recorder(stub / "apt-get", "apt-get", 100)
    proc = _bash(SHOW + '; go version', tmp_path)
    assert proc.returncode == 0, proc.stderr
    env = _env_after(proc)
    assert env["GOTOOLCHAIN"] == f"go{GO_VERSION}"
    assert env["GOROOT"] == "" and env["PATH"] == f"{stub}:{SYS_PATH}"  # the system's go stays first
    assert proc.stdout.splitlines()[-1] == f"go version go{GO_VERSION} linux/amd64"
    assert _calls(tmp_path)[:2] == ["go GOTOOLCHAIN= version", f"go GOTOOLCHAIN=go{GO_VERSION} version"]
    assert not any(c.startswith(("curl", "apt-get")) for c in _calls(tmp_path))
    assert f"GOTOOLCHAIN=go{GO_VERSION}" in proc.stderr


def test_a_toolchain_switch_that_does_not_happen_fails(tmp_path: Path) -> None:
    _fake_go(tmp_path / "stub" / "go", "1.22.1", switches=False)
    proc = _bash(SHOW, tmp_path)
    assert proc.returncode == 1
    assert f"GOTOOLCHAIN=go{GO_VERSION}, yet go reports 1.22.1" in proc.stderr


def test_missing_go_without_apt_says_what_to_install(tmp_path: Path) -> None:
    # A PATH holding only what sourcing setup.sh needs: no go, no apt-get.
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("bash", "dirname", "mkdir"):
        found = shutil.which(tool, path=SYS_PATH)
        assert found, tool
        (tools / tool).symlink_to(found)
    proc = _bash("setup_go", tmp_path, path=str(tools))
    assert proc.returncode == 1
    assert f"go is not installed: install Go >= {GO_MIN}" in proc.stderr


# --- fetching a toolchain for a go older than 1.21 ------------------------------------


def _h1(files: dict[str, bytes]) -> str:
    summary = "".join(f"{hashlib.sha256(files[n]).hexdigest()}  {n}\n" for n in sorted(files))
    return "h1:" + base64.b64encode(hashlib.sha256(summary.encode()).digest()).decode()


class _Proxy:
    """A module proxy on 127.0.0.1 serving a fake golang.org/toolchain; records requests."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[str] = []
        requests = self.requests

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
                requests.append(self.path)

            def log_message(self, format: str, *args: object) -> None:
                pass

        root.mkdir(parents=True, exist_ok=True)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def publish(self, version: str, *, says: str | None = None, sumdb: str | None = "right") -> str:
        """Publish golang.org/toolchain@v0.0.1-go<version>.linux-<ARCH>; return its h1: hash."""
        ver = f"v0.0.1-go{version}.linux-{ARCH}"
        prefix = f"golang.org/toolchain@{ver}/"
        go = f'#!/bin/sh\necho "go version go{says or version} linux/{ARCH}"\n'.encode()
        files = {prefix + "bin/go": go, prefix + "bin/gofmt": b"#!/bin/sh\n",
                 prefix + f"pkg/tool/linux_{ARCH}/compile": b"#!/bin/sh\n", prefix + "go.env": b"GOTOOLCHAIN=auto\n",
                 prefix + "lib/wasm/go_js_wasm_exec": b"#!/bin/sh\n", prefix + "src/fmt/print.go": b"package fmt\n"}
        at = self.root / "golang.org/toolchain/@v"
        at.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(at / f"{ver}.zip", "w") as z:
            for name, data in files.items():
                z.writestr(name, data)
        (at / f"{ver}.info").write_text(f'{{"Version":"{ver}","Time":"2026-01-01T00:00:00Z"}}\n')
        (at / f"{ver}.mod").write_text("module golang.org/toolchain")
        h1 = _h1(files)
        if sumdb is not None:
            lookup = self.root / "sumdb/sum.golang.org/lookup/golang.org"
            lookup.mkdir(parents=True, exist_ok=True)
            line = h1 if sumdb == "right" else sumdb
            (lookup / f"toolchain@{ver}").write_text(
                f"123\ngolang.org/toolchain {ver} {line}\ngolang.org/toolchain {ver}/go.mod h1:x=\n\n"
                "go.sum database tree\n1\nabc=\n\n— sum.golang.org sig\n")
        return h1


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[_Proxy]:
    if not ARCH:
        pytest.skip(f"no fake toolchain for machine type {platform.machine()}")
    p = _Proxy(tmp_path / "proxy")
    yield p
    p.server.shutdown()
    p.server.server_close()


def _old_go(tmp: Path) -> Path:
    return _fake_go(tmp / "stub" / "go", "1.19.8")


def test_old_go_gets_the_toolchain_zip_unpacked_and_first_on_path(tmp_path: Path, proxy: _Proxy) -> None:
    _old_go(tmp_path)
    h1 = proxy.publish(GO_VERSION)
    proc = _bash(SHOW + "; go version", tmp_path, DYNSNAP_GOPROXY=proxy.url + "/,direct")
    assert proc.returncode == 0, proc.stderr
    dest = tmp_path / "cache" / f"go-{GO_VERSION}"
    env = _env_after(proc)
    assert env["PATH"].split(":")[0] == str(dest / "bin")
    assert env["GOROOT"] == str(dest) and env["GOTOOLCHAIN"] == ""
    assert env["DYNSNAP_GO"] == str(dest / "bin" / "go")
    assert proc.stdout.splitlines()[-1] == f"go version go{GO_VERSION} linux/{ARCH}"
    # Executable as the go command marks them; data files stay as they are.
    for tool in ("bin/go", "bin/gofmt", f"pkg/tool/linux_{ARCH}/compile", "lib/wasm/go_js_wasm_exec"):
        assert (dest / tool).stat().st_mode & stat.S_IXUSR, tool
    assert not (dest / "src/fmt/print.go").stat().st_mode & stat.S_IXUSR
    assert (dest / ".complete").exists() and not Path(f"{dest}.tmp").exists()
    ver = f"v0.0.1-go{GO_VERSION}.linux-{ARCH}"
    assert proxy.requests == [f"/golang.org/toolchain/@v/{ver}.info", f"/golang.org/toolchain/@v/{ver}.mod",
                              f"/golang.org/toolchain/@v/{ver}.zip",
                              f"/sumdb/sum.golang.org/lookup/golang.org/toolchain@{ver}"]
    assert h1 in proc.stderr  # checked against the checksum database line

    # Warm: the cache answers; curl (a failing recorder first on PATH) is never run.
    warm = tmp_path / "warm"
    _recorder(warm / "curl", "curl", 7)
    again = _bash(SHOW + "; go version", tmp_path, path=f"{warm}:{tmp_path / 'stub'}:{SYS_PATH}",
                  DYNSNAP_GOPROXY=proxy.url)
    assert again.returncode == 0, again.stderr
    assert f"go {GO_VERSION}: cached ({dest})" in again.stderr
    assert not any(c.startswith("curl") for c in _calls(tmp_path))
    assert len(proxy.requests) == 4
    assert again.stdout.splitlines()[-1] == f"go version go{GO_VERSION} linux/{ARCH}"


@pytest.mark.skipif(os.geteuid() != 0, reason="setup installs go as root")
def test_missing_go_installs_debian_golang_go_then_fetches(tmp_path: Path, proxy: _Proxy) -> None:
    if Path("/usr/bin/go").exists() or Path("/bin/go").exists():
        pytest.skip("a go is installed in /usr/bin")
    stub = tmp_path / "stub"
    old = _fake_go(tmp_path / "debian-go", "1.19.8")  # what bookworm's golang-go brings
    install = f"cp {_q(str(old))} {_q(str(stub / 'go'))}"
    _script(stub / "apt-get", f'echo "apt-get $*" >> "$CALLS"\ncase "$*" in *"install "*golang-go*) {install};; esac\n')
    proxy.publish(GO_VERSION)
    proc = _bash(SHOW, tmp_path, DYNSNAP_GOPROXY=proxy.url)
    assert proc.returncode == 0, proc.stderr
    apt = [c for c in _calls(tmp_path) if c.startswith("apt-get")]
    assert apt == ["apt-get update -qq", "apt-get install -y -qq --no-install-recommends golang-go"]
    assert _env_after(proc)["PATH"].split(":")[0] == str(tmp_path / "cache" / f"go-{GO_VERSION}" / "bin")
    assert "go: not installed; apt-get install golang-go" in proc.stderr


def test_a_zip_the_checksum_database_disagrees_with_is_refused(tmp_path: Path, proxy: _Proxy) -> None:
    _old_go(tmp_path)
    proxy.publish(GO_VERSION, sumdb="h1:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")
    proc = _bash(SHOW, tmp_path, DYNSNAP_GOPROXY=proxy.url)
    assert proc.returncode == 1
    assert "the checksum database says h1:AAAA" in proc.stderr
    assert not (tmp_path / "cache" / f"go-{GO_VERSION}").exists()


def test_without_a_checksum_database_line_it_warns_and_checks_the_rest(tmp_path: Path, proxy: _Proxy) -> None:
    _old_go(tmp_path)
    proxy.publish(GO_VERSION, sumdb=None)
    proc = _bash(SHOW, tmp_path, DYNSNAP_GOPROXY=proxy.url)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" in proc.stderr and "no checksum database line" in proc.stderr
    assert (tmp_path / "cache" / f"go-{GO_VERSION}" / ".complete").exists()


def test_a_toolchain_reporting_another_version_is_refused(tmp_path: Path, proxy: _Proxy) -> None:
    _old_go(tmp_path)
    proxy.publish(GO_VERSION, says="1.26.7")
    proc = _bash(SHOW, tmp_path, DYNSNAP_GOPROXY=proxy.url)
    assert proc.returncode == 1
    assert f"not go{GO_VERSION} linux/{ARCH}" in proc.stderr
    assert not (tmp_path / "cache" / f"go-{GO_VERSION}").exists()


def test_old_go_with_only_direct_fails_before_any_download(tmp_path: Path) -> None:
    _old_go(tmp_path)  # its `go env GOPROXY` says direct
    _recorder(tmp_path / "stub" / "curl", "curl", 7)
    proc = _bash(SHOW, tmp_path)
    assert proc.returncode == 1
    assert "no Go module proxy URL in go env GOPROXY ('direct')" in proc.stderr
    assert not any(c.startswith("curl") for c in _calls(tmp_path))


def test_zip_hash_matches_the_go_command(tmp_path: Path) -> None:
    # The go command (go1.26.8 `go mod download` from a file:// proxy) computed this h1:
    # for exactly these entries; zip metadata does not enter the hash.
    files = {"go.mod": b"module example.com/fixture\n", "bin/tool": b"#!/bin/sh\necho fixture\n",
             "README": b"a fixture module zip\n", "pkg/tool/linux_amd64/compile": b"not a compiler\n"}
    z = tmp_path / "fixture.zip"
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_DEFLATED) as f:
        for name, data in files.items():
            f.writestr("example.com/fixture@v1.0.0/" + name, data)
    proc = _bash(f"_go_zip_unpack {z} example.com/fixture@v1.0.0 {tmp_path / 'out'}", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "h1:BqnDXb2EfERoS8lh+GyaxygGzpvROgQJRiPqPBgNzyY=\n"
    assert (tmp_path / "out/pkg/tool/linux_amd64/compile").read_bytes() == b"not a compiler\n"


def test_a_zip_entry_outside_the_module_is_refused(tmp_path: Path) -> None:
    z = tmp_path / "evil.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("golang.org/toolchain@v0.0.1-go1.26.8.linux-amd64/../../escape", b"x")
    proc = _bash(f"_go_zip_unpack {z} golang.org/toolchain@v0.0.1-go1.26.8.linux-amd64 {tmp_path / 'out'}",
                 tmp_path)
    assert proc.returncode != 0
    assert "unexpected entry" in proc.stderr
    assert not (tmp_path / "escape").exists()
