"""`make -C native install` puts both programs on a bin path, with the cuda-checkpoint link
CRIU's CUDA plugin looks for (it greps `-h` for `--action`), and the huge-page library next to the
entrypoint, where the entrypoint looks for it by default."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

NATIVE = Path(__file__).parents[2] / "native"


def test_make_install_places_both_programs_and_the_link(tmp_path: Path) -> None:
    subprocess.run(["make", "-s", "-C", str(NATIVE), "install", f"DESTDIR={tmp_path}", "PREFIX=/opt/dynsnap"],
                   check=True, capture_output=True, timeout=120)
    bindir = tmp_path / "opt" / "dynsnap" / "bin"
    for name in ("dynsnap-cuda", "dynsnap-entrypoint"):
        assert os.access(bindir / name, os.X_OK), name
    assert os.readlink(bindir / "cuda-checkpoint") == "dynsnap-cuda"
    assert (bindir / "libdynsnap-thp.so").is_file()
    out = subprocess.run([str(bindir / "cuda-checkpoint"), "-h"], capture_output=True, text=True, timeout=10)
    assert "--action" in out.stdout + out.stderr
    usage = subprocess.run([str(bindir / "dynsnap-entrypoint"), "--help"], capture_output=True, text=True, timeout=10)
    assert usage.returncode == 0 and "usage: dynsnap-entrypoint" in usage.stdout + usage.stderr
