"""Mutation check of dynsnap-cuda's load-bearing code (docs/NATIVE.md, "Mutation checks"): break
it on purpose, build it into a private build directory, run the stub tests (`tests/native -k
cuda`), expect red, restore. Not collected by pytest (no test_ prefix). From the repository root,
with the dev venv's python:

    V=$(ls -td ~/.cache/dynsnap/venv-dev-*/ | head -1)
    $V/bin/python tests/native/mutate_cuda.py [--list] [--diff] [--all-failures] [INDEX|ID ...]

Each mutation is one textual replacement in native/cuda/*.c; tests/mutation/runner.py says how a
run goes, what each outcome means, and that the source is restored even when interrupted. The
exit status is non-zero when a mutant survives, does not build, or no longer applies.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mutation.runner import Edit, Suite, main, mutation

ACT = "native/cuda/actions.c"
ARGS = "native/cuda/args.c"
DRV = "native/cuda/driver.c"
MEM = "native/cuda/memory.c"
OUT = "native/cuda/output.c"
PH = "native/cuda/phases.c"
G = "native/cuda/gpumap.c"
TESTS = ["tests/native"]
K = "cuda"

MUTATIONS = (
    mutation(
        "save-interleaves-lock-checkpoint", "`save` interleaves lock+checkpoint per pid", ACT,
        "\tint fails = run_phase(OP_LOCK, NULL, 0);\n\n\tmark(\"lock\");\n\tif (fails) {",
        "\tint fails = 0;\n\tfor (int k = 0; k < njobs; k++) { if (do_op(&jobs[k], OP_LOCK) == CUDA_SUCCESS) "
        "do_op(&jobs[k], OP_CHECKPOINT); }\n\tif (fails) {",
        tests=TESTS, k=K),
    mutation(
        "no-map-count-check", "map count check dropped", G,
        "\tif (n != nvisible) {",
        "\tif (0) {",
        tests=TESTS, k=K),
    mutation(
        "pair-transposed", "old and new transposed in a pair", G,
        "resolve_side(old_s, visible, nvisible, &out[n].old_uuid, err, errlen) ||\n"
        "\t\t    resolve_side(new_s, visible, nvisible, &out[n].new_uuid, err, errlen)",
        "resolve_side(old_s, visible, nvisible, &out[n].new_uuid, err, errlen) ||\n"
        "\t\t    resolve_side(new_s, visible, nvisible, &out[n].old_uuid, err, errlen)",
        tests=TESTS, k=K),
    mutation(
        "no-rollback-after-failed-lock", "no rollback after a failed lock", ACT,
        "\t\trun_phase(OP_UNLOCK, locked, 0);\n",
        "\t\t(void)locked;\n",
        tests=TESTS, k=K),
    mutation(
        "uuid-dashes-not-skipped", "dashes not skipped in UUIDs", G,
        "\t\tif (*s == '-')\n\t\t\tcontinue;\n\t\tv = hexval(",
        "\t\tv = hexval(",
        tests=TESTS, k=K),
    mutation(
        "no-free-memory-refusal", "free-memory refusal dropped", ACT,
        "if (need <= 0 || free_b < 0 || free_b >= need)",
        "if (1)",
        tests=TESTS, k=K),
    mutation(
        "resume-unlocks-per-pid", "`resume` unlocks each pid right after its restore", ACT,
        "\tfails = run_phase(c->first, NULL, 0);\n\tmark(op_name[c->first]);\n"
        "\tif (!fails && c->second != OP_NONE) {\n\t\tfails = run_phase(c->second, NULL, 0);",
        "\tfails = 0;\n\tfor (int k = 0; k < njobs; k++) { if (do_op(&jobs[k], c->first) != CUDA_SUCCESS) "
        "{ fails++; continue; } if (c->second != OP_NONE && do_op(&jobs[k], c->second) != CUDA_SUCCESS) fails++; }\n"
        "\tif (0) {",
        tests=TESTS, k=K),
    mutation(
        "save-continues-after-failed-checkpoint", "`save` keeps checkpointing after a failed checkpoint", ACT,
        "fails = run_phase(OP_CHECKPOINT, NULL, 1);",
        "fails = run_phase(OP_CHECKPOINT, NULL, 0);",
        tests=TESTS, k=K),
    mutation(
        "map-validated-after-restore", "map validated after the restore instead of before", ACT,
        "\tchar err[512];\n\n\tif (enumerate_devices()) {",
        "\tchar err[512];\n\n\trun_phase(OP_RESTORE, NULL, 0);\n\tif (enumerate_devices()) {",
        tests=TESTS, k=K),
    mutation(
        "no-lock-timeout", "lock timeout not passed to the driver", PH,
        "a.timeoutMs = opt.timeout_ms;",
        "a.timeoutMs = 0;",
        tests=TESTS, k=K),
    mutation(
        "invisible-target-accepted", "a target GPU that is not visible accepted", G,
        "\t\tif (!is_visible(&out[n].new_uuid, visible, nvisible)) {",
        "\t\tif (0 && !is_visible(&out[n].new_uuid, visible, nvisible)) {",
        tests=TESTS, k=K),
    mutation(
        "duplicate-targets-accepted", "duplicate targets accepted", G,
        "\t\t\tif (!memcmp(out[i].new_uuid.b, out[n].new_uuid.b, GPU_UUID_LEN)) {",
        "\t\t\tif (0) {",
        tests=TESTS, k=K),
    mutation(
        "nvml-total-as-free", "NVML's total taken as the free bytes", MEM,
        "*free_b = (long long)m.free;",
        "*free_b = (long long)m.total;",
        tests=TESTS, k=K),
    mutation(
        "no-primary-context-fallback", "never fall back to the primary context", MEM,
        "\t\telse if (cuda_free(d, &free_b[d]) == 0)\n",
        "\t\telse if (0 && cuda_free(d, &free_b[d]) == 0)\n",
        tests=TESTS, k=K),
    mutation(
        "empty-map-item-skipped", "an empty item of the GPU map skipped (as strtok did) instead of refused", G,
        "\t\t\tsnprintf(err, errlen, \"item %d of the map is empty (a stray comma?)\", pos);\n\t\t\tgoto fail;",
        "\t\t\tcontinue;",
        tests=TESTS, k=K),
    mutation(
        "refused-restore-reported-ok",
        "a refused restore reported `\"ok\": true, \"error\": null` in `--json` (the code before the fix)", OUT,
        "!j->skipped && !refusal[0] ? \"true\"",
        "!j->skipped ? \"true\"",
        more=[Edit(OUT, "\t\telse if (refusal[0])\n\t\t\tprintf(\"\\\"%s\\\"\", refusal);\n", "")],
        tests=TESTS, k=K),
    mutation(
        "gpus-line-after-is-before", "the `gpus` line of a resume reports the reading before as the one after", ACT,
        "\t\tsample_free(free_after, src_after);\n\t\tgpus_line(a.free_before, a.src_before, free_after, src_after);",
        "\t\tsample_free(free_after, src_after);\n"
        "\t\tgpus_line(a.free_before, a.src_before, a.free_before, a.src_before);",
        tests=TESTS, k=K),
    mutation(
        "gpus-line-on-refusal", "a refused resume prints a `gpus` line though nothing was done", ACT,
        "\t\t\tjobs[i].state_after = jobs[i].state_before;\n\t\tif (c->json)",
        "\t\t\tjobs[i].state_after = jobs[i].state_before;\n"
        "\t\tgpus_line(a->free_before, a->src_before, a->free_before, a->src_before);\n\t\tif (c->json)",
        tests=TESTS, k=K),
    mutation(
        "cuinit-at-load", "cuInit made when the driver is loaded, as before (100-185 ms a call on the H200)", DRV,
        "\tdrv.init_ok = -1; /* cuInit on first need: driver_init */",
        "\tdrv.init_ok = drv.Init(0) == CUDA_SUCCESS;",
        tests=TESTS, k=K),
    mutation(
        "no-retry-after-init", "a call refused for want of cuInit is not made again", DRV,
        "\treturn r == CUDA_ERROR_NOT_INITIALIZED && driver_init();",
        "\treturn 0 && r == CUDA_ERROR_NOT_INITIALIZED && driver_init();",
        tests=TESTS, k=K),
    mutation(
        "stray-argument-accepted", "a word that is no option ignored (getopt_long moves it after the options)", ARGS,
        "\tif (optind < argc) {",
        "\tif (0) {",
        tests=TESTS, k=K),
    mutation(
        "pin-unchecked", "a PID@START whose pid is another process now is handed to the driver", PH,
        "\tif (j->start >= 0) {\n",
        "\tif (0 && j->start >= 0) {\n",
        tests=["tests/native/test_cuda_cli.py::test_a_pinned_pid_that_is_another_process_now_is_never_handed_to_the_driver"]),
)


def _cuda_env() -> dict[str, str]:
    """cuda.h of CUDA 13, found the way the tests find it (cuda_harness.cuda_include)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_harness import cuda_include  # type: ignore[import-not-found]

    return {"DYNSNAP_CUDA_INCLUDE": str(cuda_include())}


SUITE = Suite(
    name="dynsnap-cuda",
    doc="docs/NATIVE.md",
    mutations=MUTATIONS,
    build=("make", "-s", "-C", "native/cuda", "BUILD={build}"),
    rebuild=("make", "-s", "-C", "native/cuda", "BUILD={root}/native/build"),  # from the restored source
    env={"DYNSNAP_NATIVE_BIN": "{build}"},  # cuda_harness builds and runs the CLI there
    pytest_args=("--timeout", "60"),
    timeout=1200,
    prepare=_cuda_env,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
