"""The agent's side of ``dynsnap-cuda`` (docs/NATIVE.md): one helper process for all of a
worker's GPU pids, machine-readable output, a time bound on every call.

Layer: ``dynsnap.agent``. ``save`` locks every pid before it checkpoints any and rolls the locks
back itself when a lock fails; a failed checkpoint leaves the locks (the helper's contract), and
:func:`rollback` brings every pid back to running from whatever state it was left in. The
driver is whatever ``libcuda.so.1`` the helper loads: the NVIDIA driver on a GPU node, the
project's ``stub_libcuda`` in the local environment (``DYNSNAP_LIBCUDA`` names it).

    CudaError          the helper failed (exit code, stderr, per-pid records); ``timed_out`` when
                       it ran past its bound and was killed; ``refused_memory`` on exit 3
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynsnap.agent.helpers import HelperRegistry
from dynsnap.models.ids import HostPid
from dynsnap.runtime.command import CommandError, run_command

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOMEM = 3
EXIT_NODRIVER = 4
DEFAULT_STATE_DIR = "/run/dynsnap-cuda"  # dynsnap-cuda's own default for DYNSNAP_CUDA_STATE_DIR


class CudaError(RuntimeError):
    def __init__(self, message: str, *, returncode: int | None, records: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.records = records or []

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def refused_memory(self) -> bool:
        return self.returncode == EXIT_NOMEM


@dataclass(frozen=True)
class GpuFree:
    index: int
    uuid: str
    free: int | None


@dataclass
class CudaHelper:
    """How to run ``dynsnap-cuda``: its path, the environment it gets (driver library, state
    dir), and the bounds. A call given a ``marker`` (``<pod uid>/<operation>``) is recorded under it
    in ``registry`` while it runs (dynsnap/agent/helpers.py), so a restarted agent finds a helper
    still at work for a worker; nothing of it goes into the helper's environment."""

    binary: str
    env: Mapping[str, str] = field(default_factory=dict)
    # save: the driver's lock waits for in-flight GPU work; a rank stuck in a collective must fail
    # the capture within this, not hang it (10 s is dynsnap-cuda's own default for save).
    lock_timeout_ms: int = 10_000
    # The whole helper call: a 32 GiB checkpoint took 14.4 s on the H200; 16 GiB restores 3-4 s.
    timeout: float = 300.0
    registry: HelperRegistry | None = None

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("LD_LIBRARY_PATH", None)
        env.update(self.env)
        return env

    async def _run(self, args: Sequence[str], *, marker: str | None, timeout: float | None = None) -> tuple[
            int, list[dict[str, Any]], str]:
        argv = [self.binary, *args]
        try:
            hook = self.registry.spawned(marker) if self.registry is not None and marker else None
            res = await run_command(argv, timeout=timeout or self.timeout, check=False, env=self._env(), on_spawn=hook)
        except CommandError as e:
            raise CudaError(f"dynsnap-cuda {' '.join(args)}: no exit within {timeout or self.timeout} s; killed",
                            returncode=None) from e
        records = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
        return res.returncode, records, res.stderr.strip()

    async def action(self, action: str, pids: Sequence[HostPid], *, marker: str | None = None,
                     extra: Sequence[str] = (), starts: Mapping[HostPid, int] | None = None) -> list[dict[str, Any]]:
        """Run ``--action`` for every pid in one helper; the per-pid JSON records on success."""
        records, _ = await self.action_measured(action, pids, marker=marker, extra=extra, starts=starts)
        return records

    async def action_measured(self, action: str, pids: Sequence[HostPid], *, marker: str | None = None,
                              extra: Sequence[str] = (), starts: Mapping[HostPid, int] | None = None,
                              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """:meth:`action`, and each GPU's free memory before and after it as the helper read it
        around its driver calls (its ``{"gpus": [...]}`` line, for save and resume): status
        ``gpus`` entries ``{"uuid", "freeBefore", "freeAfter"}``, empty where it read none."""
        if not pids:
            return [], []
        # PID@START where the agent saw the process start: the helper checks it right before each driver call,
        # so a pid reused since the look (the process exited) is never handed to the driver
        given = ",".join(f"{p}@{starts[p]}" if starts and p in starts else str(p) for p in pids)
        args = ["--action", action, "--pid", given, "--json", *extra]
        if action in ("save", "lock"):
            args += ["--timeout", str(self.lock_timeout_ms)]
        rc, lines, err = await self._run(args, marker=marker)
        records = [r for r in lines if "pid" in r]
        if rc != 0:
            raise CudaError(f"dynsnap-cuda {action} exited {rc}: {err or records}", returncode=rc, records=records)
        gpus: list[Any] = next((r["gpus"] for r in lines if isinstance(r.get("gpus"), list)), [])
        return records, [{"uuid": str(g["uuid"]), "freeBefore": g.get("free_before"), "freeAfter": g.get("free_after")}
                         for g in gpus if isinstance(g, dict) and g.get("uuid")]

    async def states(self, pids: Sequence[HostPid]) -> dict[HostPid, str]:
        """The driver's checkpoint state of each pid (running, locked, checkpointed, failed), or
        ``unknown`` where the driver answered with an error (a process without a CUDA context)."""
        out: dict[HostPid, str] = {}
        for pid in pids:  # one by one: a pid the driver does not know must not hide the others
            state, _, _ = await self._run_state(pid)
            out[pid] = state
        return out

    async def _run_state(self, pid: HostPid) -> tuple[str, int, str]:
        argv = [self.binary, "--get-state", "--pid", str(pid)]
        try:
            res = await run_command(argv, timeout=30.0, check=False, env=self._env())
        except CommandError as e:
            raise CudaError(f"dynsnap-cuda --get-state {pid}: no exit within 30 s", returncode=None) from e
        if res.returncode != 0:
            return "unknown", res.returncode, res.stderr.strip()
        return res.stdout.strip() or "unknown", 0, ""

    async def mem_info(self) -> list[GpuFree]:
        """Free memory of every visible GPU (``--mem-info``); empty when there is no driver."""
        rc, records, _ = await self._run(["--mem-info"], marker=None, timeout=30.0)
        if rc != 0:
            return []
        return [GpuFree(int(r["index"]), str(r["uuid"]), r.get("free")) for r in records]

    def freed(self, pids: Sequence[HostPid]) -> dict[str, int]:
        """What the checkpoints that left ``pids`` checkpointed freed, bytes per GPU UUID, from the
        helper's own records (``<DYNSNAP_CUDA_STATE_DIR>/<pid>``: ``group <call>``, then ``<uuid>
        <bytes>`` lines, written by each save for every pid it checkpointed, dropped by a restore). A
        call that checkpointed several of the pids measured their sum: it is counted once."""
        state_dir = Path(self.env.get("DYNSNAP_CUDA_STATE_DIR") or DEFAULT_STATE_DIR)
        out: dict[str, int] = {}
        groups: set[str] = set()
        for pid in pids:
            try:
                lines = (state_dir / str(pid)).read_text().splitlines()
            except OSError:
                continue  # no record: that process's checkpoint freed nothing the helper could measure
            if not lines or not lines[0].startswith("group ") or lines[0] in groups:
                continue
            groups.add(lines[0])
            for line in lines[1:]:
                uuid, _, size = line.partition(" ")
                if size.strip().isdigit():
                    out[uuid] = out.get(uuid, 0) + int(size)
        return out

    async def rollback(self, pids: Sequence[HostPid], *, marker: str | None = None,
                       starts: Mapping[HostPid, int] | None = None) -> dict[HostPid, str]:
        """Bring every pid back to ``running`` from wherever a failed save left it: restore and
        unlock the checkpointed ones, unlock the locked ones. Returns the states afterwards."""
        states = await self.states(pids)
        checkpointed = [p for p, s in states.items() if s == "checkpointed"]
        locked = [p for p, s in states.items() if s == "locked"]
        if checkpointed:
            # No memory check: these pids' memory was freed by this very capture moments ago.
            await self.action("resume", checkpointed, marker=marker, extra=["--force"], starts=starts)
        if locked:
            await self.action("unlock", locked, marker=marker, starts=starts)
        return await self.states(pids)
