"""Mutation check of the stub driver's own semantics for a process's calls (stub_libcuda.c's header,
"The hold" and "Device memory"; docs/NATIVE.md, "The stub driver's hold"): the guarantees the
stand-in engine and the wake-on-request tests rest on. Break one on purpose, run
tests/native/test_stub_blocking.py (its fixture compiles the stub from the source in place),
expect red, restore. Not collected by pytest (no test_ prefix). From the repository root, with
the dev venv's python:

    V=$(ls -td ~/.cache/dynsnap/venv-dev-*/ | head -1)
    $V/bin/python tests/native/mutate_stub.py [--list] [--diff] [--all-failures] [INDEX|ID ...]

The build step only compiles the mutant into the run's private directory, so that a mutant that
does not compile is reported as such (DID-NOT-BUILD) instead of as a fixture error; the runner,
tests/mutation/runner.py, says how a run goes and that the source is restored even when interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mutation.runner import Suite, main, mutation

LIB = "tests/native/stub_libcuda/stub_libcuda.c"
PROC = "tests/native/stub_libcuda/stub_process.c"
TESTS = ["tests/native/test_stub_blocking.py"]

MUTATIONS = (
    mutation(
        "no-hold", "a call of a locked or checkpointed process is never held (the stub before issue 20)", PROC,
        "\treturn st == CU_PROCESS_STATE_LOCKED || st == CU_PROCESS_STATE_CHECKPOINTED;",
        "\treturn (void)st, 0;",
        tests=TESTS),
    mutation(
        "no-hold-when-checkpointed", "only a locked process is held, a checkpointed one answers", PROC,
        "\treturn st == CU_PROCESS_STATE_LOCKED || st == CU_PROCESS_STATE_CHECKPOINTED;",
        "\treturn st == CU_PROCESS_STATE_LOCKED;",
        tests=TESTS),
    mutation(
        "no-hold-when-locked", "only a checkpointed process is held, a locked one answers", PROC,
        "\treturn st == CU_PROCESS_STATE_LOCKED || st == CU_PROCESS_STATE_CHECKPOINTED;",
        "\treturn st == CU_PROCESS_STATE_CHECKPOINTED;",
        tests=TESTS),
    mutation(
        "hold-ends-after-one-poll", "the held call returns after one poll, still checkpointed", PROC,
        "\t\tusleep(HOLD_POLL_MS * 1000);\n\t\tst = stub_state_of(key);",
        "\t\tusleep(HOLD_POLL_MS * 1000);\n\t\tst = CU_PROCESS_STATE_RUNNING;",
        tests=TESTS),
    mutation(
        "hold-unbounded", "the hold has no bound (holdmax ignored)", PROC,
        "\t\tif (now_ms() - t0 >= max_ms || i > max_ms / HOLD_POLL_MS) {",
        "\t\tif (0) {",
        tests=TESTS),
    mutation(
        "released-call-fails", "a held call returns an error after the resume instead of its result", PROC,
        "\tlogline_to(\"holds\", \"release %s key=%lld state=%d ms=%lld rc=%d\", fn, key, st, now_ms() - t0, "
        "(int)rc);\n\treturn rc;",
        "\tlogline_to(\"holds\", \"release %s key=%lld state=%d ms=%lld rc=%d\", fn, key, st, now_ms() - t0, "
        "(int)rc);\n\treturn CUDA_ERROR_UNKNOWN;",
        tests=TESTS),
    mutation(
        "hold-keyed-by-another-process", "the hold reads another process's state (pid 42), not the caller's", PROC,
        "\tint st = stub_state_of(key);\n\tCUresult rc = CUDA_SUCCESS;\n\n\tif (!held(st))",
        "\tint st = stub_state_of(42);\n\tCUresult rc = CUDA_SUCCESS;\n\n\tif (!held(st))",
        tests=TESTS),
    mutation(
        "self-key-ignores-nskey", "a process keys itself by pid under nskey (the CLI keys it by namespace)", PROC,
        "\tif (!control_keyed(\"nskey\", 0, NULL, 0))\n\t\treturn host_pid_self();\n\tif (stat(",
        "\treturn host_pid_self();\n\tif (stat(",
        tests=TESTS),
    mutation(
        "cumemgetinfo-not-held", "cuMemGetInfo is not held", LIB,
        "\tHOLD(\"cuMemGetInfo_v2\");\n",
        "",
        tests=TESTS),
    mutation(
        "cuinit-not-held", "cuInit is not held", LIB,
        "\trc = stub_hold(\"cuInit\");",
        "\trc = CUDA_SUCCESS;",
        tests=TESTS),
    mutation(
        "stale-state-holds", "a new process starts held by the state a gone process left under its key", LIB,
        "\t\tstub_drop_stale_self();\n",
        "",
        tests=TESTS),
    mutation(
        "copies-not-held", "cuMemcpyHtoD/DtoH are not held", PROC,
        "\tuintptr_t d = (uintptr_t)dptr;\n\tCUresult rc = stub_hold(fn);",
        "\tuintptr_t d = (uintptr_t)dptr;\n\tCUresult rc = CUDA_SUCCESS;",
        tests=TESTS),
    mutation(
        "checkpoint-keeps-allocations", "a checkpoint leaves the process's allocations on the device", LIB,
        "\tmoved |= stub_move_allocs(stub_state_key(pid), sign, remap, &d);",
        "\tmoved |= 0;",
        tests=TESTS),
    mutation(
        "restore-ignores-map-for-allocations", "a remapped restore takes the allocations back on the old device",
        PROC,
        "\t\tif (remap && a->dev >= 0 && a->dev < d->n && remap[a->dev] >= 0)\n\t\t\ta->dev = remap[a->dev];\n",
        "",
        tests=TESTS),
    mutation(
        "exit-keeps-memory", "a process that exits keeps its device memory", PROC,
        "\tif (alloc_owner != getpid())\n\t\treturn;\n\tfd = lock_all();",
        "\treturn;\n\tfd = lock_all();",
        tests=TESTS),
    mutation(
        "allocation-past-free-accepted", "an allocation past the free memory is accepted", PROC,
        "\telse if (delta > 0 && d.free_b[dev] < delta)",
        "\telse if (0)",
        tests=TESTS),
    mutation(
        "copy-bounds-unchecked", "a copy past the end of its allocation is accepted", PROC,
        "n > allocs[i].len || d - allocs[i].ptr > allocs[i].len - n",
        "0",
        tests=TESTS),
)


def _cuda_env() -> dict[str, str]:
    """cuda.h of CUDA 13, found the way the tests find it (cuda_harness.cuda_include)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_harness import cuda_include  # type: ignore[import-not-found]

    return {"DYNSNAP_CUDA_INCLUDE": str(cuda_include())}


SUITE = Suite(
    name="stub-driver",
    doc="docs/NATIVE.md",
    mutations=MUTATIONS,
    # The flags the tests build it with (cuda_harness.build_stub), into the run's own directory.
    build=("sh", "-c", "mkdir -p {build} && gcc -shared -fPIC -O1 -Wall -Werror -I\"$DYNSNAP_CUDA_INCLUDE\" "
           f"-o {{build}}/libcuda_stub.so {LIB} {PROC}"),
    pytest_args=("--timeout", "120"),
    timeout=600,
    prepare=_cuda_env,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
