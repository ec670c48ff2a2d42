"""bench/scale's results as a Markdown table (medians over the runs of each size) and a PNG against
fleet size; with ``--set LABEL=DIR`` (repeated), several sets side by side (e.g. before and after a fix).

    python bench/scale/summary.py RESULTS_DIR [--png PATH]
    python bench/scale/summary.py --set before=DIR --set after=DIR [--png PATH]

A run is ``RESULTS_DIR/size-N/run-R.json`` as ``run.py`` writes it. Per run: p50 and p99 of the
decision latencies (idle threshold -> the controller's decision) and of the wake latencies (demand
change at the frontend -> the wake request), the quiet minute's CPU seconds and API requests per
second by verb, RSS; then the median of each over the runs. A run that failed (``error``) is listed
with its error and left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def load(d: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for f in sorted(d.glob("size-*/run-*.json")):
        r = json.loads(f.read_text())
        size = int(f.parent.name.removeprefix("size-"))
        r.setdefault("size", size)
        out.setdefault(size, []).append(r)
    return dict(sorted(out.items()))


def per_run(r: dict[str, Any]) -> dict[str, float | None]:
    q = r.get("quiet") or {}
    rps = q.get("api_rps") or {}
    return {
        "decision_p50": pct(r.get("decision_latency_s") or [], 0.50),
        "decision_p99": pct(r.get("decision_latency_s") or [], 0.99),
        "decision_max": max(r.get("decision_latency_s") or [float("nan")]),
        "decisions": float(r.get("decisions") or 0),
        "wake_p50": pct(r.get("wake_latency_s") or [], 0.50),
        "wake_p99": pct(r.get("wake_latency_s") or [], 0.99),
        "wake_seen_p50": pct(r.get("wake_seen_by_agent_s") or [], 0.50),
        "wake_seen_p99": pct(r.get("wake_seen_by_agent_s") or [], 0.99),
        "quiet_cpu_s_per_min": q.get("cpu_s_per_min"),
        "quiet_rps_total": sum(rps.values()) if q else None,
        **{f"quiet_rps_{v}": rps.get(v, 0.0) if q else None for v in ("GET", "PUT", "PATCH", "POST", "DELETE")},
        "quiet_reconciles": q.get("reconciles"),
        "rss_mib": q["rss_bytes"] / 2**20 if q.get("rss_bytes") else None,
        "peak_rss_mib": r["end_hwm_bytes"] / 2**20 if r.get("end_hwm_bytes") else None,
        "start_synced_s": r.get("start_synced_s"),
        "start_first_pass_s": r.get("start_first_pass_s"),
        "idle_cpu_s_per_decision": ((r.get("idle_phase") or {}).get("cpu_s", 0) / r["decisions"]
                                    if r.get("decisions") else None),
        "idle_reconciles_per_decision": ((r.get("idle_phase") or {}).get("reconciles", 0) / r["decisions"]
                                         if r.get("decisions") else None),
        "load1": (r.get("loadavg") or [None])[0],
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    ok = [per_run(r) for r in runs if "error" not in r]
    if not ok:
        return {}
    out: dict[str, float | None] = {}
    for k in ok[0]:
        vals = [v for x in ok if (v := x[k]) is not None and not math.isnan(v)]
        out[k] = statistics.median(vals) if vals else None
    return out


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


ROWS = [
    ("decision latency p50 (s)", "decision_p50", ".3f"),
    ("decision latency p99 (s)", "decision_p99", ".3f"),
    ("decision latency max (s)", "decision_max", ".3f"),
    ("decisions per run", "decisions", ".0f"),
    ("demand → wake request p50 (s)", "wake_p50", ".2f"),
    ("demand → wake request p99 (s)", "wake_p99", ".2f"),
    ("demand → agent sees the wake p50 (s)", "wake_seen_p50", ".2f"),
    ("demand → agent sees the wake p99 (s)", "wake_seen_p99", ".2f"),
    ("RSS, quiet (MiB)", "rss_mib", ".0f"),
    ("peak RSS (MiB)", "peak_rss_mib", ".0f"),
    ("CPU s per minute, quiet", "quiet_cpu_s_per_min", ".2f"),
    ("API requests/s, quiet: GET", "quiet_rps_GET", ".3f"),
    ("API requests/s, quiet: PUT", "quiet_rps_PUT", ".3f"),
    ("API requests/s, quiet: PATCH", "quiet_rps_PATCH", ".3f"),
    ("API requests/s, quiet: POST", "quiet_rps_POST", ".3f"),
    ("reconciles, quiet minute", "quiet_reconciles", ".0f"),
    ("CPU s per decision, idle phase", "idle_cpu_s_per_decision", ".3f"),
    ("reconciles per decision, idle phase", "idle_reconciles_per_decision", ".0f"),
    ("start: informers synced (s)", "start_synced_s", ".1f"),
    ("start: first pass over every worker (s)", "start_first_pass_s", ".1f"),
    ("machine load average (1 min) at the run's end", "load1", ".1f"),
]


def table(sets: list[tuple[str, dict[int, list[dict[str, Any]]]]]) -> str:
    cols: list[tuple[str, int, dict[str, float | None], int]] = []
    for label, data in sets:
        for size, runs in data.items():
            cols.append((label, size, medians(runs), sum(1 for r in runs if "error" not in r)))
    head = "| median over runs | " + " | ".join(
        f"{size:,} workers{f' ({label})' if label else ''}, {n} runs" for label, size, _, n in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for title, key, spec in ROWS:
        lines.append(f"| {title} | " + " | ".join(fmt(m.get(key), spec) for _, _, m, _ in cols) + " |")
    failed = [(label, r) for label, data in sets for runs in data.values() for r in runs if "error" in r]
    for label, r in failed:
        lines.append(f"\nFailed run ({label or 'results'}): size {r.get('size')} run {r.get('run')}: "
                     f"{r['error'][:300]}")
    return "\n".join(lines) + "\n"


def plot(sets: list[tuple[str, dict[int, list[dict[str, Any]]]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    panels = [
        ("idle threshold → decision (s)", [("p50", "decision_p50"), ("p99", "decision_p99")], 1.0),
        ("demand change → wake request (s)", [("p50", "wake_p50"), ("p99", "wake_p99")], None),
        ("controller RSS, quiet (MiB)", [("RSS", "rss_mib"), ("peak", "peak_rss_mib")], 1024.0),
        ("controller CPU s per minute, quiet", [("CPU", "quiet_cpu_s_per_min")], None),
        ("API requests/s while quiet", [("GET", "quiet_rps_GET"), ("PUT", "quiet_rps_PUT"),
                                        ("PATCH", "quiet_rps_PATCH"), ("POST", "quiet_rps_POST")], None),
        ("CPU s per decision (idle phase)", [("CPU", "idle_cpu_s_per_decision")], None),
    ]
    # colour: the series (p50, p99, ...); line and marker: the set (the last one solid, with dots)
    styles = [(":", "x"), ("--", "s"), ("-", "o")][-len(sets):] if len(sets) <= 3 else [("-", "o")] * len(sets)
    for ax, (title, series, target) in zip(axes.flat, panels, strict=True):
        for (label, data), (line, mark) in zip(sets, styles, strict=True):
            sizes = list(data)
            meds = [medians(data[s]) for s in sizes]
            for j, (name, key) in enumerate(series):
                ys = [m.get(key) for m in meds]
                xs = [s for s, y in zip(sizes, ys, strict=True) if y is not None]
                ys2 = [y for y in ys if y is not None]
                if xs:
                    ax.plot(xs, ys2, line, marker=mark, color=f"C{j}",
                            label=f"{name}{f' ({label})' if label else ''}")
        if target is not None:
            ax.axhline(target, color="red", linewidth=0.8, linestyle=":", label="target")
        ax.set_ylim(bottom=0)
        ax.set_xscale("log")
        ax.set_xlabel("kwok worker pods")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("dynsnap controller at scale (bench/scale; medians over runs)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, nargs="?")
    p.add_argument("--set", action="append", default=[], metavar="LABEL=DIR", help="a labelled results directory")
    p.add_argument("--png", type=Path)
    args = p.parse_args()
    sets = [(label, load(Path(d))) for label, _, d in (x.partition("=") for x in args.set)]
    if args.results:
        sets.append(("", load(args.results)))
    if not sets:
        p.error("give a results directory or --set LABEL=DIR")
    print(table(sets))
    if args.png:
        plot(sets, args.png)
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
