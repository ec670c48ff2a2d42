"""Where a test run's time goes: the per-test times of one ``./run test`` (its JUnit reports, which
``./run test`` keeps in ``$DYNSNAP_CACHE/test-reports/``), summed per test file, longest first, with
each report's wall time and test count. Setup and teardown of module- and package-scoped fixtures count
to the test that ran them (pytest's own accounting).

  python bench/test_times.py [REPORT.xml ...]   # default: the newest run's reports

A run of the whole suite since 2026-12-07 keeps two reports of one stamp: ``pytest-<stamp>.xml`` (the
first lane) and ``lane2-<stamp>.xml`` (tests/lane2.txt, run beside it); the run took about the longer
of the two lanes' wall times. Runs before that day kept ``pytest-*.xml`` alone (and for a while
``side-*.xml``, test_agent_apiserver.py run beside the suite; pass it to see it).

Prints one line per file: seconds, share of the summed test time, tests, path.
"""

from __future__ import annotations

import argparse
import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def newest_reports() -> list[Path]:
    reports = Path(os.environ.get("DYNSNAP_CACHE", Path.home() / ".cache" / "dynsnap")) / "test-reports"
    found = sorted(reports.glob("pytest-*.xml"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no report in {reports}: run ./run test first")
    newest = found[-1]
    lane2 = reports / newest.name.replace("pytest-", "lane2-", 1)
    return [newest, lane2] if lane2.is_file() else [newest]


def wall(report: Path) -> float:
    """The session's own duration (the ``time`` of its test suite)."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return sum(float(s.get("time", "0")) for s in suites)


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
    ap.add_argument("report", nargs="*", type=Path)
    args = ap.parse_args()
    files: dict[str, tuple[float, int]] = {}
    for report in args.report or newest_reports():
        mine, total, count = per_file(report)
        print(f"{report}: {count} tests, {total:.0f} s of tests, {wall(report):.0f} s wall")
        files |= mine
    total = sum(t for t, _ in files.values())
    for path, (secs, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(f"{secs:8.1f} s {100 * secs / total if total else 0:5.1f} % {n:5d}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
