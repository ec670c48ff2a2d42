"""The network of the test environment: one Linux bridge of the run's own.

Layer: ``dynsnap.testenv`` (test harness only; never imported by the product).

A :class:`SandboxNetwork` owns a bridge (default ``dsnbr0``) whose address is the
gateway of an uncommon private /16 (default ``10.213.0.0/16``, gateway
``10.213.0.1``), where the control plane listens. The real node (node.py) takes a /24
of it as its podCIDR and its CNI bridge plugin attaches each pod's network namespace;
pods reach the host at the gateway address (``127.0.0.1`` inside a pod is the pod's
own loopback).

Namespaces and veths named from the bridge name (``<bridge>-*``, ``dsv*``: the pod
sandboxes' before 2026-12-07) that a crashed earlier run left behind are removed by
:meth:`up` and :meth:`down`. Every command runs with a time bound (:func:`run_command`).

Needs root, ``ip`` (iproute2) and a kernel with veth and bridge support.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import shutil
import signal
from pathlib import Path

from dynsnap.runtime.command import CommandError, CommandResult, find_tool, run_command

__all__ = ["CommandError", "CommandResult", "SandboxNetwork", "find_tool", "run_command"]


def _netns_exists(netns: str) -> bool:
    return os.path.exists(f"/run/netns/{netns}")


class SandboxNetwork:
    """One test bridge and the pod network namespaces attached to it."""

    def __init__(self, *, bridge: str = "dsnbr0", cidr: str = "10.213.0.0/16", timeout: float = 10.0) -> None:
        if len(bridge) > 12:
            raise ValueError(f"bridge name {bridge!r} is too long (max 12 characters)")
        self.bridge = bridge
        self.network = ipaddress.IPv4Network(cidr)
        # The first host address is the gateway, as a CNI bridge plugin would pick.
        self.gateway = str(next(self.network.hosts()))
        self.timeout = timeout
        self._ip = find_tool("ip")

    @property
    def netns_prefix(self) -> str:
        """Every namespace this network makes starts with this; stale ones are removed."""
        return f"{self.bridge}-"

    def veth_name(self, netns: str) -> str:
        # Interface names are at most 15 bytes: a short prefix plus a hash.
        return "dsv" + hashlib.sha256(netns.encode()).hexdigest()[:11]

    async def _ipcmd(self, *args: str, check: bool = True) -> CommandResult:
        return await run_command([self._ip, *args], timeout=self.timeout, check=check)

    async def up(self) -> None:
        """Create the bridge with the gateway address (idempotent); remove stale pods."""
        await self._remove_stale()
        if (await self._ipcmd("link", "show", "dev", self.bridge, check=False)).returncode != 0:
            await self._ipcmd("link", "add", "name", self.bridge, "type", "bridge")
        await self._ipcmd("addr", "replace", f"{self.gateway}/{self.network.prefixlen}", "dev", self.bridge)
        await self._ipcmd("link", "set", "dev", self.bridge, "up")

    async def down(self) -> None:
        """Remove every namespace and veth of this network's naming, then the bridge (idempotent)."""
        await self._remove_stale()
        if (await self._ipcmd("link", "show", "dev", self.bridge, check=False)).returncode == 0:
            await self._ipcmd("link", "del", "dev", self.bridge)

    async def detach(self, netns: str) -> None:
        """Kill what still runs in ``netns``, delete it and its veth (idempotent)."""
        await self._kill_netns_pids(netns)
        if _netns_exists(netns):
            await self._ipcmd("netns", "del", netns)
        veth = self.veth_name(netns)
        # Deleting the namespace destroys the pair; this covers a half-made attach.
        if (await self._ipcmd("link", "show", "dev", veth, check=False)).returncode == 0:
            await self._ipcmd("link", "del", "dev", veth, check=False)
        shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)

    async def _kill_netns_pids(self, netns: str) -> None:
        if not _netns_exists(netns):
            return
        res = await self._ipcmd("netns", "pids", netns, check=False)
        for word in res.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(word), signal.SIGKILL)

    async def _remove_stale(self) -> None:
        """Namespaces with this network's prefix and veths on its bridge, left by a crash."""
        res = await self._ipcmd("netns", "list", check=False)
        for line in res.stdout.splitlines():
            name = line.split(" ", 1)[0]
            if name.startswith(self.netns_prefix):
                await self.detach(name)
        res = await self._ipcmd("-o", "link", "show", "master", self.bridge, check=False)
        for line in res.stdout.splitlines():
            parts = line.split(":")
            if len(parts) > 1:
                dev = parts[1].strip().split("@", 1)[0]
                if dev.startswith("dsv"):
                    await self._ipcmd("link", "del", "dev", dev, check=False)
