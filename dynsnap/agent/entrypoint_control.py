"""The agent's side of the dynsnap-entrypoint control directory (docs/ENTRYPOINT.md).

The entrypoint writes ``entrypoint.json``; the agent writes ``state-request``
(``SEQ STATE\\n``, temp file + rename) and waits for the entrypoint to acknowledge the
sequence number before acting. A refused request (``request_error``) or a missing ack
within the bound is an error, never a silent success.

The entrypoint is woken by the rename (an inotify watch) and acknowledges within about a
millisecond; where it has no watch (``request_wakeup: "tick"``) it takes up to its 100 ms tick.
So the wait for the ack looks after 1 ms, then doubles the pause up to 50 ms (issue 12, wake
latency): one or two reads of a small file in the common case, about eight in the first 100 ms
of the slow one, then one every 50 ms as before.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from dynsnap.models import protocol as P


class EntrypointError(RuntimeError):
    """The entrypoint did not take a request, or its control file is unusable."""


# The wait for an ack: first look after ACK_POLL_FIRST, doubling up to ACK_POLL_MAX between looks.
ACK_POLL_FIRST = 0.001
ACK_POLL_MAX = 0.05


class EntrypointControl:
    def __init__(self, control_dir: Path) -> None:
        self.dir = control_dir

    def read(self) -> dict[str, Any]:
        path = self.dir / P.ENTRYPOINT_CONTROL_FILE
        try:
            info: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise EntrypointError(f"cannot read {path}: {e}") from e
        if info.get("format") != P.ENTRYPOINT_CONTROL_FORMAT:
            raise EntrypointError(f"{path}: format {info.get('format')!r}, this agent speaks "
                                  f"{P.ENTRYPOINT_CONTROL_FORMAT}")
        return info

    async def request(self, state: P.EntrypointState, *, timeout: float = 10.0) -> dict[str, Any]:
        """Ask for ``state``; return the control file once the entrypoint acknowledged it."""
        seq = int(self.read().get("request_seq") or 0) + 1
        tmp = self.dir / f".{P.ENTRYPOINT_REQUEST_FILE}.{os.getpid()}"
        tmp.write_text(f"{seq} {state.value}\n")
        os.replace(tmp, self.dir / P.ENTRYPOINT_REQUEST_FILE)
        deadline = time.monotonic() + timeout
        pause = ACK_POLL_FIRST
        while time.monotonic() < deadline:
            info = self.read()
            if int(info.get("request_seq") or 0) >= seq:
                if info.get("request_error"):
                    raise EntrypointError(f"entrypoint refused {state.value}: {info['request_error']}")
                if info.get("state") != state.value:
                    raise EntrypointError(f"entrypoint acknowledged {seq} but is {info.get('state')!r}")
                return info
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, ACK_POLL_MAX)
        last = self.read()
        raise EntrypointError(f"entrypoint did not acknowledge {state.value} (seq {seq}) within {timeout:.0f}s: "
                              f"it is {last.get('state')!r} at request_seq {last.get('request_seq')}, "
                              f"updated {last.get('updated')}")
