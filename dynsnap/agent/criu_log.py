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
    its log (the last :data:`ERROR_LINES_KEPT`), ``log_tail`` the end of the log, ``decisive`` the one of
    them that ended the run (:func:`decisive`), ``cause`` a short name of the known cause (``io_uring``,
    ``no_space``, ``pid_taken``, ``image_unreadable``, ``traced``, ``launcher``, ``timeout``, ``killed``
    (by a signal from outside, ``signal``)...: read from
    the decisive line first, then every error line, then the tail's talk of errors, and where CRIU left no
    log at all from ``message``, what the agent saw of the run), and :attr:`summary` what a person reads
    first."""

    def __init__(self, message: str, *, log_path: Path, timed_out: bool = False, signal: int | None = None) -> None:
        self.message = message
        self.log_path = log_path
        self.log_tail = tail(log_path)
        self.errors = error_lines(log_path)
        self.decisive = decisive(self.errors)
        self.timed_out = timed_out
        if timed_out:
            self.cause = "timeout"
        elif signal is not None:  # killed from outside (the pod sees CRIU in its namespace; the OOM killer)
            self.cause = "killed"
        elif self.errors or self.log_tail != NO_LOG:
            self.cause = classify("\n".join(self.errors), self.log_tail, first=self.decisive)
        else:  # CRIU never wrote its log (it did not start): what the agent saw is all there is
            self.cause = classify(message)
        super().__init__(f"{message} [{self.cause}]\n--- {log_path} ---\n{self.summary}")

    @property
    def summary(self) -> str:
        """CRIU's own error and warning lines, the one that ended the run first (not the last lines it logged
        before giving up, which at -v4 are often its vdso or cgroup chatter, nor an earlier error it went on
        from); the agent's own account and the log's tail where it logged no error line; the agent's
        account alone where there is no log (a CRIU that never started: its launcher's words). A CRIU killed
        from outside: the agent's account first (``... was killed (signal 9)``), then the lines it logged
        before, which say nothing of why it stopped (a kerndat probe's ``tun: Unable to create tun`` on the
        first run of a node, seen when a pod killed CRIU mid-restore)."""
        if self.cause == "killed":
            return "\n".join([self.message, *self.errors]) if self.errors else self.message
        if self.errors:
            rest = [x for x in self.errors if x != self.decisive]
            return "\n".join(([self.decisive] if self.decisive else []) + rest)
        if self.log_tail == NO_LOG:
            return self.message
        return f"{self.message}\n{self.log_tail}"


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
    # CRIU never ran: its launcher (dynsnap-nsexec) failed or refused, and said why.
    ("launcher", re.compile(r"dynsnap-nsexec:", re.I)),
    ("io_uring", re.compile(r"io_uring|Can't retrieve FDs|send_fds failed", re.I)),
    ("no_space", re.compile(r"No space left on device|ENOSPC|errno 28\b|\(28\)", re.I)),
    ("pid_taken", re.compile(r"(clone|fork).*(File exists|EEXIST)|Pid \d+ already|set_next_pid|ns_last_pid", re.I)),
    # An image CRIU cannot read back: a protobuf it cannot unpack, a file cut short or missing (a
    # corrupted or partly deleted capture: no retry makes it restorable).
    ("image_unreadable", re.compile(r"Failed unpacking object|Unexpected EOF|Can't open .*\.img|"
                                    r"(read|open)[^\n]*\.img[^\n]*(No such file|Input/output)|"
                                    r"Unable to open [^\n]*\.img|magic mismatch|Bad magic|"
                                    # damaged pages: the restorer finds no ELF where the vDSO was dumped
                                    r"Invalid ELF magic", re.I)),
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


# Error lines that only report a failure's consequences (the cascade CRIU logs after the line that ended the
# run), and the one error CRIU logs on every run and goes on from (it raises the limit it can).
_CONSEQUENCE = re.compile(r"(Dumping|Restoring) FAILED|Restorer fail|failed with -?\d+\s*$|exited, status=|"
                          r"Unable to detach from|rlimit: Can't setup RLIMIT_NOFILE", re.I)


def decisive(errors: list[str]) -> str | None:
    """The error (or warning) line that ended the run: the last one that is not a consequence of another
    (``Restoring FAILED``, ``Restorer fail``, ``... failed with -1``) nor the rlimit line of every run. An
    earlier error CRIU went on from (``tun: Unable to create tun`` before a damaged image's ``vdso: Invalid
    ELF magic``) is not it. None when every line is a consequence."""
    return next((x for x in reversed(errors) if not _CONSEQUENCE.search(x)), None)


def classify(errors: str, log_tail: str = "", *, first: str | None = None) -> str:
    """A short name for the known cause in ``first`` (the line that ended the run); where it names none, the
    first known cause in CRIU's error lines (``errors``); where they name none, in the lines of ``log_tail``
    that speak of an error (or, with none such, all of it); ``unknown`` when nothing matches."""
    for text in (first or "", errors, "\n".join(x for x in log_tail.splitlines() if "err" in x.lower()) or log_tail):
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


NO_LOG = "(no log)"


def tail(path: Path, limit: int = 3000) -> str:
    """The last ``limit`` bytes of a log (only those are read); ``NO_LOG`` where there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - limit, 0))
            data = f.read(limit)
    except OSError:
        return NO_LOG
    return data.decode(errors="replace")


def dump_completed(images_dir: Path) -> bool:
    """CRIU finished this dump (its log says so): the tree it names is on disk and gone."""
    return DUMP_DONE in tail(images_dir / DUMP_LOG, 400)


RESTORE_DONE = "Restore finished successfully"


def restore_completed(images_dir: Path) -> bool:
    """CRIU's last restore from these images finished (its log says so, among its last lines): the tree is
    whole and runs, whether or not the agent that started it lived to see it."""
    return RESTORE_DONE in tail(images_dir / RESTORE_LOG, 4096)
