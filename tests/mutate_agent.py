"""Mutation check of the node agent's guards (issue 8; docs/TESTING.md, "Mutation checks"): each
guard broken on purpose as an exact replacement in dynsnap/agent/, then the tests that must go red.
Not collected by pytest (no test_ prefix). From the repository root, as root, with the environment
of `./run env`:

    source <(./run env | sed 's/^/export /')
    $DYNSNAP_VENV/bin/python tests/mutate_agent.py [--list] [--all-failures] [INDEX|ID ...]

The agent runs as its own process in these tests (`python -m dynsnap agent`), which imports the
mutated module itself: the mutant stays on disk for the whole pytest run (no early restore), so do
not run this beside other work in the same tree. The cluster gets its own bridge and /16
(dsnmut1, 10.218.0.0/16) unless DYNSNAP_TEST_BRIDGE / DYNSNAP_TEST_CIDR say otherwise.
tests/mutation/runner.py says how a run goes and what each outcome means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.mutation.runner import Edit, Suite, main, mutation

EXECUTOR = "dynsnap/agent/executor.py"
ADMISSION = "dynsnap/agent/admission.py"
CUDA = "dynsnap/agent/cuda.py"
IMAGES = "dynsnap/agent/images.py"
CRIU = "dynsnap/agent/criu.py"
ATTEMPTS = "dynsnap/agent/attempts.py"
SERVING_GATE = "dynsnap/agent/serving.py"
STATUS = "dynsnap/agent/status.py"

FAULTS = "tests/integration/test_agent_faults.py::"
REFUSALS = "tests/integration/test_agent_refusals.py::"
GPU_MISSING = FAULTS + "test_gpu_process_outside_the_dumped_tree_fails_the_capture_and_the_worker_comes_back"
PIDS_TAKEN = FAULTS + "test_restore_whose_pid_is_taken_is_refused_then_succeeds_once_it_is_free"
HELPER_HANG = FAULTS + "test_helper_hanging_past_its_bound_is_killed_rolled_back_and_retried"
LOCK_TIMEOUT = FAULTS + "test_lock_that_never_comes_back_fails_the_capture_and_unlocks_the_others"
IO_URING = FAULTS + "test_io_uring_ring_in_the_worker_tree_is_refused_and_criu_names_a_mapped_one"
BUDGET = FAULTS + "test_capture_over_the_disk_budget_is_refused_before_it_starts"
PIDFLOOR = "tests/integration/test_agent_pidfloor.py::test_snapshot_is_refused_without_the_pid_reservation"
CRIU_FDS = "tests/integration/test_agent_criu_fds.py::test_snapshot_wakes_a_worker_whose_container_has_no_criu"
SERVING = REFUSALS + "test_capture_of_a_worker_still_in_serving_is_refused_until_it_is_quiesced"
EXEC_SERVING = "tests/native/test_agent_exec.py::test_exec_refuses_a_capture_not_confirmed_out_of_serving"
WRONG_UID = REFUSALS + "test_agent_refuses_a_spec_naming_the_wrong_pod_and_changes_nothing[uid-of-another-pod]"
ADMIT_UNIT = "tests/unit/test_agent_admit.py"
NCCL = REFUSALS + "test_ranks_on_nccl_without_the_settings_the_driver_needs_are_refused_before_any_lock"
RESERVE_UNIT = "tests/unit/test_agent_images.py::test_captures_at_once_each_count_the_others_reservation"
GATE_CONFIRMED = "tests/integration/test_agent_serving_gate.py"
PERMANENT = FAULTS + "test_a_permanent_refusal_is_not_retried_until_the_spec_changes"
CRIU_ERRORS = "tests/native/test_criu_errors.py"
UPGRADE = "tests/integration/test_agent_upgrade.py"
STATUS_UNIT = "tests/unit/test_agent_status.py"

MUTATIONS = (
    mutation(
        "no-completeness-guard", "the completeness guard finds nothing missing after a dump", EXECUTOR,
        "        missing = sorted(gpu_ns - image_pids(staging))\n",
        "        missing = sorted(gpu_ns - gpu_ns)\n",
        tests=[GPU_MISSING]),
    mutation(
        "no-pid-reservation-check", "a snapshot is taken without the pid reservation (both of its checks gone)",
        EXECUTOR,
        '        if not w.info.get("pid_reserved"):\n',
        '        if False:\n',
        more=[Edit(EXECUTOR, "        low = W.pids_below_floor(w)\n", "        low: list[int] = []\n")],
        tests=[PIDFLOOR]),
    mutation(
        "no-serving-check", "a capture proceeds while the worker is in serving", EXECUTOR,
        "            why = await gate(w)\n",
        "            why = None\n",
        tests=[EXEC_SERVING, SERVING]),
    mutation(
        "no-uid-check", "a WorkerSnapshot naming another pod's UID is acted on", ADMISSION,
        "    if uid != ws.spec.pod_uid:\n",
        "    if False:\n",
        tests=[ADMIT_UNIT, WRONG_UID]),
    mutation(
        "no-multi-gpu-refusal", "NCCL ranks without the settings the driver needs are captured", EXECUTOR,
        "        unsafe = W.unsafe_multi_gpu(w, self.proc)\n",
        "        unsafe = None\n",
        tests=[NCCL]),
    mutation(
        "no-rollback-after-failed-save", "a failed save leaves the GPU processes as it left them", CUDA,
        "        if checkpointed:\n            # No memory check",
        "        if False:\n            # No memory check",
        more=[Edit(CUDA, "        if locked:\n            await self.action(\"unlock\"",
                   "        if False:\n            await self.action(\"unlock\"")],
        tests=[HELPER_HANG, LOCK_TIMEOUT]),
    mutation(
        "no-restore-pid-check", "CRIU is asked to restore over pids that are taken", EXECUTOR,
        "        taken = sorted(wanted & {p.ns_pid for p in w.procs})\n",
        "        taken: list[NsPid] = []\n",
        tests=[PIDS_TAKEN]),
    mutation(
        "squatter-is-the-worker", "any process on the worker's pid is taken for the woken worker", EXECUTOR,
        "        return host is not None and procfs.cmdline(host, self.proc) == want\n",
        "        return True\n",
        tests=[PIDS_TAKEN + "[root]"]),
    mutation(
        "no-io-uring-preflight", "a worker holding an io_uring descriptor goes to CRIU", EXECUTOR,
        "        rings = W.io_uring_holders(w, self.proc)\n        if rings:\n            raise StepFailure("
        "Reason.IO_URING_IN_USE, f\"processes holding io_uring (CRIU cannot dump it): {rings}\",\n"
        "                              changed=False)\n",
        "        rings: list[int] = []\n        if rings:\n            raise StepFailure("
        "Reason.IO_URING_IN_USE, f\"processes holding io_uring (CRIU cannot dump it): {rings}\",\n"
        "                              changed=False)\n",
        tests=[IO_URING]),
    mutation(
        "no-disk-budget", "a capture over the node's image budget starts", IMAGES,
        "        if used + estimate > self.budget_bytes:\n",
        "        if False:\n",
        tests=[BUDGET]),
    mutation(
        "criu-by-path", "CRIU is run by its agent paths inside the worker's mount namespace, not from "
        "descriptors of the agent's files", CRIU,
        "        interp = elf_interpreter(files.fds[-1])\n",
        "        raise NotElf(\"mutant\")\n",
        tests=[CRIU_FDS]),
    # -- issue 18 ---------------------------------------------------------------------------------------
    mutation(
        "budget-not-reserved", "a capture's staging directory holds none of the budget until it has bytes",
        IMAGES,
        "            (s / RESERVED_FILE).write_text(f\"{max(estimate, 0)}\\n\")\n",
        "",
        tests=[RESERVE_UNIT]),
    mutation(
        "reservation-not-counted", "the budget check ignores the other captures' reservations", IMAGES,
        "                    total += max(reserved - dir_bytes(s), 0)\n",
        "                    total += 0\n",
        tests=[RESERVE_UNIT]),
    mutation(
        "serving-gate-from-cache-only", "a stale cached serving gate refuses the capture without asking the "
        "API server", SERVING_GATE,
        "    serving = pod_serving_gate(cached)\n    if serving == \"False\":\n",
        "    serving = pod_serving_gate(cached)\n    if True:\n",
        tests=[GATE_CONFIRMED]),
    mutation(
        "permanent-refusal-retried", "a refusal no retry can cure is retried after the backoff", ATTEMPTS,
        "    if err.reason in P.PERMANENT_REFUSALS:\n        return DesiredState.ACTIVE, None\n",
        "",
        more=[Edit(ATTEMPTS, "    if reason in P.PERMANENT_REFUSALS:\n        return None\n", "")],
        tests=[PERMANENT]),
    mutation(
        "criu-message-is-the-tail", "a CRIU failure's message is the log's tail, not its error lines", CRIU,
        "        return \"\\n\".join(self.errors) if self.errors else self.log_tail\n",
        "        return self.log_tail\n",
        tests=[CRIU_ERRORS]),
    mutation(
        "older-format-not-read", "a capture of an older format than the agent writes is not restored", IMAGES,
        "                if manifest.get(\"format\") not in P.IMAGE_FORMATS_READ:\n",
        "                if manifest.get(\"format\") != P.IMAGE_FORMAT:\n",
        tests=[UPGRADE]),
    mutation(
        "unseen-worker-still-suspended", "a worker the agent cannot see keeps the Suspended condition of "
        "before", STATUS,
        "    status.conditions = set_condition(status.conditions, CT.SUSPENDED, None, v.reason,\n",
        "    status.conditions = set_condition(status.conditions, CT.PROGRESSING, None, v.reason,\n",
        tests=[STATUS_UNIT]),
    mutation(
        "pages-read-last-line-only", "the restore's pagesRead takes the last restorer's thread count, not the "
        "most any used", CRIU,
        "threads=max(t for _, t in found), processes=len(found))\n",
        "threads=found[-1][1], processes=len(found))\n",
        tests=["tests/unit/test_agent_criu.py"]),
    mutation(
        "pages-read-not-reported", "the restore step does not say how CRIU read the pages", EXECUTOR,
        "        info[\"pagesRead\"] = vars(res.pages_read) if res.pages_read else None\n",
        "        info[\"pagesRead\"] = None\n",
        tests=["tests/native/test_agent_exec.py::test_a_snapshot_wake_reads_the_pages_back_with_several_threads"]),
)

SUITE = Suite(
    name="agent",
    doc="docs/TESTING.md",
    mutations=MUTATIONS,
    default_env={"DYNSNAP_TEST_BRIDGE": "dsnmut1", "DYNSNAP_TEST_CIDR": "10.218.0.0/16",
                 "DYNSNAP_KEEP_LOGS": "{work}/test-logs"},  # a killed mutant's logs stay out of test-logs/
    timeout=1800,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
