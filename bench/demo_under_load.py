"""How often ``dynsnap demo`` passes on a loaded machine: ``--runs`` demos one after the other, each
beside ``--busy`` processes that spin a CPU (a stand-in for the load of CI's two test lanes on this
2-core machine), with every run's output kept. Prints one line per run (exit status, seconds, the
failed checks) and the count passed.

  source <(./run env | sed 's/^/export /')
  $DYNSNAP_VENV/bin/python bench/demo_under_load.py [--runs 4] [--busy 3] [--out DIR]

Run it as root with the environment of ``./run env`` (the demo's images), nothing else on the
demo's bridge (dsndemo0, 10.214.0.0/16). Each demo is bounded (``--timeout``, 600 s); the busy
processes end with the script (and are bounded themselves by ``timeout``). Not a test: a reliability
figure for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--busy", type=int, default=3, help="CPU-spinning processes beside each demo")
    ap.add_argument("--timeout", type=int, default=600, help="seconds, per demo")
    ap.add_argument("--out", type=Path, default=None, help="where each run's output goes (default: a temp dir)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="dynsnap-demo-load-"))
    out.mkdir(parents=True, exist_ok=True)
    bound = args.runs * args.timeout + 60
    busy = [subprocess.Popen(["timeout", str(bound), sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    passed = 0
    try:
        for n in range(1, args.runs + 1):
            t0 = time.monotonic()
            log = out / f"demo{n}.out"
            with log.open("w") as f:
                try:
                    rc = subprocess.run([sys.executable, "-m", "dynsnap", "demo", "--timeline-out",
                                         str(out / f"demo{n}.png")], stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
            failed = [ln.strip() for ln in log.read_text().splitlines() if "] FAILED " in ln]
            passed += rc == 0
            print(f"run {n}: rc {rc}, {time.monotonic() - t0:.0f} s" + "".join(f"\n    {x[:240]}" for x in failed),
                  flush=True)
    finally:
        for p in busy:
            p.terminate()  # timeout(1) passes a TERM on to its child (a KILL would leave the child spinning)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    print(f"{passed}/{args.runs} demos passed beside {args.busy} busy processes; outputs in {out}")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
