"""The PNG timeline of captures and wakes (dynsnap/controller/timeline.py): records as the controller
and the agent write them become operations, operations become rows and bars (by table), and the PNG
is written, decodes, has the size the layout asks for and shows each phase's colour; without
matplotlib the commands say how to install it."""

from __future__ import annotations

import struct
import sys
import zlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from dynsnap.controller import timeline as T

T0 = "2026-11-30T10:00:00Z"
T1 = "2026-11-30T10:00:05Z"
T2 = "2026-11-30T10:02:00Z"
T3 = "2026-11-30T10:02:03Z"


def _steps(*pairs: tuple[str, float]) -> list[dict[str, Any]]:
    return [{"name": n, "seconds": s} for n, s in pairs]


QUIESCE = {"id": "q1", "tier": "snapshot", "started": T0, "finished": T1, "ok": True,
           "steps": _steps(("gate", 0.2), ("endpoint-not-ready", 1.1), ("frontend-stopped-routing", 0.3),
                           ("drained", 0.05))}
CAPTURE = {"id": "c1", "tier": "snapshot", "started": T1, "finished": T1, "ok": True,
           "steps": _steps(("quiesce", 0.1), ("save", 2.5), ("dump", 4.0), ("seal", 0.2),
                           ("settle-snapshotted", 0.05))}
WAKE = {"id": "w1", "tier": "snapshot", "started": T2, "finished": T2, "ok": True,
        "steps": _steps(("wake", 0.1), ("restore", 3.0), ("resume", 1.5), ("settle-active", 0.1))}
VERIFY = {"wakeId": "w1", "ok": True, "reason": "Verified", "started": T3, "finished": T3, "requests": 3,
          "answered": 3, "steps": _steps(("identity+endpoint", 0.4), ("pinned-requests", 0.9))}
FAILED_WAKE = {"id": "w2", "tier": "snapshot", "started": T2, "ok": False,
               "error": {"reason": "CriuRestoreFailed", "message": "x", "step": "restore", "at": T2},
               "steps": _steps(("wake", 0.1), ("restore", 0.0))}
FAILED_VERIFY = {"wakeId": "w1", "ok": False, "reason": "PinnedRequestFailed", "started": T3,
                 "steps": _steps(("identity+endpoint", 0.4), ("pinned-requests", 30.0))}


@pytest.mark.parametrize(("kind", "record", "label", "ok", "reason", "seconds"), [
    ("quiesce", QUIESCE, "quiesce (controller)", True, None, 1.65),
    ("capture", CAPTURE, "capture (snapshot)", True, None, 6.85),
    ("wake", WAKE, "wake (snapshot)", True, None, 4.7),
    ("verify", VERIFY, "verify (controller)", True, None, 1.3),
    ("wake", FAILED_WAKE, "wake (snapshot)", False, "CriuRestoreFailed", 0.1),
    ("verify", FAILED_VERIFY, "verify (controller)", False, "PinnedRequestFailed", 30.4),
    ("capture", {"id": "c2", "tier": "suspend", "started": T1, "steps": _steps(("quiesce", 0.1))},
     "capture (suspend)", None, None, 0.1),
])
def test_a_record_becomes_an_operation(kind: str, record: dict[str, Any], label: str, ok: bool | None,
                                       reason: str | None, seconds: float) -> None:
    op = T.operation("w-0", kind, record)
    assert op is not None
    assert (op.worker, op.kind, op.label, op.ok, op.reason, op.seconds) == ("w-0", kind, label, ok, reason, seconds)
    assert op.steps == tuple((s["name"], s["seconds"]) for s in record["steps"])
    assert op.started == datetime.fromisoformat(record["started"].replace("Z", "+00:00"))


def test_no_record_no_operation() -> None:
    assert T.operation("w", "wake", None) is None and T.operation("w", "wake", {}) is None
    with pytest.raises(ValueError, match="unknown operation kind"):
        T.operation("w", "nap", WAKE)


def test_a_workersnapshot_gives_its_last_quiesce_capture_wake_and_verification() -> None:
    ws = {"metadata": {"name": "demo-worker-1"},
          "status": {"lastCapture": CAPTURE, "lastWake": WAKE,
                     "controller": {"quiesce": QUIESCE, "verification": VERIFY, "wake": {"id": "w1", "steps": []}}}}
    ops = T.operations_of(ws)
    assert [(o.worker, o.kind) for o in ops] == [("demo-worker-1", k) for k in ("quiesce", "capture", "wake", "verify")]
    assert T.operations_of({"metadata": {"name": "x"}, "status": {}}) == []


def test_layout_maps_records_to_rows_and_bars() -> None:
    ops = [T.operation("w-1", "wake", FAILED_WAKE), T.operation("w-1", "capture", CAPTURE)]
    lay = T.layout([o for o in ops if o is not None])
    # oldest first: the capture (10:00:05) before the wake (10:02:00)
    assert [(g.row, g.title, g.ok) for g in lay.groups] == [
        (0, "w-1  capture (snapshot)  at 10:00:05  6.85 s  ok", True),
        (6, "w-1  wake (snapshot)  at 10:02:00  0.10 s  FAILED CriuRestoreFailed", False),
    ]
    got = [(b.row, b.group, b.label, b.start, b.seconds, b.phase, b.failed) for b in lay.bars]
    assert got == [
        (1, 0, "quiesce (entrypoint)", 0.0, 0.1, "quiesce", False),
        (2, 0, "lock + checkpoint (dynsnap-cuda)", 0.1, 2.5, "lock + checkpoint", False),
        (3, 0, "dump (CRIU)", 2.6, 4.0, "dump", False),
        (4, 0, "seal (guard, manifest)", 6.6, 0.2, "dump", False),
        (5, 0, "settle: snapshotted", 6.8, 0.05, "other", False),
        (7, 1, "wake (entrypoint)", 0.0, 0.1, "restore", False),
        (8, 1, "restore (CRIU)", 0.1, 0.0, "restore", True),
    ]
    assert lay.rows == 9 and lay.span == 6.85


def test_layout_of_a_whole_cycle_has_every_phase_in_order() -> None:
    ops = [T.operation("w", k, r) for k, r in (("verify", VERIFY), ("wake", WAKE), ("quiesce", QUIESCE),
                                               ("capture", CAPTURE))]
    lay = T.layout([o for o in ops if o is not None])
    assert [g.title.split("  ")[1] for g in lay.groups] == ["quiesce (controller)", "capture (snapshot)",
                                                            "wake (snapshot)", "verify (controller)"]
    phases = []
    for b in lay.bars:
        if not phases or phases[-1] != b.phase:
            phases.append(b.phase)
    assert phases == ["quiesce", "lock + checkpoint", "dump", "other", "restore", "resume", "other", "verify"]
    unknown = T.layout([T.Operation("w", "wake", "wake (x)", None, (("brand-new-step", 1.0),), None)])
    assert [(b.label, b.phase) for b in unknown.bars] == [("brand-new-step", "other")]
    assert unknown.groups[0].title == "w  wake (x)  at ?  1.00 s  under way"


def _png_header(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    length, ctype = struct.unpack(">I4s", data[8:16])
    assert ctype == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    crc = struct.unpack(">I", data[29:33])[0]
    assert crc == zlib.crc32(data[12:29]) & 0xFFFFFFFF  # the IHDR chunk is intact
    return width, height


def test_png_is_written_decodes_and_shows_the_bars(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    ops = [o for o in (T.operation("demo-worker-1", k, r) for k, r in (
        ("quiesce", QUIESCE), ("capture", CAPTURE), ("wake", WAKE), ("verify", VERIFY))) if o is not None]
    out = tmp_path / "sub" / "timeline.png"
    size = T.write_timeline(ops, out, title="demo-worker-1: one cycle")
    lay = T.layout(ops)
    assert size == T.figure_size(lay) == _png_header(out.read_bytes())
    pixels = matplotlib.image.imread(str(out))
    assert pixels.shape[:2] == (size[1], size[0])
    colours = {tuple(int(c * 255 + 0.5) for c in px[:3]) for row in pixels[::2] for px in row[::2]}
    for phase in ("quiesce", "lock + checkpoint", "dump", "restore", "resume", "verify"):
        hexcol = T.PHASE_COLORS[phase]
        rgb = tuple(int(hexcol[i:i + 2], 16) for i in (1, 3, 5))
        assert rgb in colours, (phase, hexcol)


def test_png_size_grows_with_the_rows() -> None:
    one = T.layout([T.Operation("w", "wake", "wake (x)", datetime(2026, 1, 1, tzinfo=UTC), (("wake", 1.0),), True)])
    assert T.figure_size(one) == (T.WIDTH_PX, T.TOP_PX + 2 * T.ROW_PX + T.BOTTOM_PX)


def test_nothing_to_draw_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no recorded step"):
        T.write_timeline([], tmp_path / "x.png", title="t")
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_the_message_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(T.PlotsUnavailable, match=r"pip install 'dynsnap\[plots\]'"):
        T.write_timeline([T.Operation("w", "wake", "wake (x)", None, (("wake", 1.0),), True)], tmp_path / "x.png",
                         title="t")
    assert not (tmp_path / "x.png").exists()


def test_status_timeline_without_matplotlib_exits_2_before_asking_the_cluster(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from dynsnap.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # No cluster behind this kubeconfig path at all: the command must stop before it would read it.
    rc = main(["status", "--timeline", "w-0", "-o", str(tmp_path / "w.png"), "--kubeconfig", str(tmp_path / "none")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "drawing a timeline needs matplotlib" in err and "pip install 'dynsnap[plots]'" in err, err
    assert "kubeconfig" not in err and not (tmp_path / "w.png").exists()


@pytest.mark.parametrize(("argv", "error"), [
    (["status", "-o", "yaml"], "argument -o/--output: invalid choice: 'yaml'"),
    (["status", "--timeline", "w-0", "--watch"], "--timeline POD draws one worker: not with --watch or -A"),
    (["status", "--timeline", "w-0", "-A"], "--timeline POD draws one worker: not with --watch or -A"),
])
def test_status_refuses_bad_output_and_timeline_combinations(argv: list[str], error: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from dynsnap.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and error in capsys.readouterr().err
