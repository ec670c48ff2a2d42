"""The pod network of the test environment: one Linux bridge, one netns per pod.

Layer: ``dynsnap.testenv`` (test harness only; never imported by the product).

A :class:`SandboxNetwork` owns a bridge (default ``dsnbr0``) whose address is the
gateway of an uncommon private /16 (default ``10.213.0.0/16``, gateway
``10.213.0.1``). :meth:`SandboxNetwork.attach` makes a network namespace for one
pod: a veth pair whose host end is enslaved to the bridge and whose other end is
``eth0`` inside the namespace, carrying the pod IP, with ``lo`` up and a default
route via the gateway. The host reaches every pod IP through the bridge; pods
reach each other on the bridge and the host at the gateway address (a service on
the host that pods must reach, e.g. the API server, has to listen there too:
``127.0.0.1`` inside a pod is the pod's own loopback).

Everything is named deterministically from the bridge name, so :meth:`up`
first removes namespaces and veths a crashed earlier run left behind, and
:meth:`down` removes everything this network ever made. Every command runs with
a time bound (:func:`run_command`).

Needs root, ``ip`` (iproute2) and a kernel with veth and bridge support.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import shutil
import signal
from collections.abc import Awaitable, Callable
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
        self._attached: set[str] = set()
        self._on_down: dict[str, Callable[[], Awaitable[object]]] = {}

    @property
    def netns_prefix(self) -> str:
        """Every namespace this network makes starts with this; stale ones are removed."""
        return f"{self.bridge}-"

    def netns_name(self, *, namespace: str, name: str, uid: str) -> str:
        """A deterministic ``ip netns`` name for a pod (readable, unique by pod UID)."""
        return f"{self.netns_prefix}{namespace}-{name}-{uid[:8]}"[:200]

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

    def on_down(self, key: str, cleanup: Callable[[], Awaitable[object]] | None) -> None:
        """Register (or with None, drop) a cleanup that :meth:`down` awaits first.

        Pod sandboxes register their ``stop`` here, so ``down`` also stops pods a
        failed test never stopped (processes, cgroups), not only their netns.
        """
        if cleanup is None:
            self._on_down.pop(key, None)
        else:
            self._on_down[key] = cleanup

    async def down(self) -> None:
        """Stop registered pods, remove every namespace and veth, then the bridge (idempotent)."""
        errors: list[BaseException] = []
        for key, cleanup in list(self._on_down.items()):
            try:
                await cleanup()
            except Exception as e:  # keep cleaning; report at the end
                errors.append(e)
            self._on_down.pop(key, None)
        for ns in list(self._attached):
            await self.detach(ns)
        await self._remove_stale()
        if (await self._ipcmd("link", "show", "dev", self.bridge, check=False)).returncode == 0:
            await self._ipcmd("link", "del", "dev", self.bridge)
        if errors:
            raise errors[0]

    async def attach(self, netns: str, pod_ip: str, *, hostname: str = "pod") -> str:
        """Make ``netns`` with ``eth0`` = ``pod_ip`` on the bridge; return the host veth name."""
        addr = ipaddress.IPv4Address(pod_ip)
        if addr not in self.network or str(addr) == self.gateway or addr == self.network.broadcast_address:
            raise ValueError(f"pod IP {pod_ip} is not a host address of {self.network} (nor the gateway)")
        await self.detach(netns)  # a leftover of the same name would carry stale state
        veth = self.veth_name(netns)
        self._attached.add(netns)
        plen = str(self.network.prefixlen)
        await self._ipcmd("netns", "add", netns)
        await self._ipcmd("link", "add", "name", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        await self._ipcmd("link", "set", "dev", veth, "master", self.bridge, "up")
        await self._ipcmd("-n", netns, "link", "set", "dev", "lo", "up")
        await self._ipcmd("-n", netns, "addr", "add", f"{pod_ip}/{plen}", "dev", "eth0")
        await self._ipcmd("-n", netns, "link", "set", "dev", "eth0", "up")
        await self._ipcmd("-n", netns, "route", "add", "default", "via", self.gateway, "dev", "eth0")
        self._write_etc(netns, pod_ip, hostname)
        return veth

    def _write_etc(self, netns: str, pod_ip: str, hostname: str) -> None:
        """Files ``ip netns exec`` bind-mounts over /etc inside the pod.

        No nameserver: the host's resolver is not reachable from the bridge, and a
        pod must not contact anything but these namespaces and 127.0.0.0/8, so a
        lookup fails at once (glibc falls back to 127.0.0.1:53, refused) instead
        of timing out (Python's http.server does a reverse lookup at bind).
        """
        etc = Path("/etc/netns") / netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("# dynsnap pod sandbox: no DNS\noptions timeout:1 attempts:1\n")
        (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{pod_ip}\t{hostname}\n")

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
        self._attached.discard(netns)

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
