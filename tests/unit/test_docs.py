"""The generated docs: docs/operations.md explains every Reason the code declares (what happened,
what to do), docs/configuration.md lists every setting, and both are exactly what the generators in
dynsnap/docs.py write, so a new reason or setting without its explanation, or a page edited by hand,
fails here. A reason marked reserved is one the code never reports, and only such a one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dynsnap import docs
from dynsnap.agent.settings import reference_table as agent_table
from dynsnap.cli import main
from dynsnap.controller.settings import reference_table as controller_table
from dynsnap.models.protocol import Reason
from dynsnap.models.reasons import REASON_DOCS, SECTIONS

ROOT = Path(__file__).resolve().parents[2]
# The product code that reports reasons (the declarations and their docs are not reports).
NOT_REPORTERS = {"models/protocol.py", "models/reasons.py", "models/reasons_agent.py", "models/reasons_controller.py",
                 "models/reasondoc.py", "docs.py"}


def _reported() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "dynsnap").rglob("*.py"):
        rel = path.relative_to(ROOT / "dynsnap").as_posix()
        if rel in NOT_REPORTERS or rel.startswith("testenv/"):
            continue
        names |= set(re.findall(r"\bReason\.([A-Z_]+)\b", path.read_text()))
    return names


def test_every_reason_has_an_explanation_and_what_to_do() -> None:
    assert set(REASON_DOCS) == set(Reason)
    for reason, doc in REASON_DOCS.items():
        assert doc.section in SECTIONS, reason
        assert len(doc.where) > 5 and len(doc.meaning) > 30 and len(doc.action) > 5, reason


def test_reserved_means_the_code_does_not_report_it() -> None:
    reported = _reported()
    assert reported <= {r.name for r in Reason}, reported - {r.name for r in Reason}
    wrong = {r.value: ("reported" if r.name in reported else "never reported")
             for r, doc in REASON_DOCS.items() if doc.reserved == (r.name in reported)}
    assert not wrong, f"reasons whose 'reserved' mark is wrong in dynsnap/models/reasons.py: {wrong}"


@pytest.mark.parametrize("name", sorted(docs.GENERATORS))
def test_committed_page_is_the_generated_one(name: str) -> None:
    committed = docs.path_of(name)
    assert committed.read_text() == docs.GENERATORS[name](), (
        f"{committed.relative_to(ROOT)} differs from the code: run `python -m dynsnap docs {name} --write`")


def test_operations_page_has_a_section_per_reason_in_the_enums_order() -> None:
    text = docs.operations()
    headings = re.findall(r"^#### `([A-Za-z]+)` \(", text, re.M)
    assert sorted(headings) == sorted(r.value for r in Reason) and len(headings) == len(Reason)
    by_section = [r.value for s in SECTIONS for r in Reason if REASON_DOCS[r].section == s]
    assert headings == by_section
    for reason, doc in REASON_DOCS.items():
        entry = text.split(f"#### `{reason.value}` (", 1)[1].split("####", 1)[0]
        assert doc.action in entry and doc.meaning in entry, reason


def test_configuration_page_holds_the_same_tables_as_the_readme() -> None:
    page, readme = docs.configuration(), (ROOT / "README.md").read_text()
    for table in (controller_table(), agent_table()):
        assert table in page and table in readme


def test_cli_checks_and_prints_the_pages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs", "operations", "--check"]) == 0
    assert "up to date" in capsys.readouterr().err
    assert main(["docs", "configuration"]) == 0
    assert capsys.readouterr().out == docs.configuration()


def test_cli_check_fails_on_a_stale_page(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "operations.md"
    stale.write_text(docs.operations().replace("#### `PodGone`", "#### `PodWent`"))
    monkeypatch.setattr(docs, "DOCS_DIR", tmp_path)
    assert main(["docs", "operations", "--check"]) == 1
    assert "differs from the code" in capsys.readouterr().err
