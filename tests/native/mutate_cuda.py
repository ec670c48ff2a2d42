"""Mutation check of dynsnap-cuda's load-bearing code: break it on purpose, run the stub tests,
expect red, restore. Not collected by pytest (no test_ prefix); run by hand:

    python tests/native/mutate_cuda.py [INDEX ...]

Each mutation is one textual replacement in native/cuda/*.c; the source is restored afterwards
even when interrupted. Results: one line per mutation, and the failing tests; docs/NATIVE.md
records the last run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
C = ROOT / "native" / "cuda" / "dynsnap-cuda.c"
G = ROOT / "native" / "cuda" / "gpumap.c"

M = [
    (
        "interleave lock+checkpoint in save",
        C,
        "\t\tfails = run_phase(OP_LOCK, NULL, 0);\n\t\tif (fails) {",
        "\t\tfor (int k = 0; k < njobs; k++) { if (do_op(&jobs[k], OP_LOCK) == CUDA_SUCCESS) do_op(&jobs[k], OP_CHECKPOINT); }\n\t\tfails = 0;\n\t\tif (fails) {",  # noqa: E501
    ),
    ("drop the map count check", G, "\tif (n != nvisible) {", "\tif (0) {"),
    (
        "transpose old and new in a pair",
        G,
        "resolve_side(old_s, visible, nvisible, &out[n].old_uuid, err, errlen) ||\n\t\t    resolve_side(new_s, visible, nvisible, &out[n].new_uuid, err, errlen)",  # noqa: E501
        "resolve_side(old_s, visible, nvisible, &out[n].new_uuid, err, errlen) ||\n\t\t    resolve_side(new_s, visible, nvisible, &out[n].old_uuid, err, errlen)",  # noqa: E501
    ),
    ("skip the rollback after a failed lock", C, "\t\t\trun_phase(OP_UNLOCK, locked, 0);\n", "\t\t\t(void)locked;\n"),
    ("do not skip dashes in a UUID", G, "\t\tif (*s == '-')\n\t\t\tcontinue;\n", ""),
    ("drop the free-memory refusal", C, "free_before[d] >= need[d])", "1)"),
    (
        "unlock each pid right after its restore in resume",
        C,
        "\t\tfails = run_phase(first, NULL, 0);\n\t\tif (!fails && second != OP_NONE)\n\t\t\tfails = run_phase(second, NULL, 0);",  # noqa: E501
        "\t\tfails = 0;\n\t\tfor (int k = 0; k < njobs; k++) { if (do_op(&jobs[k], first) != CUDA_SUCCESS) { fails++; continue; } if (second != OP_NONE && do_op(&jobs[k], second) != CUDA_SUCCESS) fails++; }",  # noqa: E501
    ),
    (
        "keep checkpointing after a failed checkpoint (serial)",
        C,
        "fails = run_phase(OP_CHECKPOINT, NULL, 1);",
        "fails = run_phase(OP_CHECKPOINT, NULL, 0);",
    ),
    (
        "validate the map after the state change",
        C,
        "\tif (map) {\n\t\tif (enumerate_devices()) {",
        "\tif (map) {\n\t\trun_phase(OP_RESTORE, NULL, 0);\n\t\tif (enumerate_devices()) {",
    ),
    ("drop the lock timeout", C, "a.timeoutMs = opt.timeout_ms;", "a.timeoutMs = 0;"),
    (
        "accept a target GPU that is not visible",
        G,
        "\t\tif (!is_visible(&out[n].new_uuid, visible, nvisible)) {",
        "\t\tif (0) {",
    ),
    (
        "accept duplicate targets",
        G,
        "\t\t\tif (!memcmp(out[i].new_uuid.b, out[n].new_uuid.b, GPU_UUID_LEN)) {",
        "\t\t\tif (0) {",
    ),
    ("take NVML's total as the free bytes", C, "*free_b = (long long)m.free;", "*free_b = (long long)m.total;"),
    (
        "never fall back to the primary context",
        C,
        "\t\telse if (cuda_free(d, &free_b[d]) == 0)\n",
        "\t\telse if (0 && cuda_free(d, &free_b[d]) == 0)\n",
    ),
]


def main() -> None:
    only = sys.argv[1:]
    res = {}
    for i, (name, path, old, new) in enumerate(M):
        if only and str(i) not in only:
            continue
        src = path.read_text()
        assert src.count(old) == 1, name
        with tempfile.TemporaryDirectory() as tmp:
            backup = Path(tmp) / path.name
            shutil.copy(path, backup)
            try:
                path.write_text(src.replace(old, new))
                p = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pytest",
                        "tests/native",
                        "-q",
                        "-k",
                        "cuda",
                        "-p",
                        "no:cacheprovider",
                        "--timeout",
                        "60",
                    ],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                )
            finally:
                shutil.copy(backup, path)
        failed = sorted(
            {
                re.sub(r"\[.*", "", line.split("::", 1)[1].split(" ")[0])
                for line in p.stdout.splitlines()
                if line.startswith("FAILED")
            }
        )
        summary = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-300:]
        res[name] = {"summary": summary, "failed": failed}
        print(f"== {i} {name}: {summary}\n   " + "\n   ".join(failed), flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
