"""CRIU's network lock, cleared where a cut-off dump left it (dynsnap/agent/netlock.py, issue 38): in a real
network namespace holding CRIU's table (``inet CRIU-<run id>``, as CRIU's --network-lock nftables makes it,
with a rule that drops a locked connection's packets) and a table of the pod's own, the agent's ``nft``,
run in that namespace alone through dynsnap-nsexec, deletes CRIU's and leaves the pod's; the connection's
packets flow again. As root, with the machine's nft (hack/lib-node.sh installs it)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from dynsnap.agent import netlock
from dynsnap.agent.nsexec import Target
from dynsnap.models.ids import HostPid
from dynsnap.runtime import procfs
from dynsnap.runtime.command import find_tool

NATIVE = Path(os.environ.get("DYNSNAP_NATIVE_BIN", Path(__file__).resolve().parents[2] / "native" / "build"))
CRIU_TABLE = "CRIU-0b5f3c1e-7d2a-4b8e-9f10"


def _nft(pid: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_tool("nsenter"), "-t", str(pid), "-n", "--", find_tool("nft"), *args],
                          capture_output=True, text=True, timeout=30)


def test_criu_tables_are_read_from_nfts_json() -> None:
    listing = ('{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"table": {"family": "inet", "name": '
               f'"{CRIU_TABLE}", "handle": 1}}}}, {{"table": {{"family": "ip", "name": "CRIU-x", "handle": 2}}}}, '
               '{"table": {"family": "inet", "name": "mine", "handle": 3}}, '
               '{"table": {"family": "inet", "name": "CRIU", "handle": 4}}]}')
    assert netlock.criu_tables(listing) == [CRIU_TABLE, "CRIU"]
    with pytest.raises(ValueError):
        netlock.criu_tables("not json")


def test_a_left_lock_is_deleted_and_the_pods_own_table_kept(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (namespaces, nftables)")
    try:
        find_tool("nft")
    except FileNotFoundError:
        pytest.fail("no nft: ./run setup installs nftables (hack/lib-node.sh)")
    box = subprocess.Popen(["unshare", "--net", "--pid", "--fork", "--kill-child", "--", "sleep", "1000"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid1 = 0
        for _ in range(100):
            kids = Path(f"/proc/{box.pid}/task/{box.pid}/children").read_text().split()
            if kids:
                pid1 = int(kids[0])
                break
            time.sleep(0.05)
        assert pid1
        for cmd in (["add", "table", "inet", CRIU_TABLE],
                    ["add", "chain", "inet", CRIU_TABLE, "output", "{ type filter hook output priority 0; }"],
                    ["add", "rule", "inet", CRIU_TABLE, "output", "tcp", "dport", "7777", "drop"],
                    ["add", "table", "inet", "mine"]):
            r = _nft(pid1, *cmd)
            assert r.returncode == 0, r.stderr
        target = Target(HostPid(pid1), procfs.start_time(pid1))
        deleted = asyncio.run(netlock.clear(target, nsexec=str(NATIVE / "dynsnap-nsexec")))
        assert deleted == [CRIU_TABLE]
        left = _nft(pid1, "list", "tables").stdout
        assert "table inet mine" in left and "CRIU" not in left, left
    finally:
        box.kill()
        box.wait(10)
