"""The constants C and Python share (native/include/dynsnap_protocol.h) cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

from dynsnap.models import protocol

HEADER = Path(__file__).resolve().parents[2] / "native" / "include" / "dynsnap_protocol.h"

# header macro -> its Python mirror; every DYNSNAP_ macro in the header must be listed here
MIRRORS: dict[str, object] = {
    "DYNSNAP_PID_FLOOR": protocol.PID_FLOOR,
    "DYNSNAP_CONTROL_DIR_DEFAULT": protocol.ENTRYPOINT_CONTROL_DIR,
    "DYNSNAP_CONTROL_FILE": protocol.ENTRYPOINT_CONTROL_FILE,
    "DYNSNAP_CONTROL_FORMAT": protocol.ENTRYPOINT_CONTROL_FORMAT,
    "DYNSNAP_REQUEST_FILE": protocol.ENTRYPOINT_REQUEST_FILE,
    "DYNSNAP_LOG_FILE": protocol.ENTRYPOINT_LOG_FILE,
    "DYNSNAP_PROBE_PORT_DEFAULT": protocol.ENTRYPOINT_PROBE_PORT,
    "DYNSNAP_EXIT_NO_WORKER": protocol.ENTRYPOINT_EXIT_NO_WORKER,
    **{f"DYNSNAP_STATE_{s.name}": s.value for s in protocol.EntrypointState},
}


def header_constants() -> dict[str, object]:
    """`#define DYNSNAP_X value` lines, value an integer or a plain string literal."""
    found: dict[str, object] = {}
    for line in HEADER.read_text().splitlines():
        m = re.match(r"\s*#\s*define\s+(DYNSNAP_\w+)\s+(.*?)\s*(?:/\*.*)?$", line)
        if not m or m.group(1) == "DYNSNAP_PROTOCOL_H":
            continue
        raw = m.group(2)
        if re.fullmatch(r"-?\d+", raw):
            found[m.group(1)] = int(raw)
        elif re.fullmatch(r'"[^"\\]*"', raw):
            found[m.group(1)] = raw[1:-1]
        else:
            raise AssertionError(f"{HEADER.name}: cannot read {m.group(1)} = {raw!r}; keep values simple")
    return found


def test_every_header_constant_has_an_equal_python_mirror() -> None:
    found = header_constants()
    assert set(found) == set(MIRRORS), "add the new constant to protocol.py and to MIRRORS"
    assert found == MIRRORS


def test_entrypoint_states_are_exactly_the_headers() -> None:
    states = {v for k, v in header_constants().items() if k.startswith("DYNSNAP_STATE_")}
    assert states == {s.value for s in protocol.EntrypointState}
    assert len(states) == 6
