"""What CRIU's logs say: why a dump or restore failed (its ``Error``/``Warn`` lines and the known cause
named from them, :class:`CriuError`), whether a dump finished, and how a restore read the pages back
(hack/patches/criu/0002's line per restorer).

Every read of a log is bounded (a restore log at ``-v4`` is a few MiB; at most ``_LOG_SCAN_LIMIT``
bytes are read, a tail only its bytes).

Layer: ``dynsnap.agent``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
DUMP_DONE = "Dumping finished successfully"


class CriuError(RuntimeError):
    """CRIU failed or timed out. ``errors`` holds the ``Error (file:line): ...`` and ``Warn (...)`` lines of
    its log (the last :data:`ERROR_LINES_KEPT`), ``log_tail`` the end of the log, ``cause`` a short name of the
    known cause found in the error lines (``io_uring``, ``no_space``, ``pid_taken``,
    ``image_unreadable``, ``traced``, ``timeout``...; the tail is searched only when they name none),
    and :attr:`summary` what a person reads first: the error lines, or the tail without them."""

    def __init__(self, message: str, *, log_path: Path, timed_out: bool = False) -> None:
        self.log_path = log_path
        self.log_tail = tail(log_path)
        self.errors = error_lines(log_path)
        self.timed_out = timed_out
        self.cause = "timeout" if timed_out else classify("\n".join(self.errors), self.log_tail)
        super().__init__(f"{message} [{self.cause}]\n--- {log_path} ---\n{self.summary}")

    @property
    def summary(self) -> str:
        """CRIU's own error and warning lines (the cause, not the last lines it logged before giving up, which at -v4
        are often its vdso or cgroup chatter); the log's tail where it logged no error line."""
        return "\n".join(self.errors) if self.errors else self.log_tail


# hack/patches/criu/0002: each restored process's restorer says how it read its pages, at -v4 and above.
_PAGES_READ = re.compile(rb"dynsnap: read (\d+) bytes of pages with (\d+) threads")
_LOG_SCAN_LIMIT = 256 << 20  # a restore log at -v4 is a few MiB; never read more than this


@dataclass(frozen=True)
class PagesRead:
    """What the restorers of a tree said of their page reads: bytes in all, the most threads one
    used, and how many processes read theirs that way."""

    bytes: int
    threads: int
    processes: int


def pages_read(log_path: Path) -> PagesRead | None:
    """How CRIU's restorers read the pages (hack/patches/criu/0002), from a restore log. None when no
    process read its pages with the patch's threads: a stock CRIU, one thread, or too few pages."""
    try:
        with open(log_path, "rb") as f:
            data = f.read(_LOG_SCAN_LIMIT)
    except OSError:
        return None
    # one search over the bytes, not a loop over lines: this runs on the wake's path, before the GPU resume
    found = [(int(m.group(1)), int(m.group(2))) for m in _PAGES_READ.finditer(data)]
    if not found:
        return None
    return PagesRead(bytes=sum(b for b, _ in found), threads=max(t for _, t in found), processes=len(found))


_CAUSES = (
    ("io_uring", re.compile(r"io_uring|Can't retrieve FDs|send_fds failed", re.I)),
    ("no_space", re.compile(r"No space left on device|ENOSPC|errno 28\b|\(28\)", re.I)),
    ("pid_taken", re.compile(r"(clone|fork).*(File exists|EEXIST)|Pid \d+ already|set_next_pid|ns_last_pid", re.I)),
    # An image CRIU cannot read back: a protobuf it cannot unpack, a file cut short or missing (a
    # corrupted or partly deleted capture: no retry makes it restorable).
    ("image_unreadable", re.compile(r"Failed unpacking object|Unexpected EOF|Can't open .*\.img|"
                                    r"(read|open)[^\n]*\.img[^\n]*(No such file|Input/output)|"
                                    r"Unable to open [^\n]*\.img|magic mismatch|Bad magic", re.I)),
    # Another tracer holds a task (a debugger, strace): CRIU cannot seize it.
    ("traced", re.compile(r"Unable to interrupt task|Unable to seize", re.I)),
    ("tcp", re.compile(r"tcp|socket", re.I)),
)
# CRIU's error lines: "(00.027392) Error (criu/protobuf.c:101): ...", in a restored task's part of the
# log with its pid ("(00.5)   1234: Error (...)"), and from the restorer blob ("pie: 1234: Error (...)");
# and its warnings, which often carry the cause the errors then report the consequences of ("Warn
# (compel/src/lib/infect.c:132): Unable to interrupt task: 10000 (Operation not permitted)", then "Error
# (...): Unable to detach ...", "Error (...): Dumping FAILED.").
_ERROR_LINE = re.compile(rb"^\(\s*[\d.]+\)\s+(?:pie:\s*)?(?:\d+:\s+)?((?:Error|Warn) +\([^)]*\):[^\n]*)$", re.M)
ERROR_LINES_KEPT = 12  # the last ones: the first of a failure is usually among them, its consequences after
_ERROR_LINE_MAX = 400  # characters of one line kept


def classify(errors: str, log_tail: str = "") -> str:
    """A short name for the first known cause in CRIU's error lines (``errors``); where they name none,
    in the lines of ``log_tail`` that speak of an error (or, with none such, all of it); ``unknown``
    when nothing matches."""
    for text in (errors, "\n".join(x for x in log_tail.splitlines() if "err" in x.lower()) or log_tail):
        for name, pattern in _CAUSES:
            if text and pattern.search(text):
                return name
    return "unknown"


def error_lines(path: Path) -> list[str]:
    """The ``Error (file:line): ...`` and ``Warn (file:line): ...`` lines of a CRIU log, the last
    :data:`ERROR_LINES_KEPT` of them, each at most ``_ERROR_LINE_MAX`` characters (at most
    ``_LOG_SCAN_LIMIT`` bytes of the log are read)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_LOG_SCAN_LIMIT)
    except OSError:
        return []
    found = [m.group(1).decode(errors="replace")[:_ERROR_LINE_MAX] for m in _ERROR_LINE.finditer(data)]
    return found[-ERROR_LINES_KEPT:]


def tail(path: Path, limit: int = 3000) -> str:
    """The last ``limit`` bytes of a log (only those are read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - limit, 0))
            data = f.read(limit)
    except OSError:
        return "(no log)"
    return data.decode(errors="replace")


def dump_completed(images_dir: Path) -> bool:
    """CRIU finished this dump (its log says so): the tree it names is on disk and gone."""
    return DUMP_DONE in tail(images_dir / DUMP_LOG, 400)
