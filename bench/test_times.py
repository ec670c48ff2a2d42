"""Where a test run's time goes: the per-test times of one ``./run test`` (its JUnit report, which
``./run test`` keeps in ``$DYNSNAP_CACHE/test-reports/``), summed per test file, longest first, with
the run's total and its test count. Setup and teardown of module- and package-scoped fixtures count
to the test that ran them (pytest's own accounting).

  python bench/test_times.py [REPORT.xml]   # default: the newest report kept

Runs before 2026-12-07 also kept ``side-*.xml``, the report of test_agent_apiserver.py (since deleted),
which ran in a pytest of its own beside the suite (pass it to see it).

Prints one line per file: seconds, share of the run, tests, path.
"""

from __future__ import annotations

import argparse
import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def newest_report() -> Path:
    reports = Path(os.environ.get("DYNSNAP_CACHE", Path.home() / ".cache" / "dynsnap")) / "test-reports"
    found = sorted(reports.glob("pytest-*.xml"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no report in {reports}: run ./run test first")
    return found[-1]


def per_file(report: Path) -> tuple[dict[str, tuple[float, int]], float, int]:
    root = ET.parse(report).getroot()
    files: dict[str, list[float]] = defaultdict(list)
    for case in root.iter("testcase"):
        cls = case.get("classname", "")
        path = cls.rsplit(".", 1)[0] if cls.split(".")[-1][:1].isupper() else cls  # Test classes: their module
        files[path.replace(".", "/") + ".py"].append(float(case.get("time", "0")))
    out = {f: (sum(ts), len(ts)) for f, ts in files.items()}
    return out, sum(t for t, _ in out.values()), sum(n for _, n in out.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", nargs="?", type=Path)
    args = ap.parse_args()
    report = args.report or newest_report()
    files, total, count = per_file(report)
    print(f"{report}: {count} tests, {total:.0f} s")
    for path, (secs, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(f"{secs:8.1f} s {100 * secs / total if total else 0:5.1f} % {n:5d}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
