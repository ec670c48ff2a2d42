"""Mutation check of the stand-in GPU engine (dynsnap/testenv/stub_engine.py, stub_gpu.py) and of the
stub driver's hold as the engine's tests see it (docs/TESTING.md, "The stand-in engine"): each row an
exact replacement, then tests/integration/node/test_stub_engine.py (on the real node; the engine's code
reaches its pods from this tree by a hostPath, the stub driver is built from it by the node's fixture)
must go red, or, for --no-routes, node/test_engine_tier.py's worker without routes. Not collected by
pytest (no test_ prefix). From the repository root, as root, with the environment of `./run env` (one
local cluster and real node per mutant):

    source <(./run env | sed 's/^/export /')
    $DYNSNAP_VENV/bin/python tests/mutate_stub_engine.py [--list] [--all-failures] [INDEX|ID ...]

The cluster gets its own bridge and /16 (dsnmut5, 10.236.0.0/16) unless DYNSNAP_TEST_BRIDGE /
DYNSNAP_TEST_CIDR say otherwise. The engine runs in the pods' processes, not in pytest's, so a
mutated file stays mutated for its whole run; the stub driver is compiled by the test's fixture
from the source in place (the build step only checks that a mutant compiles).
tests/mutation/runner.py says how a run goes and what each outcome means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.mutation.runner import Suite, main, mutation

ENGINE = "dynsnap/testenv/stub_engine.py"
GPU = "dynsnap/testenv/stub_gpu.py"
PROC = "tests/native/stub_libcuda/stub_process.c"
LIB = "tests/native/stub_libcuda/stub_libcuda.c"
TESTS = ["tests/integration/node/test_stub_engine.py"]
# The engine without routes: refused by the agent for its 404 (EngineRoutesMissing)
NO_ROUTES = ["tests/integration/node/test_engine_tier.py::"
             "test_a_worker_without_engine_routes_is_refused_and_auto_sleeps_it_with_suspend"]

MUTATIONS = (
    mutation(
        "sleep-keeps-the-instance-registered", "control/sleep does not unregister the endpoint instance", ENGINE,
        "                    await self.endpoint.unregister_endpoint_instance()\n"
        "                    self.registered, unregistered = False, True",
        "                    self.registered, unregistered = False, True",
        tests=TESTS),
    mutation(
        "wake-does-not-register", "control/wake_up does not register the instance again", ENGINE,
        "                if not self.registered:\n                    await self.endpoint.register_endpoint_instance()",
        "                if not self.registered:\n                    pass",
        tests=TESTS),
    mutation(
        "sleep-keeps-the-kv-pool", "the KV pool stays allocated while asleep", GPU,
        "            if self.kv:\n                self.driver.free(self.kv)\n                self.kv = 0",
        "            pass",
        tests=TESTS),
    mutation(
        "wake-loses-the-weights", "the wake copies back zeros instead of the weights", GPU,
        "            self._allocate(self.host)",
        "            self._allocate(bytes(len(self.host)))",
        tests=TESTS),
    mutation(
        "tokens-without-a-driver-call", "a token is made from a host copy, with no driver call", GPU,
        "            (word,) = struct.unpack(\"<Q\", self.driver.dtoh(self.weights + idx * 8, 8))\n"
        "            self.driver.synchronize()",
        "            (word,) = struct.unpack_from(\"<Q\", table(self.seed, self.vocab), idx * 8)",
        tests=TESTS),
    mutation(
        "sleep-not-idempotent", "a second control/sleep sleeps again instead of answering already sleeping", ENGINE,
        "            if self.asleep:\n                return ok(\"Engine already sleeping\")\n",
        "",
        tests=TESTS),
    mutation(
        "fail-fault-ignored", "an injected 'fail' fault is ignored", ENGINE,
        "        if \"fail\" in faults:",
        "        if False:",
        tests=TESTS),
    mutation(
        "no-routes-ignored", "--no-routes registers the routes anyway", ENGINE,
        "    if not args.no_routes:\n        runtime.register_engine_route(",
        "    if True:\n        runtime.register_engine_route(",
        tests=NO_ROUTES),
    mutation(
        "decode-ignores-its-prefill", "a decode engine ignores its prefill peer's result", ENGINE,
        "        params = ((request.get(\"prefill_result\") or {}).get(\"disaggregated_params\") or {})"
        ".get(\"stub_engine\")",
        "        params = None",
        tests=TESTS),
    mutation(
        "stub-no-hold", "the stub driver never holds a checkpointed process's calls (the stub before issue 20)", PROC,
        "\treturn st == CU_PROCESS_STATE_LOCKED || st == CU_PROCESS_STATE_CHECKPOINTED;",
        "\treturn (void)st, 0;",
        tests=TESTS),
    mutation(
        "stub-checkpoint-keeps-allocations", "a checkpoint leaves the engine's allocations on the device", LIB,
        "\tmoved |= stub_move_allocs(stub_state_key(pid), sign, remap, &d);",
        "\tmoved |= 0;",
        tests=TESTS),
)

SUITE = Suite(
    name="stub-engine",
    doc="docs/TESTING.md",
    mutations=MUTATIONS,
    build=("sh", "-c", "mkdir -p {build} && gcc -shared -fPIC -O1 -Wall -Werror -I\"$DYNSNAP_CUDA_INCLUDE\" "
           f"-o {{build}}/libcuda_stub.so {LIB} {PROC} && {sys.executable} -m py_compile {ENGINE} {GPU}"),
    default_env={"DYNSNAP_TEST_BRIDGE": "dsnmut5", "DYNSNAP_TEST_CIDR": "10.236.0.0/16",
                 "DYNSNAP_KEEP_LOGS": "{work}/test-logs"},  # a killed mutant's logs stay out of test-logs/
    timeout=900,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
