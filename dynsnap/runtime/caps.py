"""A process's Linux capability sets, as ``/proc/<pid>/status`` states them, by name.

Layer: ``dynsnap.runtime`` (generic node facts). The agent compares a worker's sets with its own before a
snapshot: CRIU restores every task's capabilities from the image with ``capset(2)`` and trims its bounding
set with ``PR_CAPBSET_DROP``, so it can give back only capabilities it holds itself; a worker holding one
the agent's container does not hold would fail its restore (``Unable to restore capabilities``) or come
back without a bounding bit it had. The agent refuses such a snapshot before anything changes.
"""

from __future__ import annotations

from pathlib import Path

# include/uapi/linux/capability.h, by number.
NAMES: tuple[str, ...] = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE",
)
# Every set a restore has to give back: inheritable, permitted, effective, bounding, ambient.
SETS: tuple[str, ...] = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


def names(mask: int) -> list[str]:
    """``CAP_``-less names of the bits of ``mask`` (an unknown bit as ``cap<N>``)."""
    return [NAMES[b] if b < len(NAMES) else f"cap{b}" for b in range(mask.bit_length()) if mask >> b & 1]


def sets(pid: int | str, proc: Path = Path("/proc")) -> dict[str, int] | None:
    """The process's capability sets by their ``status`` key; None when it is gone or the file says no
    such thing (a set that does not parse is absent, not zero: the caller refuses on what it cannot
    read)."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in SETS:
            try:
                found[key] = int(value.strip(), 16)
            except ValueError:
                return None
    return found if len(found) == len(SETS) else None


def union(found: dict[str, int]) -> int:
    """Every capability any of the sets names."""
    mask = 0
    for value in found.values():
        mask |= value
    return mask
