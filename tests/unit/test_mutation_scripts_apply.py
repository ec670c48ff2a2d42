"""Every committed mutation script still applies to the source: each row's every replaced text occurs in
its file exactly once (what the runner's ``--check`` asks, run here for all of them on every test run), so a
script does not rot unseen between its runs. Two rows of tests/native/mutate_entrypoint.py had (a comment
moved into the text they replace) until this test found them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted({*ROOT.glob("tests/mutate_*.py"), *ROOT.glob("tests/native/mutate_*.py"),
                  *ROOT.glob("tests/mutation/mutate_*.py")})


def test_the_scripts_are_found() -> None:
    assert len(SCRIPTS) >= 9, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_row_applies_to_the_source(script: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"mutation_script_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stale = []
    for i, m in enumerate(module.MUTATIONS):
        for e in m.edits:
            n = (ROOT / e.path).read_text().count(e.old)
            if n != 1:
                stale.append(f"row {i} {m.id}: {e.path} holds its text {n} times")
    assert stale == [], stale
