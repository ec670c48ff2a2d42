"""Mutation runner: break a load-bearing check on purpose, build, run the tests that guard it,
restore the source, and say whether the tests noticed.

The committed scripts that reproduce the docs' mutation tables are thin lists over this module:

    tests/native/mutate_entrypoint.py   docs/ENTRYPOINT.md   dynsnap-entrypoint (C)
    tests/native/mutate_cuda.py         docs/NATIVE.md       dynsnap-cuda (C)
    tests/mutate_harness.py             docs/TESTING.md      the test harness and the client (Python)

Run them from the repository root with the dev venv's python (the one that has pytest).

A mutation is one or more exact text replacements (each ``old`` must occur exactly once in its
file; otherwise the mutation is STALE: the source moved on and the script needs updating) and
the pytest tests that must go red. For each selected mutation the runner

1. keeps the original bytes next to each file it changes (``FILE.mutation-backup``, plus
   ``FILE.mutation-backup.json``: which run and which mutant), then writes the mutant;
2. builds, for the C suites into a private build directory (``DYNSNAP_NATIVE_BIN``), so that
   ``native/build`` never holds a mutant;
3. runs ``python -m pytest -x -q -p no:cacheprovider TESTS`` with a time bound;
4. restores the original bytes (in ``finally``: also on Ctrl-C and SIGTERM), removes the backup,
   and rebuilds ``native/build`` from the restored source.

Python mutants of modules that only the pytest process imports are restored as soon as pytest
has collected the tests (``tests/mutation/early_restore.py``): the imported module keeps the
mutant, the file on disk is the original again, so other people's runs in the same tree see a
mutated file for seconds instead of minutes.

Outcomes, one line each:

    KILLED          pytest exit 1: a test failed (or a fixture errored) with the mutant in place
    SURVIVED        pytest exit 0: the tests did not notice
    DID-NOT-BUILD   the mutant does not compile: it proves nothing
    STALE           an ``old`` text is not in its file exactly once
    ERROR           pytest exit 2-5 (interrupted, e.g. a collection/import error; internal
                    error; usage error; nothing collected), every test skipped, a time-out, or a
                    file changed by someone else while mutated

The exit status is 0 only when every selected mutant was KILLED (and the baseline, the same
tests on the unmutated source, passed); 1 otherwise.

A run that was killed hard (SIGKILL, power loss) leaves the backups: the next run restores a file
from its backup when the file still holds exactly the recorded mutant, and refuses to start when
the file has changed since (compare it with ``FILE.mutation-backup`` by hand).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import difflib
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BACKUP_SUFFIX = ".mutation-backup"
EARLY_RESTORE_ENV = "DYNSNAP_MUTATION_EARLY_RESTORE"
EARLY_RESTORE_PLUGIN = "tests.mutation.early_restore"

KILLED, SURVIVED, DID_NOT_BUILD, STALE, ERROR = "KILLED", "SURVIVED", "DID-NOT-BUILD", "STALE", "ERROR"
OUTCOMES = (KILLED, SURVIVED, DID_NOT_BUILD, STALE, ERROR)


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    id: str
    description: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest node ids or paths, relative to the repository root
    k: str | None = None  # a pytest -k expression, when the tests are a directory
    # Python modules the pytest process imports (and no subprocess of the tests does): the file
    # is restored once pytest has collected, while the imported module keeps the mutant.
    modules: tuple[str, ...] = ()


def mutation(id: str, description: str, path: str, old: str, new: str, *, tests: Sequence[str],
             k: str | None = None, more: Sequence[Edit] = (), modules: Sequence[str] = ()) -> Mutation:
    """One mutation: ``old`` → ``new`` in ``path`` (plus ``more`` edits), and the tests that must go red."""
    return Mutation(id, description, (Edit(path, old, new), *more), tuple(tests), k, tuple(modules))


@dataclass(frozen=True)
class Suite:
    name: str
    doc: str  # the table this reproduces
    mutations: tuple[Mutation, ...]
    # Run after a mutant is written, and once on the unmutated source for the baseline. "{build}"
    # is the run's private build directory, "{work}" its work directory, "{root}" the repository.
    build: tuple[str, ...] = ()
    # Run after the source is restored, into the real build directory.
    rebuild: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # for builds and pytest; same placeholders
    default_env: Mapping[str, str] = field(default_factory=dict)  # only where the caller's env lacks them
    pytest_args: tuple[str, ...] = ()
    timeout: float = 900  # one pytest run, seconds
    prepare: Callable[[], Mapping[str, str]] | None = None  # more env, computed when a run starts


@dataclass
class Result:
    index: int
    id: str
    description: str
    outcome: str
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0


# --- files: backups, exact restores -------------------------------------------------------------


def backup_path(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


def meta_path(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX + ".json")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _proc_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22: start time in clock ticks


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` in one rename (a reader sees the old or the new bytes, never
    half of them), keeping its mode. For a .py file the new mtime lands in another second than
    the old one: a .pyc is validated by (mtime in whole seconds, size), and a mutant and its
    original written within one second with the same size would otherwise share a stale .pyc."""
    st = path.stat()
    tmp = path.with_name(f".{path.name}.mutation-tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, st.st_mode & 0o7777)
    os.replace(tmp, path)
    if path.suffix == ".py":
        while int(path.stat().st_mtime) == int(st.st_mtime):
            time.sleep(1.0 - time.time() % 1.0 + 0.01)
            os.utime(path)


def restore_file(path: Path, original: bytes, mutant_sha: str, edits: Sequence[Edit] = (),
                 mutant: bytes | None = None) -> str:
    """Put ``original`` back if the file holds the mutant. Returns "restored", "unchanged" (it held
    the original already), "undone" (someone else edited the mutated file meanwhile: the mutation
    was taken out by a three-way merge, or else by reversing each of ``edits``, and their change
    kept) or "changed" (neither was possible: the file is left alone)."""
    current = path.read_bytes()
    if current == original:
        return "unchanged"
    if sha256(current) == mutant_sha:
        write_atomically(path, original)
        return "restored"
    merged = _undo_in(current, mutant, original) if mutant is not None else None
    if merged is None:
        text = current.decode(errors="surrogateescape")
        for e in reversed(edits):
            if not e.new or text.count(e.new) != 1:
                return "changed"
            text = text.replace(e.new, e.old)
        if not edits:
            return "changed"
        merged = text.encode(errors="surrogateescape")
    write_atomically(path, merged)
    return "undone"


def _undo_in(current: bytes, mutant: bytes, original: bytes) -> bytes | None:
    """Three-way merge (git merge-file): the mutant→original change applied to ``current``, which
    is the mutant plus someone's edit. None when the two overlap."""
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for name, data in (("current", current), ("mutant", mutant), ("original", original)):
            (Path(tmp) / name).write_bytes(data)
            names.append(str(Path(tmp) / name))
        r = subprocess.run(["git", "merge-file", "-p", "--quiet", *names], capture_output=True, check=False)
    return r.stdout if r.returncode == 0 else None


def remove_backup(path: Path) -> None:
    for p in (meta_path(path), backup_path(path)):
        p.unlink(missing_ok=True)


def recover_backups(paths: Sequence[Path]) -> list[str]:
    """Deal with backups a previous run left (it was killed before it could restore). Returns the
    problems that forbid starting; prints what was restored."""
    problems = []
    for path in paths:
        backup = backup_path(path)
        if not backup.exists():
            continue
        try:
            meta = json.loads(meta_path(path).read_text())
        except (OSError, ValueError):
            meta = {}
        pid = int(meta.get("pid", 0))
        if pid and pid != os.getpid() and _proc_start(pid) == meta.get("pid_start"):
            problems.append(f"{path.relative_to(ROOT)}: a mutation run (pid {pid}, {meta.get('mutation')}) "
                            "is using it now; wait for it to finish")
            continue
        original = backup.read_bytes()
        current = path.read_bytes()
        if current == original:
            remove_backup(path)
            print(f"note: {path.relative_to(ROOT)}: removed a backup left by an interrupted run (file intact)")
        elif meta.get("mutant_sha256") == sha256(current):
            write_atomically(path, original)
            remove_backup(path)
            print(f"note: {path.relative_to(ROOT)}: restored from the backup of an interrupted run "
                  f"(mutation {meta.get('mutation')})")
        else:
            problems.append(f"{path.relative_to(ROOT)} has a backup from an interrupted mutation run "
                            f"({backup.name}) but holds neither the original nor the recorded mutant: "
                            "compare the two by hand, then delete the backup and its .json")
    return problems


@contextlib.contextmanager
def mutated(m: Mutation, plans: Mapping[Path, tuple[bytes, bytes]], problems: list[str],
            early: Path | None = None) -> Iterator[None]:
    """Write the mutants (after their backups); restore every file on the way out, whatever happens.
    Files listed in ``early`` were restored by early_restore.py already and are left alone (someone
    may have edited them since)."""
    written: list[Path] = []
    try:
        for path, (original, mutant) in plans.items():
            backup_path(path).write_bytes(original)
            meta = {"pid": os.getpid(), "pid_start": _proc_start(os.getpid()), "mutation": m.id,
                    "mutant_sha256": sha256(mutant), "written": dt.datetime.now(dt.UTC).isoformat()}
            meta_path(path).write_text(json.dumps(meta) + "\n")
            written.append(path)
            write_atomically(path, mutant)
        yield
    finally:
        # A second Ctrl-C must not cut the restore short: it is delivered once the files are back.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            done = set(early.read_text().splitlines()) if early and early.exists() else set()
            for path in written:
                if str(path) in done:
                    remove_backup(path)
                    continue
                original, mutant = plans[path]
                state = restore_file(path, original, sha256(mutant), [e for e in m.edits if ROOT / e.path == path],
                                     mutant)
                if state == "changed":
                    problems.append(f"{path.relative_to(ROOT)} was changed by someone else while mutated and the "
                                    f"mutation cannot be undone in place: not restored; the original is in "
                                    f"{backup_path(path).name}")
                    continue
                if state == "undone":
                    print(f"  warning: {path.relative_to(ROOT)} was edited by someone else while mutated; the "
                          "mutation was undone in place, their change kept", flush=True)
                remove_backup(path)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def plan(m: Mutation) -> tuple[dict[Path, tuple[bytes, bytes]], str | None]:
    """(file -> (original, mutant)) with every edit applied in memory, or the reason it is stale."""
    texts: dict[Path, tuple[bytes, str]] = {}
    for e in m.edits:
        path = ROOT / e.path
        if path not in texts:
            if not path.is_file():
                return {}, f"{e.path} does not exist"
            raw = path.read_bytes()
            texts[path] = (raw, raw.decode())
        raw, text = texts[path]
        n = text.count(e.old)
        if n != 1:
            return {}, f"{e.path}: the text to replace occurs {n} times, not once: {e.old[:70]!r}"
        texts[path] = (raw, text.replace(e.old, e.new))
    return {p: (raw, text.encode()) for p, (raw, text) in texts.items()}, None


def unified_diff(plans: Mapping[Path, tuple[bytes, bytes]]) -> str:
    out: list[str] = []
    for path, (original, mutant) in plans.items():
        rel = str(path.relative_to(ROOT))
        out += difflib.unified_diff(original.decode().splitlines(keepends=True),
                                    mutant.decode().splitlines(keepends=True), rel, rel + " (mutant)", n=1)
    return "".join(out)


# --- processes ----------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Interrupt a child's process group (pytest tears down on SIGINT), then kill it."""
    for sig, grace in ((signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)


# Children still running when the run is interrupted: stopped only after the source is restored.
_children: list[subprocess.Popen[bytes]] = []


def run_logged(argv: Sequence[str], env: Mapping[str, str], log: Path, timeout: float) -> int | None:
    """Run argv in its own process group with output to ``log``; the exit status, None on time-out.
    When interrupted, the child is left to ``stop_children`` (after the restore, not before)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(list(argv), cwd=ROOT, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        _children.append(proc)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = None
        _children.remove(proc)
        return rc


def stop_children() -> None:
    while _children:
        _stop(_children.pop())


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_REPORT = re.compile(r"^(FAILED|ERROR) (.+?)(?: - .*)?$", re.M)
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def failures(output: str) -> list[str]:
    """Node ids from pytest's short summary (FAILED/ERROR lines), in order, once each."""
    seen: dict[str, None] = {}
    for kind, node in _REPORT.findall(output):
        seen[node if kind == "FAILED" else f"{node} (error)"] = None
    return list(seen)


def counts(output: str) -> dict[str, int]:
    """pytest's closing tally ("2 failed, 5 passed, 1 skipped in 3.20s")."""
    lines = [ln for ln in output.splitlines() if re.search(r"\bin [\d.]+s\b", ln) and _COUNT.search(ln)]
    found: dict[str, int] = {}
    for n, what in _COUNT.findall(lines[-1] if lines else ""):
        found["error" if what.startswith("error") else what] = int(n)
    return found


def _expected_missed(m: Mutation, failed: list[str]) -> list[str]:
    ids = [f.removesuffix(" (error)") for f in failed]
    def hit(t: str) -> bool:
        return any(i == t or i.startswith((t + "[", t + "::", t.rstrip("/") + "/")) for i in ids)
    return [t for t in m.tests if not hit(t)]


# --- the run -------------------------------------------------------------------------------------


class Runner:
    def __init__(self, suite: Suite, args: argparse.Namespace) -> None:
        self.suite = suite
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix=f"dynsnap-mutation-{suite.name}-"))
        (self.work / "build").mkdir()
        self.problems: list[str] = []
        base = dict(os.environ)
        for k, v in suite.default_env.items():
            base.setdefault(k, self._fill(v))
        base.update({k: self._fill(v) for k, v in suite.env.items()})
        if suite.prepare:
            base.update(suite.prepare())
        base["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant never lands in __pycache__
        self.env = base

    def _fill(self, s: str) -> str:
        return s.replace("{build}", str(self.work / "build")).replace("{work}", str(self.work)).replace(
            "{root}", str(ROOT))

    def build(self, tag: str) -> tuple[bool, str]:
        if not self.suite.build:
            return True, ""
        log = self.work / f"{tag}.build.log"
        rc = run_logged([self._fill(a) for a in self.suite.build], self.env, log, 600)
        return rc == 0, tail(log.read_text(errors="replace"))

    def rebuild(self) -> None:
        if not self.suite.rebuild:
            return
        log = self.work / "rebuild.log"
        rc = run_logged([self._fill(a) for a in self.suite.rebuild], self.env, log, 600)
        if rc != 0:
            print(f"  warning: rebuilding from the restored source failed ({shlex.join(self.suite.rebuild)}):\n"
                  + tail(log.read_text(errors="replace"), 10), flush=True)

    def pytest(self, tag: str, tests: Sequence[str], k: str | None, *, stop_first: bool,
               modules: Sequence[str] = (), mutant: Mutation | None = None) -> tuple[int | None, str]:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *self.suite.pytest_args]
        if stop_first:
            argv.insert(3, "-x")
        env = dict(self.env)
        if modules and mutant:
            argv += ["-p", EARLY_RESTORE_PLUGIN]
            env[EARLY_RESTORE_ENV] = json.dumps({"mutation": mutant.id, "modules": list(modules),
                                                 "files": sorted({e.path for e in mutant.edits}),
                                                 "report": str(self.early_report(mutant))})
        if k:
            argv += ["-k", k]
        argv += list(tests)
        log = self.work / f"{tag}.pytest.log"
        rc = run_logged(argv, env, log, self.suite.timeout)
        return rc, log.read_text(errors="replace")

    def early_report(self, m: Mutation) -> Path:
        """Where early_restore.py lists the files it restored (and whose backups it removed)."""
        return self.work / f"{m.id}.early-restored"

    def classify(self, rc: int | None, out: str) -> tuple[str, str]:
        c = counts(out)
        if rc is None:
            return ERROR, f"timed out after {self.suite.timeout:.0f} s\n{tail(out)}"
        if rc == 1:
            if not c and not failures(out):  # e.g. "No module named pytest": pytest never ran
                return ERROR, f"pytest exit 1 without a test report\n{tail(out)}"
            return KILLED, ""
        if rc == 0:
            if c.get("passed", 0) == 0:
                return ERROR, f"no test ran (all skipped?)\n{tail(out)}"
            return SURVIVED, ""
        meaning = {2: "interrupted (a collection or import error?)", 3: "pytest internal error",
                   4: "pytest usage error", 5: "no tests collected"}.get(rc, "killed by a signal")
        return ERROR, f"pytest exit {rc}: {meaning}\n{tail(out)}"

    def baseline(self, selected: Sequence[tuple[int, Mutation]]) -> bool:
        """The same tests on the unmutated source must pass, or a kill means nothing."""
        t0 = time.monotonic()
        ok, log = self.build("baseline")
        if not ok:
            print(f"BASELINE: the unmutated source does not build:\n{log}")
            return False
        groups: dict[str | None, dict[str, None]] = {}
        for _, m in selected:
            groups.setdefault(m.k, {}).update(dict.fromkeys(m.tests))
        good = True
        for k, tests in groups.items():
            rc, out = self.pytest("baseline", list(tests), k, stop_first=True)
            c = counts(out)
            if rc != 0 or c.get("passed", 0) == 0:
                print(f"BASELINE: the tests fail (or none ran) on the unmutated source (exit {rc}):\n{tail(out)}")
                good = False
            else:
                print(f"baseline: {c.get('passed', 0)} passed, {c.get('skipped', 0)} skipped"
                      + (f" (-k {k})" if k else ""), flush=True)
        print(f"baseline: {time.monotonic() - t0:.0f} s", flush=True)
        return good

    def one(self, index: int, m: Mutation) -> Result:
        t0 = time.monotonic()
        res = Result(index, m.id, m.description, ERROR)
        plans, stale = plan(m)
        if stale:
            res.outcome, res.detail = STALE, stale
            return res
        rc: int | None = None
        out = ""
        built = True
        with mutated(m, plans, self.problems, self.early_report(m)):
            built, log = self.build(m.id)
            if not built:
                res.outcome, res.detail = DID_NOT_BUILD, log
            else:
                rc, out = self.pytest(m.id, m.tests, m.k, stop_first=not self.args.all_failures,
                                      modules=m.modules, mutant=m)
        self.rebuild()
        res.seconds = time.monotonic() - t0
        if not built:
            return res
        res.outcome, res.detail = self.classify(rc, out)
        res.failed = failures(out)
        res.notes += [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("mutation-module:")]
        if any(ln.startswith("mutation-module:") and "ERROR" in ln for ln in out.splitlines()):
            res.outcome = ERROR
            res.detail = "the tests did not import the mutated module\n" + res.detail
        if res.outcome == KILLED and self.args.all_failures:
            missed = _expected_missed(m, res.failed)
            if missed:
                res.notes.append("listed but did not go red: " + ", ".join(short(t) for t in missed))
        return res


def short(node: str) -> str:
    return node.split("::", 1)[1] if "::" in node else node


def report(res: Result, total: int) -> None:
    print(f"{res.outcome:<13} [{res.index:>2}/{total}] {res.id}: {res.description} ({res.seconds:.0f} s)", flush=True)
    for f in res.failed:
        print(f"      red: {short(f)}")
    for n in res.notes:
        print(f"      note: {n}")
    if res.outcome not in (KILLED,) and res.detail:
        print("      " + res.detail.replace("\n", "\n      "))
    sys.stdout.flush()


def collapsed(failed: Sequence[str]) -> str:
    """Failed tests with their parametrized cases collapsed: "`test_a` x2, `test_b` (3 failed)"
    (with a multiplication sign, as the docs write it)."""
    names: dict[str, int] = {}
    for f in failed:
        name = re.sub(r"\[.*", "", short(f.removesuffix(" (error)")))
        names[name] = names.get(name, 0) + 1
    parts = [f"`{n}`" + (f" \N{MULTIPLICATION SIGN}{c}" if c > 1 else "") for n, c in names.items()]
    return ", ".join(parts) + f" ({len(failed)} failed)"


def markdown(results: Sequence[Result]) -> str:
    rows = ["| mutation | id | tests that went red |", "| --- | --- | --- |"]
    for r in results:
        what = collapsed(r.failed) if r.outcome == KILLED else f"**{r.outcome}**"
        rows.append(f"| {r.description} | `{r.id}` | {what} |")
    return "\n".join(rows) + "\n"


def select(suite: Suite, picks: Sequence[str]) -> list[tuple[int, Mutation]]:
    allm = list(enumerate(suite.mutations))
    if not picks:
        return allm
    by_id = {m.id: (i, m) for i, m in allm}
    out = []
    for p in picks:
        if p.isdigit() and int(p) < len(allm):
            out.append(allm[int(p)])
        elif p in by_id:
            out.append(by_id[p])
        else:
            raise SystemExit(f"no mutation {p!r} (see --list)")
    return out


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(suite: Suite, argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=f"Mutation check of {suite.name} (reproduces {suite.doc}).")
    ap.add_argument("select", nargs="*", help="mutation indices or ids (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--diff", action="store_true", help="print each selected mutation as a diff and exit")
    ap.add_argument("--check", action="store_true",
                    help="only check that every selected mutation still applies (exit 1 if one is stale)")
    ap.add_argument("--all-failures", action="store_true",
                    help="run each mutant's tests to the end (no -x) and list every test that went red")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the tests on the unmutated source")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="also write the results as a Markdown table (the docs' form)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (build and pytest logs)")
    args = ap.parse_args(argv)
    selected = select(suite, args.select)

    if args.list:
        for i, m in selected:
            files = ", ".join(sorted({e.path for e in m.edits}))
            print(f"{i:>2} {m.id}: {m.description}\n     in {files}; tests: "
                  + " ".join(short(t) for t in m.tests) + (f" -k {m.k}" if m.k else ""))
        return 0
    if args.diff or args.check:
        bad = 0
        for i, m in selected:
            plans, stale = plan(m)
            if stale:
                bad += 1
                print(f"{STALE:<13} {i:>2} {m.id}: {stale}")
            elif args.diff:
                print(f"## {i} {m.id}: {m.description}\n{unified_diff(plans)}")
            else:
                print(f"applies       {i:>2} {m.id}")
        return 1 if bad else 0

    if importlib.util.find_spec("pytest") is None:
        print(f"{sys.executable} has no pytest: run this with the dev venv's python")
        return 1
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    problems = recover_backups(sorted({ROOT / e.path for m in suite.mutations for e in m.edits}))
    if problems:
        print("refusing to start:\n  " + "\n  ".join(problems))
        return 1
    runner = Runner(suite, args)
    started = dt.datetime.now(dt.UTC)
    print(f"{suite.name}: {len(selected)} mutations, work directory {runner.work}", flush=True)
    results: list[Result] = []
    baseline_ok = True
    try:
        if not args.no_baseline:
            baseline_ok = runner.baseline(selected)
        if baseline_ok:
            for i, m in selected:
                res = runner.one(i, m)
                results.append(res)
                report(res, len(suite.mutations))
    except KeyboardInterrupt:
        print("interrupted: the source is restored; stopping the tests", flush=True)
        runner.problems.append("interrupted")
        stop_children()
        runner.rebuild()
    tally = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    print(f"\n{suite.name}: {len(results)} mutants: " + ", ".join(f"{n} {o.lower()}" for o, n in tally.items())
          + ("" if baseline_ok else " (baseline failed: nothing run)"))
    for p in runner.problems:
        print(f"problem: {p}")
    ok = baseline_ok and not runner.problems and len(results) == len(selected) and tally[KILLED] == len(results)
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "suite": suite.name, "doc": suite.doc, "command": shlex.join([sys.argv[0], *(argv or sys.argv[1:])]),
            "started": started.isoformat(timespec="seconds"), "ok": ok, "baseline_ok": baseline_ok,
            "counts": tally, "problems": runner.problems,
            "results": [r.__dict__ for r in results]}, indent=1) + "\n")
    if args.keep or not ok:
        print(f"logs: {runner.work}")
    else:
        shutil.rmtree(runner.work, ignore_errors=True)
    return 0 if ok else 1
