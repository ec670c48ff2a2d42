"""PNG timelines of captures and wakes: each operation's steps as horizontal bars with their
measured durations (layer: controller; ``dynsnap demo`` and ``dynsnap status --timeline POD``).

The records are the ones the controller and the agent write on a WorkerSnapshot (wire form,
camelCase): the controller's quiesce (serving gate False, endpoint not ready, frontend stopped
routing, nothing in flight), the agent's capture (quiesce, save = lock + checkpoint of every GPU
process by dynsnap-cuda, dump and seal for a snapshot), the agent's wake (wake, CRIU restore,
resume = GPU restore + unlock) and the controller's verification (identity and endpoint, pinned
requests). The agent records ``save`` as one step: the lock and the checkpoint happen inside one
dynsnap-cuda call, so they are one bar, labelled as both.

Two parts: :func:`layout` maps operations to rows and bars (pure, tested by table), and
:func:`render_png` draws a layout with matplotlib, which is the ``plots`` extra: without it
:class:`PlotsUnavailable` says how to install it. Each operation is a group of rows with a header
(worker, operation, when, total, outcome); its steps' bars start where the previous step ended, in
seconds since the operation started, so a 0.01 s settle next to a 20 s dump still shows its number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

INSTALL_HINT: Final = "pip install 'dynsnap[plots]'"

# What each recorded step is, for a person (step names: dynsnap/agent/plan.py Step, and the
# controller's quiesce and verification steps in dynsnap/controller/reconciler.py).
STEP_LABELS: Final[Mapping[str, str]] = {
    "gate": "serving gate False",
    "endpoint-not-ready": "endpoint not ready",
    "frontend-stopped-routing": "frontend stopped routing",
    "drained": "nothing in flight",
    "wait-helper": "wait for a running helper",
    "quiesce": "quiesce (entrypoint)",
    "save": "lock + checkpoint (dynsnap-cuda)",
    "gpu-rollback": "GPU rollback",
    "settle-suspended": "settle: suspended",
    "dump": "dump (CRIU)",
    "seal": "seal (guard, manifest)",
    "settle-snapshotted": "settle: snapshotted",
    "wake": "wake (entrypoint)",
    "restore": "restore (CRIU)",
    "resume": "resume: GPU restore + unlock",
    "unlock": "unlock",
    "settle-active": "settle: active",
    "cleanup": "cleanup",
    "give-up": "give up (cold restart)",
    "identity+endpoint": "identity + endpoint ready",
    "pinned-requests": "pinned requests",
}

# The phase a step belongs to (a bar's colour).
STEP_PHASES: Final[Mapping[str, str]] = {
    "gate": "quiesce", "endpoint-not-ready": "quiesce", "frontend-stopped-routing": "quiesce",
    "drained": "quiesce", "quiesce": "quiesce",
    "save": "lock + checkpoint", "gpu-rollback": "lock + checkpoint",
    "dump": "dump", "seal": "dump",
    "wake": "restore", "restore": "restore",
    "resume": "resume", "unlock": "resume",
    "identity+endpoint": "verify", "pinned-requests": "verify",
}
PHASE_COLORS: Final[Mapping[str, str]] = {
    "quiesce": "#4e79a7", "lock + checkpoint": "#f28e2b", "dump": "#e15759", "restore": "#59a14f",
    "resume": "#76b7b2", "verify": "#edc948", "other": "#bab0ac",
}

KINDS: Final = ("quiesce", "capture", "wake", "verify")


@dataclass(frozen=True)
class Operation:
    """One quiesce, capture, wake or verification of one worker, as recorded."""

    worker: str
    kind: str  # one of KINDS
    label: str  # "capture (snapshot)"
    started: datetime | None
    steps: tuple[tuple[str, float], ...]
    ok: bool | None  # None: still under way
    reason: str | None = None  # why it failed

    @property
    def seconds(self) -> float:
        return round(sum(s for _, s in self.steps), 4)


def _time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    return None


def operation(worker: str, kind: str, record: Mapping[str, Any] | None) -> Operation | None:
    """An :class:`Operation` from a WorkerSnapshot record (``status.lastCapture``, ``status.lastWake``,
    ``status.controller.quiesce``, ``status.controller.verification``); None when there is none."""
    if not record:
        return None
    if kind not in KINDS:
        raise ValueError(f"unknown operation kind {kind!r}")
    steps = tuple((str(s.get("name", "?")), max(float(s.get("seconds") or 0.0), 0.0))
                  for s in record.get("steps") or [])
    ok = record.get("ok")
    reason: str | None = None
    if kind == "verify":
        label = "verify (controller)"
        if ok is False:
            reason = str(record.get("reason") or "") or None
    elif kind == "quiesce":
        label = "quiesce (controller)"
    else:
        label = f"{kind} ({record.get('tier', '?')})"
        err = record.get("error") or {}
        reason = str(err.get("reason")) if err.get("reason") else None
    return Operation(worker=worker, kind=kind, label=label, started=_time(record.get("started")), steps=steps,
                     ok=ok if isinstance(ok, bool) else None, reason=reason)


def operations_of(ws: Mapping[str, Any]) -> list[Operation]:
    """The operations one WorkerSnapshot records (its last quiesce, capture, wake, verification)."""
    name = str((ws.get("metadata") or {}).get("name") or "?")
    st = ws.get("status") or {}
    ctl = st.get("controller") or {}
    found = [operation(name, "quiesce", ctl.get("quiesce")), operation(name, "capture", st.get("lastCapture")),
             operation(name, "wake", st.get("lastWake")), operation(name, "verify", ctl.get("verification"))]
    return [op for op in found if op is not None and op.steps]


@dataclass(frozen=True)
class Group:
    """The header row of one operation."""

    row: int
    title: str
    ok: bool | None


@dataclass(frozen=True)
class Bar:
    """One step: a bar on row ``row`` from ``start`` for ``seconds`` (seconds since its operation began)."""

    row: int
    group: int
    step: str
    label: str
    start: float
    seconds: float
    phase: str
    failed: bool  # the step the operation failed at


@dataclass(frozen=True)
class Layout:
    groups: tuple[Group, ...]
    bars: tuple[Bar, ...]
    rows: int
    span: float  # the longest operation, seconds


def _outcome(op: Operation) -> str:
    if op.ok is None:
        return "under way"
    if op.ok:
        return "ok"
    return f"FAILED {op.reason}" if op.reason else "FAILED"


def title_of(op: Operation) -> str:
    when = f"{op.started:%H:%M:%S}" if op.started is not None else "?"
    return f"{op.worker}  {op.label}  at {when}  {op.seconds:.2f} s  {_outcome(op)}"


def layout(ops: Sequence[Operation]) -> Layout:
    """Rows from the top: for each operation (oldest first; ones with no start time after, in the
    order given), a header row, then one row per step, each bar starting where the last one ended."""
    ordered = sorted(enumerate(ops), key=lambda io: (io[1].started is None, io[1].started or datetime.min, io[0]))
    groups: list[Group] = []
    bars: list[Bar] = []
    row = 0
    span = 0.0
    for gi, (_, op) in enumerate(ordered):
        groups.append(Group(row=row, title=title_of(op), ok=op.ok))
        row += 1
        t = 0.0
        for si, (name, seconds) in enumerate(op.steps):
            failed = op.ok is False and si == len(op.steps) - 1
            bars.append(Bar(row=row, group=gi, step=name, label=STEP_LABELS.get(name, name), start=round(t, 4),
                            seconds=seconds, phase=STEP_PHASES.get(name, "other"), failed=failed))
            t += seconds
            row += 1
        span = max(span, t)
    return Layout(groups=tuple(groups), bars=tuple(bars), rows=row, span=round(span, 4))


# -- drawing (the plots extra) -----------------------------------------------------------------------

DPI: Final = 100
WIDTH_PX: Final = 1200
ROW_PX: Final = 24
LEFT_PX: Final = 300  # the step labels
TOP_PX: Final = 60  # the title
BOTTOM_PX: Final = 70  # the axis and the legend


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed (it is the ``plots`` extra)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"drawing a timeline needs matplotlib, which is not installed ({why}): {INSTALL_HINT}")


def check_plots() -> None:
    """Raise :class:`PlotsUnavailable` now, before any work, when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotsUnavailable(str(e)) from e


def figure_size(lay: Layout) -> tuple[int, int]:
    """The PNG's width and height in pixels."""
    return WIDTH_PX, TOP_PX + max(lay.rows, 1) * ROW_PX + BOTTOM_PX


def render_png(lay: Layout, path: Path, *, title: str) -> tuple[int, int]:
    """Draw ``lay`` into the PNG file ``path``; its size in pixels."""
    check_plots()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not lay.bars:
        raise ValueError("no recorded step to draw")
    w, h = figure_size(lay)
    fig = Figure(figsize=(w / DPI, h / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((LEFT_PX / w, BOTTOM_PX / h, 1 - (LEFT_PX + 30) / w, 1 - (TOP_PX + BOTTOM_PX) / h))
    span = lay.span or 1.0
    visible = span * 0.004  # a step of a few ms still shows as a sliver
    for b in lay.bars:
        ax.barh(b.row, max(b.seconds, visible), left=b.start, height=0.62, color=PHASE_COLORS[b.phase],
                edgecolor="#c00000" if b.failed else "none", hatch="//" if b.failed else None, linewidth=1.2)
        ax.text(b.start + max(b.seconds, visible) + span * 0.008, b.row, f"{b.seconds:.2f} s", va="center",
                fontsize=8, color="#333333")
    for g in lay.groups:
        ax.axhspan(g.row - 0.5, g.row + 0.5, color="#f2f2f2" if g.ok is not False else "#fbe3e3", zorder=0)
        ax.text(span * 0.005, g.row, g.title, va="center", ha="left", fontsize=9, fontweight="bold",
                color="#a00000" if g.ok is False else "#111111")
    ax.set_yticks([b.row for b in lay.bars], [b.label for b in lay.bars], fontsize=8)
    ax.set_ylim(lay.rows - 0.5, -0.5)  # row 0 at the top
    ax.set_xlim(0, span * 1.18)
    ax.set_xlabel("seconds since the operation started (each step as measured by the controller or the agent)",
                  fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    used = [p for p in PHASE_COLORS if any(b.phase == p for b in lay.bars)]
    fig.legend(handles=[Patch(color=PHASE_COLORS[p], label=p) for p in used], loc="lower center", ncol=len(used),
               fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11, y=1 - 18 / h)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return w, h


def write_timeline(ops: Sequence[Operation], path: Path, *, title: str) -> tuple[int, int]:
    """Lay out and draw ``ops`` into ``path`` (the PNG's size in pixels)."""
    return render_png(layout(ops), path, title=title)
