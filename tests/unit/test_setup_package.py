"""The controller/agent side of the package runs without the local test environment:
with ``cryptography`` and ``dynsnap.testenv`` made unimportable, every module of the cli,
models, telemetry, k8s, runtime, agent and controller packages imports, ``python -m dynsnap
--help`` answers, and pyproject lists cryptography only in the ``testenv`` extra."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Product side: every module under these is found by walking the package, so modules
# added later are covered without editing this list.
PRODUCT = ["dynsnap.cli", "dynsnap.models", "dynsnap.telemetry", "dynsnap.k8s", "dynsnap.runtime",
           "dynsnap.agent", "dynsnap.controller"]
HARNESS_ONLY = ["cryptography", "dynsnap.testenv"]

# Installed first in the child: a finder that refuses the harness-only modules as if
# they were not installed.
_BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = @BLOCKED@

    class _Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    for _m in [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]:
        del sys.modules[_m]
    sys.meta_path.insert(0, _Absent())
""").replace("@BLOCKED@", repr(HARNESS_ONLY))

_IMPORT_ALL = _BLOCKER + textwrap.dedent("""
    import importlib, json, pkgutil, traceback
    imported, failed = [], {}

    def _try(name):
        try:
            mod = importlib.import_module(name)
        except BaseException:
            failed[name] = traceback.format_exc(limit=-3)
            return None
        imported.append(name)
        return mod

    def _walk_error(name):
        failed.setdefault(name, traceback.format_exc(limit=-3))

    for top in @PRODUCT@:
        mod = _try(top)
        if mod is not None and hasattr(mod, "__path__"):
            for info in pkgutil.walk_packages(mod.__path__, top + ".", onerror=_walk_error):
                _try(info.name)
    try:
        importlib.import_module("dynsnap.testenv")
        blocker_works = False
    except ImportError:
        blocker_works = True
    print(json.dumps({"imported": imported, "failed": failed, "blocker_works": blocker_works,
                      "leaked": sorted(m for m in sys.modules if m.split(".")[0] == "cryptography"
                                       or m.startswith("dynsnap.testenv"))}))
""").replace("@PRODUCT@", repr(PRODUCT))

_HELP = _BLOCKER + textwrap.dedent("""
    import runpy
    sys.argv = ["dynsnap", "--help"]
    runpy.run_module("dynsnap", run_name="__main__", alter_sys=True)  # what `python -m dynsnap` runs
""")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)


def test_product_modules_import_without_the_harness() -> None:
    proc = _python(_IMPORT_ALL)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["blocker_works"], "the child could still import dynsnap.testenv: the check would prove nothing"
    assert result["failed"] == {}, "\n".join(f"{name}:\n{tb}" for name, tb in result["failed"].items())
    assert result["leaked"] == []
    imported = set(result["imported"])
    assert set(PRODUCT) <= imported
    # The walk really descends: every .py file under the product packages was imported.
    on_disk = set()
    for top in PRODUCT:
        base = ROOT / Path(*top.split("."))
        if base.is_dir():
            for f in base.rglob("*.py"):
                parts = f.relative_to(ROOT).with_suffix("").parts
                on_disk.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    assert on_disk <= imported, f"not imported: {sorted(on_disk - imported)}"


def test_python_m_dynsnap_help_without_the_harness() -> None:
    proc = _python(_HELP)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: dynsnap"), proc.stdout


@pytest.fixture(scope="module")
def project() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        data: dict[str, object] = tomllib.load(f)["project"]
    return data


def _names(requirements: object) -> set[str]:
    assert isinstance(requirements, list)
    names = set()
    for req in requirements:
        assert isinstance(req, str)
        name = req.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower().replace("_", "-"))
    return names


def test_cryptography_is_only_in_the_testenv_extra(project: dict[str, object]) -> None:
    assert "cryptography" not in _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    assert "cryptography" in _names(extras["testenv"])
    assert "dev" in extras
