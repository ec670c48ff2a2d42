"""./run test's second lane (tests/lane2.txt): every line a test file of the suite, none twice, and the
first lane still holding the rest of the real-node package (its long sleep runs beside it)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lane2() -> list[str]:
    lines = (ROOT / "tests" / "lane2.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def test_every_line_of_the_second_lane_is_a_test_file_named_once() -> None:
    files = lane2()
    assert files, "tests/lane2.txt names no file: the second lane would collect nothing"
    assert len(set(files)) == len(files), f"named twice: {sorted(f for f in files if files.count(f) > 1)}"
    for f in files:
        path = ROOT / f
        assert path.is_file(), f"tests/lane2.txt names {f}, which is not a file of the checkout"
        assert path.name.startswith("test_") and path.suffix == ".py", f"{f} is not a test file pytest collects"
        assert path.is_relative_to(ROOT / "tests"), f"{f} is outside tests/"


def test_the_long_sleep_stays_in_the_first_lane_with_package_tests_beside_it() -> None:
    """node/test_long_sleep.py needs the package's other tests around it (six minutes at the least)."""
    node = ROOT / "tests" / "integration" / "node"
    mine = {str(p.relative_to(ROOT)) for p in node.glob("test_*.py")}
    first = mine - set(lane2())
    assert "tests/integration/node/test_long_sleep.py" in first
    assert len(first) > 5, f"the first lane keeps only {sorted(first)} of the node package"


def test_run_test_reads_the_list() -> None:
    assert "tests/lane2.txt" in (ROOT / "run").read_text()
