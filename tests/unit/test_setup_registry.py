"""Where setup downloads from (hack/lib-registry.sh): the Go module proxy read from a
GOPROXY list the way the go command reads it, and the Debian mirror read from apt
sources (one-line and deb822) written to a temporary directory. The bash functions run
in subprocesses with a controlled environment; nothing here touches the network."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bash(script: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Source hack/setup.sh (log, die, every lib) and run script, with only env set."""
    base = {"PATH": f"{tmp / 'stub'}:/usr/bin:/bin", "HOME": str(tmp), "LC_ALL": "C.UTF-8",
            "DYNSNAP_CACHE": str(tmp / "cache"), "ROOT": str(ROOT)}
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "$ROOT/hack/setup.sh"\n{script}'],
                          env=base | env, capture_output=True, text=True, timeout=60, check=False)


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


# --- Go module proxy ---------------------------------------------------------------


@pytest.mark.parametrize(("goproxy", "url"), [
    ("https://goproxy.example,direct", "https://goproxy.example"),
    ("https://goproxy.corp.example/go/|https://goproxy.example", "https://goproxy.corp.example/go"),
    ("http://127.0.0.1:3000,direct", "http://127.0.0.1:3000"),
    (" https://a.example , https://b.example ", "https://a.example"),
    ("file:///srv/goproxy,https://mirror.example", "https://mirror.example"),  # not an http(s) proxy
    ("goproxy.corp.example", "https://goproxy.corp.example"),  # go reads a bare host as https://
    ("direct", None),
    ("off", None),
    ("direct,https://goproxy.example", None),  # go never reads past direct
    ("off|https://goproxy.example", None),
    ("", None),
])
def test_goproxy_first_url(tmp_path: Path, goproxy: str, url: str | None) -> None:
    proc = _bash(f"goproxy_first_url {_q(goproxy)}", tmp_path)
    if url is None:
        assert proc.returncode == 1 and proc.stdout == "", proc
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == url + "\n"


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _fake_go(tmp: Path, goproxy: str) -> None:
    _script(tmp / "stub" / "go", f'[ "$1 $2" = "env GOPROXY" ] && echo {_q(goproxy)} && exit 0\nexit 3\n')


def test_resolve_goproxy_reads_go_env(tmp_path: Path) -> None:
    _fake_go(tmp_path, "https://goproxy.corp.example|direct")
    proc = _bash('resolve_goproxy; echo "url=$GOPROXY_URL"', tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "url=https://goproxy.corp.example\n"
    assert "go module proxy: https://goproxy.corp.example (from go env GOPROXY)" in proc.stderr


@pytest.mark.parametrize("goproxy", ["direct", "off", "direct,https://goproxy.example"])
def test_resolve_goproxy_without_a_proxy_fails_clearly(tmp_path: Path, goproxy: str) -> None:
    _fake_go(tmp_path, goproxy)
    proc = _bash('resolve_goproxy; echo "url=$GOPROXY_URL"', tmp_path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    err = proc.stderr
    assert "ERROR: no Go module proxy URL in go env GOPROXY" in err
    assert f"'{goproxy}'" in err  # what was found
    assert "go env -w GOPROXY=" in err and "DYNSNAP_GOPROXY=" in err  # how to set one


def test_dynsnap_goproxy_overrides_go_env_and_reaches_the_go_commands(tmp_path: Path) -> None:
    _fake_go(tmp_path, "direct")
    proc = _bash('resolve_goproxy; echo "url=$GOPROXY_URL GOPROXY=$GOPROXY"', tmp_path,
                 DYNSNAP_GOPROXY="https://mirror.corp.example/go/,direct")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "url=https://mirror.corp.example/go GOPROXY=https://mirror.corp.example/go/,direct\n"


# --- Debian mirror -----------------------------------------------------------------

BOOKWORM = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_CODENAME=bookworm\n'
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"

# This machine's own shape: deb822 main + security stanzas, a third-party .sources.
DEBIAN_SOURCES = f"""\
Types: deb
# a comment inside a stanza
URIs: http://debian-mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: {KEYRING}

Types: deb
URIs: http://debian-mirror.example/debian-security
Suites: bookworm-security
Components: main
Signed-By: {KEYRING}
"""
THIRD_PARTY = """\
Types: deb
URIs: https://thirdparty.example/node_20.x
Suites: nodistro
Components: main
Signed-By: /usr/share/keyrings/thirdparty.gpg
"""


def _apt(tmp: Path, files: dict[str, str], os_release: str = BOOKWORM) -> dict[str, str]:
    etc = tmp / "etc-apt"
    (etc / "sources.list.d").mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (etc / name).write_text(text)
    (tmp / "os-release").write_text(os_release)
    return {"DYNSNAP_APT_ETC": str(etc), "DYNSNAP_OS_RELEASE": str(tmp / "os-release")}


def _mirror(tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return _bash('resolve_debian_mirror; printf "%s|%s\\n" "$DEBIAN_MIRROR_URI" "$DEBIAN_MIRROR_KEYRING"', tmp,
                 **env)


def test_deb822_picks_the_main_archive_and_its_keyring(tmp_path: Path) -> None:
    env = _apt(tmp_path, {"sources.list.d/debian.sources": DEBIAN_SOURCES,
                          "sources.list.d/thirdparty.sources": THIRD_PARTY})
    proc = _mirror(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"http://debian-mirror.example/debian|{KEYRING}\n"
    assert "sources.list.d/debian.sources" in proc.stderr


def test_one_line_sources_skip_security_and_third_party(tmp_path: Path) -> None:
    # security first, then a third party carrying the codename in its suite, then the
    # mirror's -updates suite, then the mirror itself (odd spacing, a trailing comment)
    sources_list = "\n".join([
        "deb http://debian-mirror.example/debian-security bookworm-security main contrib",
        "deb [arch=amd64 signed-by=/usr/share/keyrings/vendor.gpg] https://vendor.example/apt"
        " cloud-sdk-bookworm main",
        "deb-src http://mirror.corp.example/debian/ bookworm-updates main",
        "  deb   [ arch=amd64  signed-by=/etc/apt/keyrings/corp.gpg ]   http://mirror.corp.example/debian/  bookworm"
        "  main non-free-firmware # the archive",
        "",
    ])
    env = _apt(tmp_path, {"sources.list": sources_list})
    proc = _mirror(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "http://mirror.corp.example/debian|/etc/apt/keyrings/corp.gpg\n"


def test_plain_one_line_entry_has_no_keyring(tmp_path: Path) -> None:
    env = _apt(tmp_path, {"sources.list": "deb https://artifactory.corp.example/debian-remote bookworm main\n"})
    proc = _mirror(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "https://artifactory.corp.example/debian-remote|\n"


@pytest.mark.parametrize("options", ["[signed-by=/usr/share/keyrings/thirdparty.gpg] ", ""])
def test_a_third_party_bookworm_main_repo_loses_to_debian(tmp_path: Path, options: str) -> None:
    # A third party that names its suite after the release and has a "main" component,
    # in a file apt reads before debian.sources: Debian's keyring, and else the /debian
    # path, win.
    env = _apt(tmp_path, {
        "sources.list.d/00-node.list": f"deb {options}https://thirdparty.example/node_18.x bookworm main\n",
        "sources.list.d/debian.sources": DEBIAN_SOURCES})
    proc = _mirror(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"http://debian-mirror.example/debian|{KEYRING}\n"


def test_disabled_entries_and_files_are_not_read(tmp_path: Path) -> None:
    disabled = DEBIAN_SOURCES.replace("Types: deb\n# a comment", "Enabled: no\nTypes: deb\n# a comment", 1)
    assert disabled.startswith("Enabled: no\n")
    env = _apt(tmp_path, {
        "sources.list.d/debian.sources": disabled,
        "sources.list.d/mirror.list.disabled-by-farm": "deb http://other.example/debian bookworm main\n"})
    proc = _mirror(tmp_path, env)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "no apt source serves Debian's main archive for 'bookworm'" in proc.stderr
    assert "debian.sources" in proc.stderr and "DYNSNAP_DEBIAN_MIRROR=" in proc.stderr


def test_no_sources_at_all_fails_clearly(tmp_path: Path) -> None:
    proc = _mirror(tmp_path, _apt(tmp_path, {}))
    assert proc.returncode == 1
    assert "no apt sources found" in proc.stderr and "DYNSNAP_DEBIAN_MIRROR=" in proc.stderr


def test_an_ubuntu_archive_is_not_a_debian_mirror(tmp_path: Path) -> None:
    env = _apt(tmp_path, {"sources.list": "deb http://ubuntu-mirror.example/ubuntu noble main universe\n"},
               os_release="ID=ubuntu\nID_LIKE=debian\nVERSION_CODENAME=noble\n")
    proc = _mirror(tmp_path, env)
    assert proc.returncode == 1
    assert "ubuntu" in proc.stderr and "DYNSNAP_DEBIAN_MIRROR=" in proc.stderr


def test_an_alias_suite_serves_when_the_codename_is_not_listed(tmp_path: Path) -> None:
    env = _apt(tmp_path, {"sources.list": "deb http://mirror.example/debian stable main\n"})
    proc = _mirror(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "http://mirror.example/debian|\n"


def test_inline_signed_by_key_is_written_to_a_keyring_file(tmp_path: Path) -> None:
    sources = """\
Types: deb deb-src
URIs: https://mirror.corp.example/debian
Suites: bookworm
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 mDMEZQAAAAAWCSsGAQQB2kcPAQEHQFAKEKEYFAKEKEYFAKEKEYFAKEKEYFAKEKEY
 =abcd
 -----END PGP PUBLIC KEY BLOCK-----
"""
    env = _apt(tmp_path, {"sources.list.d/corp.sources": sources})
    proc = _mirror(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    keyring = tmp_path / "cache" / "apt-debian-src" / "mirror-keyring.asc"
    assert proc.stdout == f"https://mirror.corp.example/debian|{keyring}\n"
    assert keyring.read_text() == ("-----BEGIN PGP PUBLIC KEY BLOCK-----\n\n"
                                   "mDMEZQAAAAAWCSsGAQQB2kcPAQEHQFAKEKEYFAKEKEYFAKEKEYFAKEKEYFAKEKEY\n"
                                   "=abcd\n-----END PGP PUBLIC KEY BLOCK-----\n")


def test_dynsnap_debian_mirror_overrides_the_sources(tmp_path: Path) -> None:
    env = _apt(tmp_path, {"sources.list.d/debian.sources": DEBIAN_SOURCES})
    proc = _mirror(tmp_path, env | {"DYNSNAP_DEBIAN_MIRROR": "https://artifactory.corp.example/debian-remote/",
                                    "DYNSNAP_DEBIAN_KEYRING": "/etc/apt/keyrings/corp.gpg"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "https://artifactory.corp.example/debian-remote|/etc/apt/keyrings/corp.gpg\n"
    # An empty keyring means none: apt's own trusted keys.
    proc = _mirror(tmp_path, env | {"DYNSNAP_DEBIAN_MIRROR": "http://m.example/debian", "DYNSNAP_DEBIAN_KEYRING": ""})
    assert proc.stdout == "http://m.example/debian|\n"


def test_criu_private_deb_src_list_uses_the_mirror(tmp_path: Path) -> None:
    # apt-get stubbed: it records its argv and fails, so setup stops right after writing
    # its private list (no network).
    _script(tmp_path / "stub" / "apt-get", f'echo "$*" >> {_q(str(tmp_path / "apt.log"))}\nexit 100\n')
    env = _apt(tmp_path, {"sources.list.d/debian.sources": DEBIAN_SOURCES})
    proc = _bash("_criu_fetch_orig", tmp_path, **env)
    assert proc.returncode == 1
    assert "apt-get update of the private Debian deb-src list failed" in proc.stderr
    private = tmp_path / "cache" / "apt-debian-src"
    assert (private / "sources.list").read_text() == (
        f"deb-src [signed-by={KEYRING}] http://debian-mirror.example/debian sid main\n"
        f"deb-src [signed-by={KEYRING}] http://debian-mirror.example/debian forky main\n")
    assert f"Dir::Etc::SourceList={private}/sources.list" in (tmp_path / "apt.log").read_text()


@pytest.mark.skipif(not Path("/etc/os-release").is_file() or "ID=debian" not in Path("/etc/os-release").read_text(),
                    reason="reads this Debian machine's own apt sources")
def test_this_machine_has_a_debian_mirror(tmp_path: Path) -> None:
    proc = _bash('resolve_debian_mirror; printf "%s\\n" "$DEBIAN_MIRROR_URI"', tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(("http://", "https://"))

