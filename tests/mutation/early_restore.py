"""pytest plugin of the mutation runner (runner.py): once the tests are collected, put the
original source of a mutated Python module back on disk. The module this pytest process has
imported keeps the mutant; the file is the original again for everyone else working in the tree.

Loaded with ``-p tests.mutation.early_restore`` and configured by the runner through
``$DYNSNAP_MUTATION_EARLY_RESTORE`` (JSON: the mutation, its files, the modules). Only for modules
that no subprocess of the tests imports (a subprocess would read the restored file). Prints one
``mutation-module:`` line per module; "ERROR" when the module came from another file than the
mutated one (the mutant would not be under test at all).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.mutation.runner import EARLY_RESTORE_ENV, ROOT, backup_path, meta_path, remove_backup, restore_file


def pytest_collection_finish(session: pytest.Session) -> None:
    spec = json.loads(os.environ.get(EARLY_RESTORE_ENV, "{}"))
    files = {(ROOT / f).resolve() for f in spec.get("files", [])}
    say = session.config.pluginmanager.get_plugin("terminalreporter")
    for name in spec.get("modules", []):
        mod = sys.modules.get(name)
        where = getattr(mod, "__file__", None)
        if where is None:
            line = f"mutation-module: {name} not imported at collection: left mutated until the run ends"
        elif (path := Path(where).resolve()) not in files:
            line = f"mutation-module: ERROR {name} was imported from {path}, not from the mutated file"
        else:
            meta = json.loads(meta_path(path).read_text())
            state = restore_file(path, backup_path(path).read_bytes(), meta["mutant_sha256"])
            if state in ("restored", "unchanged"):
                # The original is on disk again: no backup to recover from, nothing for the runner to
                # undo (it is told, so it leaves the file alone even if someone edits it next).
                with open(spec["report"], "a") as report:
                    report.write(f"{path}\n")
                remove_backup(path)
            line = f"mutation-module: {name} imported; {path.relative_to(ROOT)} {state} once collected"
        if say is not None:
            say.write_line(line)
        else:
            print(line, file=sys.stderr)
