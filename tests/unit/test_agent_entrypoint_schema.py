"""What the entrypoint reports, as the agent reads it (issue 18): ``entrypoint.json`` is parsed with
its schema (dynsnap/models/entrypoint.py) and a byte bound, through the trust boundary; an oversized,
malformed or mistyped file is the named refusal EntrypointUnreadable, naming the field and never
echoing the worker's value; a missing one stays "not under the entrypoint"; fields a newer entrypoint
adds are ignored. The file the real entrypoint writes is read by tests/native/test_entrypoint.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dynsnap.agent.container import UnsafeContainerPath
from dynsnap.agent.entrypoint_control import EntrypointControl, EntrypointError, EntrypointUnreadable
from dynsnap.models import protocol as P

# docs/ENTRYPOINT.md's example, as native/entrypoint/control.c writes it
SAMPLE: dict[str, Any] = {
    "format": 1, "pid": 1, "worker_pid": 10000, "worker_pgid": 10000, "worker_sid": 10000, "worker_alive": True,
    "worker_status": None, "system_port": 9090, "probe_port": 8081, "state": "active", "request_seq": 0,
    "request_error": None, "request_wakeup": "inotify", "request_noticed": None, "pid_floor": 10000,
    "pid_reserved": True, "seccomp": "on", "log_file": "/run/dynsnap/worker.log",
    "thp_preload": "/dynsnap/bin/libdynsnap-thp.so", "started": 1795946909.569, "updated": 1795946909.574}


def _control(tmp_path: Path, content: bytes | None) -> EntrypointControl:
    d = tmp_path / "run" / "dynsnap"
    d.mkdir(parents=True, exist_ok=True)
    if content is not None:
        (d / P.ENTRYPOINT_CONTROL_FILE).write_bytes(content)
    return EntrypointControl("/run/dynsnap", root=tmp_path)


def test_the_entrypoints_file_reads_as_the_mapping_it_always_was(tmp_path: Path) -> None:
    newer = {**SAMPLE, "a_field_of_a_newer_entrypoint": {"nested": [1, 2]}}
    info = _control(tmp_path, json.dumps(newer).encode()).read()
    assert info == SAMPLE  # validated, and only the fields this agent knows


UNUSABLE = [
    ("oversized", json.dumps({**SAMPLE, "pad": "x" * 70_000}).encode(), "is larger than 65536 bytes"),
    ("malformed", b'{"format": 1, "state": "act', "not JSON"),
    ("not-an-object", b"[1, 2]", "not a JSON object"),
    ("deeply-nested", b"[" * 50_000, "not JSON"),
    ("other-format", json.dumps({**SAMPLE, "format": 2}).encode(), "format 2, this agent speaks 1"),
    ("state-not-a-state", json.dumps({**SAMPLE, "state": "hacked"}).encode(), "state: Input should be"),
    ("seq-a-string", json.dumps({**SAMPLE, "request_seq": "3"}).encode(), "request_seq: Input should be a valid int"),
    ("pid-negative", json.dumps({**SAMPLE, "worker_pid": -1}).encode(), "worker_pid: Input should be greater"),
    ("bool-as-int", json.dumps({**SAMPLE, "pid_reserved": 1}).encode(), "pid_reserved: Input should be a valid bool"),
    ("started-missing", json.dumps({k: v for k, v in SAMPLE.items() if k != "started"}).encode(),
     "started: Field required"),
    ("nan", json.dumps(SAMPLE).replace("1795946909.569", "NaN").encode(), "not JSON"),
    ("long-error", json.dumps({**SAMPLE, "request_error": "e" * 600}).encode(), "request_error: String should"),
]


@pytest.mark.parametrize(("case", "content", "says"), UNUSABLE, ids=[c[0] for c in UNUSABLE])
def test_an_unusable_control_file_is_a_named_refusal(tmp_path: Path, case: str, content: bytes, says: str) -> None:
    with pytest.raises(EntrypointUnreadable, match=says) as caught:
        _control(tmp_path, content).read()
    assert caught.value.reason == P.Reason.ENTRYPOINT_UNREADABLE
    assert "hacked" not in str(caught.value) and "eeee" not in str(caught.value)  # the worker's values stay out


def test_a_missing_control_file_is_no_entrypoint_and_a_symlinked_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EntrypointError, match=r"cannot read /run/dynsnap/entrypoint\.json"):
        _control(tmp_path, None).read()
    (tmp_path / "elsewhere.json").write_text(json.dumps(SAMPLE))
    (tmp_path / "run" / "dynsnap" / P.ENTRYPOINT_CONTROL_FILE).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UnsafeContainerPath, match=r"'/run/dynsnap/entrypoint\.json' is a symlink"):
        _control(tmp_path, None).read()
    with pytest.raises(EntrypointError, match="no control directory /nowhere"):
        EntrypointControl("/nowhere", root=tmp_path).read()
