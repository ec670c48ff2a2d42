"""Markdown table of a bench/gpu/agent_h200.sh run: per tier and size, the agent's capture and wake
(seconds per step from its own JSON lines, and end to end per `dynsnap agent exec` call), GPU
memory, image bytes, the pattern check; and the cold start of the same bytes, for comparison.

    python3 bench/gpu/agent_table.py bench/gpu/results/h200-2026-11-30-agent
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def steps(path: Path) -> tuple[dict[str, float], dict[str, float]]:
    capture: dict[str, float] = {}
    wake: dict[str, float] = {}
    cur = capture
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "outcome" in rec:
            cur = wake
            continue
        if "step" in rec and "seconds" in rec:
            cur[rec["step"]] = rec["seconds"]
    return capture, wake


def main() -> None:
    d = Path(sys.argv[1])
    rows = [json.loads(line) for line in (d / "agent-summary.jsonl").read_text().splitlines()]
    print("| tier | GiB | capture steps (s) | capture, exec end to end (s) | wake steps (s) | "
          "wake to active (s) | wake, exec end to end (s) | GPU MiB before → asleep → after | image | check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["tier"] == "cold":
            continue
        cap, wake = steps(d / f"agent-{r['tier']}-{r['gib']}.jsonl")
        to_active = sum(v for k, v in wake.items() if k != "cleanup")
        fmt = lambda s: ", ".join(f"{k} {v:.2f}" for k, v in s.items())  # noqa: E731
        img = f"{r['image_bytes'] / 2**30:.1f} GiB" if r["image_bytes"] else "—"
        print(f"| {r['tier']} | {r['gib']} | {fmt(cap)} | {r['capture_s']:.2f} | {fmt(wake)} | {to_active:.2f} | "
              f"{r['wake_s']:.2f} | {' → '.join(str(u) for u in r['used_mib'])} | {img} | {r['check']} |")
    print()
    print("| cold start, GiB | page cache dropped: end to end (s) | warm cache: end to end, median of 2 (s) | "
          "of which import torch / CUDA context / disk → GPU (dropped) |")
    print("|---|---|---|---|")
    for gib in sorted({r["gib"] for r in rows if r["tier"] == "cold"}):
        reps = [r for r in rows if r["tier"] == "cold" and r["gib"] == gib]
        cold = next(r for r in reps if r["cache_dropped"])
        warm = statistics.median(r["end_to_end_s"] for r in reps if not r["cache_dropped"])
        det = cold["detail"]
        print(f"| {gib} | {cold['end_to_end_s']:.2f} | {warm:.2f} | {det['import_s']:.2f} / {det['cuda_ctx_s']:.2f} / "
              f"{det['h2d_s']:.2f} |")


if __name__ == "__main__":
    main()
