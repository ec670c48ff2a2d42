"""The stand-in driver forgets the state of pid namespaces no process is in any more (their pods are
gone; the real driver's state went with the processes), and keeps that of live ones
(dynsnap_parts.StubDriver.forget_dead_namespaces): else a later pod whose pid namespace reuses the
inode number, its worker at the same pid (the entrypoint's pid floor), would look checkpointed."""

from __future__ import annotations

import os
from pathlib import Path

from dynsnap.testenv.dynsnap_parts import NSKEY_SHIFT, StubDriver

DEAD = 12345  # no pid namespace has this inode: proc gives them 0xEFFFFFFC (the initial one) and up


def test_only_dead_namespaces_are_forgotten(tmp_path: Path) -> None:
    driver = StubDriver(tmp_path)
    driver.state_dir.mkdir(parents=True)
    live = os.stat(f"/proc/{os.getpid()}/ns/pid").st_ino
    (driver.state_dir / "state").write_text(f"{(DEAD << NSKEY_SHIFT) | 10000} 2\n{(live << NSKEY_SHIFT) | 10000} 1\n")
    assert driver.forget_dead_namespaces() == [DEAD]
    assert driver.states() == {(live << NSKEY_SHIFT) | 10000: 1}
    assert driver.forget_dead_namespaces() == []
