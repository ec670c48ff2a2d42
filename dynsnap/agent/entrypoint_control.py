"""The agent's side of the dynsnap-entrypoint control directory (docs/ENTRYPOINT.md).

The entrypoint writes ``entrypoint.json``; the agent writes ``state-request`` (``SEQ STATE\\n``, temp
file + rename) and waits for the entrypoint to acknowledge the sequence number before acting. A
refused request (``request_error``) or a missing ack within the bound is an error, never a silent
success.

The directory is inside the worker's container, reached through the entrypoint's root: every read and
write goes through :mod:`dynsnap.agent.container` (no symlink followed, nothing outside the container,
random temp names created exclusively), and ``entrypoint.json`` is read with a byte bound into its
schema, :class:`~dynsnap.models.entrypoint.EntrypointInfo`:

    EntrypointError          no control file there (not yet written, or no entrypoint), or the
                             entrypoint did not take a request
    EntrypointUnreadable     the control file is there but unusable: too large, not a regular file,
                             not JSON, another format, a field of the wrong type (ENTRYPOINT_UNREADABLE)
    UnsafeContainerPath      the directory or a file in it is a symlink, or its path is one the agent
                             does not resolve (UNSAFE_CONTAINER_PATH, from dynsnap.agent.container)

The entrypoint is woken by the rename (an inotify watch) and acknowledges within about a
millisecond; where it has no watch (``request_wakeup: "tick"``) it takes up to its 100 ms tick.
So the wait for the ack looks after 1 ms, then doubles the pause up to 50 ms (issue 12, wake
latency): one or two reads of a small file in the common case, about eight in the first 100 ms
of the slow one, then one every 50 ms as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic_core
from pydantic import ValidationError

from dynsnap.agent.container import ContainerDir, ContainerFileTooLarge, ContainerRefused, ContainerRoot
from dynsnap.models import protocol as P
from dynsnap.models.entrypoint import CONTROL_FILE_BOUND, EntrypointInfo
from dynsnap.runtime import procfs
from dynsnap.runtime.procfs import PROC


class EntrypointError(RuntimeError):
    """The entrypoint did not take a request, or there is no control file to read."""


class EntrypointUnreadable(ContainerRefused):
    """The entrypoint's control file exists but is none the agent will use."""

    reason = P.Reason.ENTRYPOINT_UNREADABLE


# The wait for an ack: first look after ACK_POLL_FIRST, doubling up to ACK_POLL_MAX between looks.
ACK_POLL_FIRST = 0.001
ACK_POLL_MAX = 0.05


def parse_info(raw: bytes, *, where: str) -> EntrypointInfo:
    """``entrypoint.json``'s bytes, validated; :class:`EntrypointUnreadable` names what is wrong (the
    field and the rule, never the value: it is the worker's to choose)."""
    try:  # pydantic's parser: bounded nesting (a deep one is an error, not a RecursionError)
        doc = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        raise EntrypointUnreadable(f"{where}: not JSON ({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise EntrypointUnreadable(f"{where}: not a JSON object")
    if doc.get("format") != P.ENTRYPOINT_CONTROL_FORMAT:
        fmt = doc.get("format")
        shown = repr(fmt)[:40] if isinstance(fmt, int | str) or fmt is None else type(fmt).__name__
        raise EntrypointUnreadable(f"{where}: format {shown}, this agent speaks {P.ENTRYPOINT_CONTROL_FORMAT}")
    try:
        return EntrypointInfo.model_validate_json(raw)
    except ValidationError as e:
        wrong = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(file)'}: {err['msg']}"
                          for err in e.errors(include_url=False, include_input=False)[:5])
        raise EntrypointUnreadable(f"{where}: {wrong[:800]}") from None


class EntrypointControl:
    """The control directory ``control_dir``, a path inside the container whose file system is
    ``root`` (``/proc/<entrypoint>/root``; ``/`` where the agent shares the entrypoint's root, as the
    local tests and the bench do)."""

    def __init__(self, control_dir: str | Path, *, root: Path = Path("/"), pinned: tuple[int, int] | None = None,
                 proc: Path = PROC) -> None:
        self.dir = str(control_dir)
        self.root = root
        # (host pid, start time) of the process whose root ``root`` is, as the agent located it: checked
        # with the root open, so a container restarted since (another process at that pid) is never written to
        self.pinned = pinned
        self.proc = proc

    def _read(self, d: ContainerDir) -> dict[str, Any]:
        where = f"{self.dir.rstrip('/')}/{P.ENTRYPOINT_CONTROL_FILE}"
        try:
            raw = d.read(P.ENTRYPOINT_CONTROL_FILE, limit=CONTROL_FILE_BOUND)
        except FileNotFoundError as e:
            raise EntrypointError(f"cannot read {where}: {e.strerror}") from e
        except ContainerFileTooLarge as e:
            raise EntrypointUnreadable(str(e)) from None
        except OSError as e:
            raise EntrypointUnreadable(f"cannot read {where}: {e.strerror}") from e
        # A plain mapping, as before the schema: every field the entrypoint wrote, validated.
        return parse_info(raw, where=where).model_dump(mode="json")

    def read(self) -> dict[str, Any]:
        with self._directory() as d:
            return self._read(d)

    @contextlib.contextmanager
    def _directory(self) -> Iterator[ContainerDir]:
        """The control directory, held open from the container's root for one read or request."""
        with contextlib.ExitStack() as stack:
            try:
                root = stack.enter_context(ContainerRoot(self.root))
            except OSError as e:  # the process whose root it is has exited
                raise EntrypointError(f"cannot open the container's root {self.root}: {e.strerror}") from e
            if self.pinned is not None and procfs.start_time(self.pinned[0], self.proc) != self.pinned[1]:
                raise EntrypointError(f"process {self.pinned[0]} is not the container's PID 1 the agent located "
                                      "(another start time): the container restarted; nothing was read or written")
            try:
                d = stack.enter_context(root.directory(self.dir))
            except FileNotFoundError as e:
                raise EntrypointError(f"no control directory {self.dir}: {e.strerror}") from e
            except OSError as e:
                raise EntrypointUnreadable(f"cannot open the control directory {self.dir}: {e.strerror}") from e
            yield d

    async def request(self, state: P.EntrypointState, *, timeout: float = 10.0) -> dict[str, Any]:
        """Ask for ``state``; return the control file once the entrypoint acknowledged it."""
        with self._directory() as d:
            seq = int(self._read(d).get("request_seq") or 0) + 1
            try:
                d.replace(P.ENTRYPOINT_REQUEST_FILE, f"{seq} {state.value}\n".encode())
            except OSError as e:
                raise EntrypointError(f"cannot write {self.dir.rstrip('/')}/{P.ENTRYPOINT_REQUEST_FILE}: "
                                      f"{e.strerror}") from e
            deadline = time.monotonic() + timeout
            pause = ACK_POLL_FIRST
            while time.monotonic() < deadline:
                info = self._read(d)
                if int(info.get("request_seq") or 0) >= seq:
                    if info.get("request_error"):
                        raise EntrypointError(f"entrypoint refused {state.value}: {info['request_error']}")
                    if info.get("state") != state.value:
                        raise EntrypointError(f"entrypoint acknowledged {seq} but is {info.get('state')!r}")
                    return info
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, ACK_POLL_MAX)
            last = self._read(d)
        raise EntrypointError(f"entrypoint did not acknowledge {state.value} (seq {seq}) within {timeout:.0f}s: "
                              f"it is {last.get('state')!r} at request_seq {last.get('request_seq')}, "
                              f"updated {last.get('updated')}")
