"""What dynsnap-entrypoint reports in its control file (``entrypoint.json``, docs/ENTRYPOINT.md), as a
schema: the agent reads that file from inside a worker container, where whoever controls the worker
can rewrite it, so it is parsed into this model and nothing else of it is used.

Pure types (bottom layer). Every field is the type the entrypoint writes (strict: ``"5"`` is not a
pid, ``1`` is not ``true``), every number and string is bounded. Fields this version does not know
are ignored, not refused: docs/ENTRYPOINT.md promises that a newer entrypoint of the same ``format``
may add fields (the size bound the agent reads the file with, ``CONTROL_FILE_BOUND``, limits what they
can cost). Only what the agent needs to act is required; the rest may be absent, as from an older
entrypoint.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from dynsnap.models.protocol import EntrypointState

# The entrypoint builds the file in an 8 KiB buffer (native/entrypoint/control.c); 64 KiB leaves room for
# fields a newer one adds and is still nothing to read. A larger file is refused, never read whole.
CONTROL_FILE_BOUND: Final = 64 * 1024

# Linux's PID_MAX_LIMIT (2^22): no pid of any namespace is larger.
Pid = Annotated[int, Field(ge=0, le=1 << 22)]
Port = Annotated[int, Field(ge=0, le=65535)]
# The entrypoint's own buffers: request_error[160], control_dir[PATH_MAX/2], log_path[PATH_MAX].
Word = Annotated[str, StringConstraints(max_length=32)]
Message = Annotated[str, StringConstraints(max_length=512)]
ContainerPathText = Annotated[str, StringConstraints(max_length=4096)]
# Seconds since the epoch, as the entrypoint writes them (milliseconds resolution); up to the year 5138.
Epoch = Annotated[float, Field(ge=0, le=1e11)]


class EntrypointInfo(BaseModel):
    """``entrypoint.json``, validated. Pids are in the container's pid namespace."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)

    format: int
    state: EntrypointState
    request_seq: Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
    started: Epoch  # tells one container start from the next: a capture is restored only into its own
    pid: Pid | None = None
    worker_pid: Pid | None = None
    worker_pgid: Pid | None = None
    worker_sid: Pid | None = None
    worker_alive: bool | None = None
    worker_status: Annotated[int, Field(ge=0, le=65535)] | None = None
    system_port: Port | None = None
    probe_port: Port | None = None
    request_error: Message | None = None
    request_wakeup: Word | None = None
    request_noticed: Word | None = None
    pid_floor: Pid | None = None
    pid_reserved: bool | None = None
    seccomp: Word | None = None
    log_file: ContainerPathText | None = None
    thp_preload: ContainerPathText | None = None
    updated: Epoch | None = None
