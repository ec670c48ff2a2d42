"""Starts K bench/gpu/worker.py processes in file-protocol mode and waits.

The root of the process tree bench/gpu/criu_h200.sh dumps: CRIU dumps a tree,
so several GPU processes (two ranks) are captured by one ``criu dump -t``.
This process itself makes no CUDA call.

    python3 bench/gpu/launcher.py --workers K --gib N --ctl DIR   (DIR/0, DIR/1, ...)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--gib", type=int, required=True)
    ap.add_argument("--ctl", required=True)
    a = ap.parse_args()
    here = Path(__file__).resolve().parent
    procs = []
    for i in range(a.workers):
        d = os.path.join(a.ctl, str(i))
        os.makedirs(d, exist_ok=True)
        procs.append(subprocess.Popen([sys.executable, str(here / "worker.py"), "--gib", str(a.gib),
                                       "--seed", str(77 + i), "--ctl", d]))
    for p in procs:
        p.wait()


if __name__ == "__main__":
    main()
