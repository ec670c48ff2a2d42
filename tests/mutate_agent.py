"""Mutation check of the node agent's guards (issue 8; docs/TESTING.md, "Mutation checks"): each
guard broken on purpose as an exact replacement in dynsnap/agent/, then the tests that must go red.
Not collected by pytest (no test_ prefix). From the repository root, as root, with the environment
of `./run env`:

    source <(./run env | sed 's/^/export /')
    $DYNSNAP_VENV/bin/python tests/mutate_agent.py [--list] [--all-failures] [INDEX|ID ...]

The agent runs as its own process in these tests (`python -m dynsnap agent`), which imports the
mutated module itself: the mutant stays on disk for the whole pytest run (no early restore), so do
not run this beside other work in the same tree. The rows whose tests are in tests/integration/node/
run the agent from its image on the real node, so every mutant (and the baseline) first builds the
image set of the mutated tree (tests/mutation/images.py). The cluster gets its own bridge and /16
(dsnmut1, 10.218.0.0/16) unless DYNSNAP_TEST_BRIDGE / DYNSNAP_TEST_CIDR say otherwise.
tests/mutation/runner.py says how a run goes and what each outcome means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.mutation import images
from tests.mutation.runner import Edit, Suite, main, mutation

EXECUTOR = "dynsnap/agent/executor.py"
CAPTURE_STEPS = "dynsnap/agent/capture_steps.py"
WAKE_STEPS = "dynsnap/agent/wake_steps.py"
ADMISSION = "dynsnap/agent/admission.py"
CUDA = "dynsnap/agent/cuda.py"
IMAGES = "dynsnap/agent/images.py"
CRIU = "dynsnap/agent/criu.py"
CRIU_LOG = "dynsnap/agent/criu_log.py"
ENTRYPOINT_CONTROL = "dynsnap/agent/entrypoint_control.py"
NETLOCK = "dynsnap/agent/netlock.py"
ENGINE_ROUTES = "dynsnap/agent/engine_routes.py"
PLAN = "dynsnap/agent/plan.py"
ATTEMPTS = "dynsnap/agent/attempts.py"
SERVING_GATE = "dynsnap/agent/serving.py"
STATUS = "dynsnap/agent/status.py"
CONTAINER = "dynsnap/agent/container.py"
HELPERS = "dynsnap/agent/helpers.py"
CONTROL = "dynsnap/agent/entrypoint_control.py"
WORKER = "dynsnap/agent/worker.py"
WORKERENV = "dynsnap/models/workerenv.py"
COMMAND = "dynsnap/runtime/command.py"
NODE = "dynsnap/agent/node.py"
EDGE = "dynsnap/agent/edge.py"

FAULTS = "tests/integration/node/test_agent_faults.py::"
U_COMPLETE = "tests/unit/test_agent_completeness.py::"
GPU_MISSING = U_COMPLETE + "test_the_seal_rejects_a_dump_missing_a_recorded_gpu_process"
GPU_OUTSIDE = [U_COMPLETE + "test_a_gpu_process_reparented_to_the_entrypoint_is_outside",
               U_COMPLETE + "test_the_preflight_refuses_it_before_any_change",
               "tests/integration/node/test_agent_faults.py::"
               "test_a_gpu_process_outside_the_worker_tree_is_refused_before_any_change"]
U_CAPS = "tests/unit/test_agent_caps.py::"
CAPS_NODE = ("tests/integration/node/test_agent_host_boundary.py::"
             "test_a_worker_holding_a_capability_the_agent_lacks_is_refused_a_snapshot_and_sleeps_by_suspend")
PIDS_TAKEN = ("tests/integration/node/test_agent_faults.py::"
              "test_restore_whose_pid_is_taken_is_refused_then_succeeds_once_it_is_free[other]")
PIDS_TAKEN_ROOT = ("tests/integration/node/test_agent_faults.py::"
                   "test_restore_whose_pid_is_taken_is_refused_then_succeeds_once_it_is_free[root]")
HELPER_HANG = ("tests/integration/node/test_agent_faults.py::"
               "test_helper_hanging_past_its_bound_is_killed_rolled_back_and_retried")
LOCK_TIMEOUT = ("tests/integration/node/test_agent_faults.py::"
                "test_a_lock_that_never_comes_back_for_one_of_two_gpu_processes_unlocks_the_other")
IO_URING = FAULTS + "test_io_uring_ring_in_the_worker_tree_is_refused_and_criu_names_a_mapped_one"
BUDGET = ("tests/integration/node/test_agent_faults.py::"
          "test_a_capture_over_the_disk_budget_is_refused_before_it_starts")
PIDFLOOR = ("tests/integration/node/test_controller_refusals.py::"
            "test_a_capture_refused_for_good_puts_the_worker_back_into_serving_and_is_not_asked_again[PidReservationMissing]")
EXEC_SNAPSHOT = "tests/native/test_agent_exec.py::test_exec_captures_and_wakes_without_kubernetes[snapshot]"
NODE_REFUSALS = "tests/integration/node/test_agent_refusals.py::"
SERVING = NODE_REFUSALS + "test_a_capture_of_a_worker_still_in_serving_is_refused_until_it_is_out"
RELOOK = (NODE_REFUSALS + "test_a_worker_whose_report_turns_unusable_and_right_again_is_refused_and_accepted_by_the_"
          "agent_alone")
EXEC_SERVING = "tests/native/test_agent_exec.py::test_exec_refuses_a_capture_not_confirmed_out_of_serving"
WRONG_UID = NODE_REFUSALS + "test_the_agent_refuses_a_spec_naming_the_wrong_pod_and_changes_nothing[uid-of-another-pod]"
ADMIT_UNIT = "tests/unit/test_agent_admit.py"
NCCL = ("tests/integration/node/test_agent_ranks.py::"
        "test_ranks_on_nccl_without_the_settings_the_driver_needs_are_refused_before_any_lock")
RESERVE_UNIT = "tests/unit/test_agent_images.py::test_captures_at_once_each_count_the_others_reservation"
GATE_CONFIRMED = "tests/integration/test_agent_serving_gate.py"
PERMANENT = NODE_REFUSALS + "test_a_permanent_refusal_is_not_retried_by_the_agent_until_the_spec_changes"
CRIU_ERRORS = "tests/native/test_criu_errors.py"
UPGRADE = ("tests/integration/node/test_agent_restart.py::"
           "test_the_next_agent_wakes_a_worker_its_predecessor_snapshotted")
NODE_RESTART = "tests/integration/node/test_agent_restart.py::test_agent_killed_during"
STATUS_UNIT = "tests/unit/test_agent_status.py"
ENGINE = "tests/integration/node/test_engine_tier.py::"
ENGINE_NO_ROUTES = ENGINE + "test_a_worker_without_engine_routes_is_refused_and_auto_sleeps_it_with_suspend"
ENGINE_FAULT = ENGINE + "test_a_route_that_fails_or_hangs_is_named_bounded_and_the_worker_serves"
PLAN_UNIT = "tests/unit/test_agent_plan.py"
WOR = "tests/integration/node/test_wake_on_request.py::"
WOR_TWO = WOR + "test_two_requests_at_once_wake_one_worker_not_two"
WOR_FAILED = WOR + "test_a_failed_wake_on_request_ends_its_request_with_an_error_and_the_fallback"
# issue 19: the worker found under either cgroup driver, in the container the runtime reports
PROCFS = "dynsnap/runtime/procfs.py"
U_FIND = "tests/unit/test_agent_find_worker.py::"
U_PROCFS = "tests/unit/test_procfs.py::"
U_CGROUP = "tests/unit/test_agent_cgroup_check.py::"
# issue 18: the trust boundary with a container, and the helper registry
U_CONTAINER = "tests/unit/test_agent_container.py::"
U_SCHEMA = "tests/unit/test_agent_entrypoint_schema.py::"
U_HELPERS = "tests/unit/test_agent_helpers.py::"
U_BOUNDED = "tests/unit/test_bounded_http.py::"
U_QUEUE = "tests/unit/test_workqueue.py::"
EDGE_UNBOUNDED_SAID = U_BOUNDED + "test_a_routable_sleeper_whose_gauge_trickles_is_said_once_and_woken_never"
NODE_REFUSALS = "tests/integration/node/test_agent_refusals.py::"
NODE_DIR = (NODE_REFUSALS
            + "test_a_control_directory_leading_to_a_node_directory_is_refused_and_that_directory_untouched")
FORGED = NODE_REFUSALS + "test_a_helper_marker_forged_inside_the_worker_changes_nothing"
PLANTED = NODE_REFUSALS + "test_a_symlink_planted_at_the_agents_former_temp_name_is_never_followed"
NODE_TRUST = "tests/integration/node/test_agent_trust.py::"
TAMPERED = NODE_TRUST + "test_an_unusable_entrypoint_report_in_a_real_container_is_refused_and_nothing_is_touched"
REFUSED_PEER = NODE_TRUST + "test_the_agent_serves_its_other_workers_while_one_is_refused"
STALE_RECORD = U_HELPERS + "test_a_record_whose_process_is_another_is_stale_and_nothing_is_signalled"

MUTATIONS = (
    mutation(
        "no-completeness-guard", "the completeness guard finds nothing missing after a dump", CAPTURE_STEPS,
        "    missing = sorted(gpu_ns - image_pids(staging))\n",
        "    missing = sorted(gpu_ns - gpu_ns)\n",
        tests=[GPU_MISSING]),
    mutation(
        "no-pid-reservation-check", "a snapshot is taken without the pid reservation (both of its checks gone)",
        CAPTURE_STEPS,
        '    if not w.info.get("pid_reserved"):\n',
        '    if False:\n',
        more=[Edit(CAPTURE_STEPS, "    low = W.pids_below_floor(w)\n", "    low: list[int] = []\n")],
        tests=[PIDFLOOR]),
    mutation(
        "no-serving-check", "a capture proceeds while the worker is in serving", CAPTURE_STEPS,
        "        why = await c.gate(w)\n",
        "        why = None\n",
        tests=[EXEC_SERVING, SERVING]),
    mutation(
        "no-uid-check", "a WorkerSnapshot naming another pod's UID is acted on", ADMISSION,
        "    if uid != ws.spec.pod_uid:\n",
        "    if False:\n",
        tests=[ADMIT_UNIT, WRONG_UID]),
    mutation(
        "no-multi-gpu-refusal", "NCCL ranks without the settings the driver needs are captured", CAPTURE_STEPS,
        "        unsafe = await asyncio.to_thread(W.unsafe_multi_gpu, w, ex.proc)\n",
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
        "no-restore-pid-check", "CRIU is asked to restore over pids that are taken", WAKE_STEPS,
        "    taken = sorted(wanted & {p.ns_pid for p in w.procs if p.pid not in gone})\n",
        "    taken: list[NsPid] = []\n",
        tests=[PIDS_TAKEN, PIDS_TAKEN_ROOT]),
    mutation(
        "squatter-is-the-worker", "any process on the worker's pid is taken for the woken worker", EXECUTOR,
        "        return host is not None and procfs.cmdline(host, self.proc) == want\n",
        "        return True\n",
        tests=[PIDS_TAKEN_ROOT]),
    mutation(
        "no-io-uring-preflight", "a worker holding an io_uring descriptor goes to CRIU", CAPTURE_STEPS,
        "    rings = W.io_uring_holders(w, ex.proc)\n    if rings:\n        raise StepFailure("
        "Reason.IO_URING_IN_USE, f\"processes holding io_uring (CRIU cannot dump it): {rings}\",\n"
        "                          changed=False)\n",
        "    rings: list[int] = []\n    if rings:\n        raise StepFailure("
        "Reason.IO_URING_IN_USE, f\"processes holding io_uring (CRIU cannot dump it): {rings}\",\n"
        "                          changed=False)\n",
        tests=[IO_URING]),
    mutation(
        "no-disk-budget", "a capture over the node's image budget starts", IMAGES,
        "        if used + estimate > self.budget_bytes:\n",
        "        if False:\n",
        tests=[BUDGET]),
    mutation(
        "criu-without-tree-mntns", "a dump from CRIU's own mount namespace without --tree-mntns (the worker's mount "
        "namespace taken for one to dump)", CRIU,
        '    args = ["dump", "--tree-mntns", "-t", str(pid), "-D", str(images_dir), "-o", str(log_path),\n',
        '    args = ["dump", "-t", str(pid), "-D", str(images_dir), "-o", str(log_path),\n',
        tests=[EXEC_SNAPSHOT]),
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
        "criu-message-is-the-tail", "a CRIU failure's message is the log's tail, not its error lines", CRIU_LOG,
        "            return \"\\n\".join(([self.decisive] if self.decisive else []) + rest)\n",
        "            return self.log_tail\n",
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
    # -- issue 21: tier engine -------------------------------------------------------------------------
    mutation(
        "engine-routes-not-probed", "a worker whose engine has no sleep routes is quiesced for tier engine anyway",
        CAPTURE_STEPS,
        "        c.info[\"engine\"] = {\"routes\": await G.probe(ex, c)}\n",
        "        c.info[\"engine\"] = {\"routes\": None}\n",
        tests=[ENGINE_NO_ROUTES]),
    mutation(
        "engine-error-answer-ok", "an engine's error answer to its route is taken for done", ENGINE_ROUTES,
        "        return self.status == 200 and self.body is not None and self.body.get(\"status\") == \"ok\"\n",
        "        return self.status == 200\n",
        tests=[ENGINE_FAULT + "[fail-EngineRouteFailed-answered HTTP 200: ]"]),
    mutation(
        "engine-route-unbounded", "an engine route that never answers is waited for without a bound", ENGINE_ROUTES,
        "            async with asyncio.timeout(bound):\n",
        "            async with asyncio.timeout(None):\n",
        more=[Edit(ENGINE_ROUTES, "            async with httpx.AsyncClient(timeout=bound, trust_env=False) as http:\n",
                   "            async with httpx.AsyncClient(timeout=None, trust_env=False) as http:\n")],
        tests=[ENGINE_FAULT + "[hang-EngineRouteTimeout-no answer within 6 s]"]),
    mutation(
        "engine-rollback-skips-wake", "a capture of tier engine called off mid-way settles active without the "
        "engine's wake route", PLAN,
        "        return Step.ENGINE_SLEEP if want == DesiredState.SUSPENDED else Step.ENGINE_WAKE\n",
        "        return Step.ENGINE_SLEEP if want == DesiredState.SUSPENDED else Step.SETTLE_ACTIVE\n",
        tests=[PLAN_UNIT]),
    mutation(
        "pages-read-last-line-only", "the restore's pagesRead takes the last restorer's thread count, not the "
        "most any used", CRIU_LOG,
        "threads=max(t for _, t in found), processes=len(found))\n",
        "threads=found[-1][1], processes=len(found))\n",
        tests=["tests/unit/test_agent_criu.py"]),
    mutation(
        "pages-read-not-reported", "the restore step does not say how CRIU read the pages", WAKE_STEPS,
        "    c.info[\"pagesRead\"] = vars(res.pages_read) if res.pages_read else None\n",
        "    c.info[\"pagesRead\"] = None\n",
        tests=["tests/native/test_agent_exec.py::test_a_snapshot_wake_reads_the_pages_back_with_several_threads"]),
    # -- issue 18: paths inside a container --------------------------------------------------------
    mutation(
        "resolve-follows-symlinks", "a container path is resolved through its symlinks (inside the root)", CONTAINER,
        "        resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | (0 if symlinks else RESOLVE_NO_SYMLINKS)\n",
        "        resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS\n",
        tests=[U_CONTAINER + "test_a_symlinked_directory_to_a_host_directory_is_refused_and_named",
               NODE_DIR + "[symlinked]"]),
    mutation(
        "walk-follows-symlinks", "without openat2, the component walk takes a symlink for a directory entry",
        CONTAINER,
        "            if stat.S_ISLNK(mode):\n",
        "            if False:\n",
        tests=[U_CONTAINER + "test_a_symlinked_directory_to_a_host_directory_is_refused_and_named[walk]",
               U_CONTAINER + "test_a_relative_symlink_and_a_symlinked_file_are_refused[walk]"]),
    mutation(
        "dotdot-allowed", "a container path with a '..' component is resolved", CONTAINER,
        "    if \"..\" in parts:\n",
        "    if False:\n",
        tests=[U_CONTAINER + "test_paths_the_agent_does_not_resolve_are_refused_with_the_rule_they_break",
               NODE_DIR + "[dotdot]"]),
    mutation(
        "temp-not-exclusive", "the state request's temp file is opened without O_EXCL | O_NOFOLLOW", CONTAINER,
        "os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK",
        "os.O_CREAT | os.O_NONBLOCK",
        tests=[U_CONTAINER + "test_a_temp_name_planted_in_advance_is_never_opened"]),
    mutation(
        "temp-name-predictable", "the state request's temp file is named after the agent's pid", CONTAINER,
        "        tmp = f\".{final}.{secrets.token_hex(16)}\"\n",
        "        tmp = f\".{final}.{os.getpid()}\"\n",
        tests=[U_CONTAINER + "test_replace_writes_through_a_fresh_temp_file_and_leaves_nothing_else",
               PLANTED]),
    mutation(
        "control-file-unbounded", "entrypoint.json is read whatever its size", CONTROL,
        "            raw = d.read(P.ENTRYPOINT_CONTROL_FILE, limit=CONTROL_FILE_BOUND)\n",
        "            raw = d.read(P.ENTRYPOINT_CONTROL_FILE, limit=1 << 40)\n",
        tests=[U_SCHEMA + "test_an_unusable_control_file_is_a_named_refusal[oversized]",
               TAMPERED + "[oversized]"]),
    mutation(
        "read-bound-unchecked", "a read of a container process's memory goes on past its bound", CONTAINER,
        "    while got <= limit:\n",
        "    while True:\n",
        tests=[U_CONTAINER + "test_the_environment_is_read_with_a_bound_and_only_valid_keys_come_out"]),
    mutation(
        "service-port-unbounded", "KUBERNETES_SERVICE_PORT is taken outside 1-65535", WORKERENV,
        "_Port = Annotated[int, Field(ge=1, le=65535)]\n",
        "_Port = Annotated[int, Field(ge=0)]\n",
        tests=[U_CONTAINER + "test_the_environment_is_read_with_a_bound_and_only_valid_keys_come_out"]),
    mutation(
        "service-host-not-an-ip", "KUBERNETES_SERVICE_HOST reaches ss -K as the worker wrote it", WORKER,
        "    if env.service_host is not None and env.service_port is not None:\n"
        "        out.append((str(env.service_host), env.service_port))\n",
        "    raw = procfs.environ(pid, proc)\n"
        "    if raw.get(\"KUBERNETES_SERVICE_HOST\") and env.service_port is not None:\n"
        "        out.append((raw[\"KUBERNETES_SERVICE_HOST\"], env.service_port))\n",
        tests=[U_CONTAINER + "test_only_ip_addresses_and_ports_reach_the_connection_reset"]),
    # -- issue 19: which process is the worker -----------------------------------------------------
    mutation(
        "reported-container-guessed", "a container the pod's status names with no process here falls back to "
        "any container running the entrypoint", WORKER,
        "    if not found:\n        raise WorkerNotFound(",
        "    if not found:\n        return inits\n        raise WorkerNotFound(",
        tests=[U_FIND + "test_a_reported_container_with_no_process_here_is_not_found_not_guessed"]),
    mutation(
        "container-id-any-component", "a container id is read from any 64-hex component with a runtime's prefix "
        "(conmon's scope, a sub-cgroup), not only the one right below the pod's", PROCFS,
        "        c = _CONTAINER_DIR.match(below[0]) if len(below) == 1 else None\n",
        "        c = _CONTAINER_DIR.match(below[0].replace(\"crio-conmon-\", \"crio-\")) if below else None\n",
        tests=[U_FIND + "test_crio_conmon_beside_the_container_is_not_taken_for_it",
               U_PROCFS + "test_a_cgroup_path_names_its_pod_and_container_under_either_driver"]),
    # -- issue 18: the agent's helpers -------------------------------------------------------------
    mutation(
        "helper-start-time-unchecked", "a recorded helper is matched by pid and executable, not its start time",
        HELPERS,
        "        if st is None or st.start != rec.get(\"start\") or st.state in (\"Z\", \"X\"):\n",
        "        if st is None or st.state in (\"Z\", \"X\"):\n",
        tests=[STALE_RECORD + "[start]"]),
    mutation(
        "helper-exe-unchecked", "a recorded helper is matched whatever its process runs", HELPERS,
        "        return st if _exe(pid, self.proc) == rec.get(\"exe\") else None\n",
        "        return st\n",
        tests=[STALE_RECORD + "[exe]"]),
    mutation(
        "helper-boot-unchecked", "a record from an earlier boot of the node is matched", HELPERS,
        "        return rec.get(\"bootId\") == self._boot_id()\n",
        "        return True\n",
        tests=[STALE_RECORD + "[boot]"]),
    mutation(
        "helper-kill-unchecked", "a helper is killed by its pid without checking it again through the pidfd",
        HELPERS,
        "            if self._matches(rec) is None:  # checked with the process pinned: a reused pid fails here\n",
        "            if False:\n",
        tests=[STALE_RECORD + "[start]"]),
    mutation(
        "helper-env-marker", "a process carrying DYNSNAP_OP=<pod uid>/... is taken for the agent's helper",
        HELPERS,
        "        for path, rec in self._records():\n            st = self._matches(rec)\n",
        "        marked = [(Path(\"/nonexistent/dynsnap-mutant\"), {\"pid\": p, \"start\": s.start, "
        "\"exe\": _exe(p, self.proc), \"podUID\": uid, \"op\": \"criu\", \"bootId\": self._boot_id()}) "
        "for p in procfs.pids(self.proc) if procfs.environ(p, self.proc).get(\"DYNSNAP_OP\", \"\")"
        ".startswith(f\"{uid}/\") and (s := _stat(p, self.proc)) is not None]\n"
        "        for path, rec in self._records() + marked:\n            st = self._matches(rec)\n",
        tests=[U_HELPERS + "test_a_forged_marker_is_no_helper", FORGED, REFUSED_PEER]),
    mutation(
        "helper-gone-is-an-error", "a helper that exited before its record was written fails its step", HELPERS,
        "                                                                            else parent):\n"
        "            return None\n",
        "                                                                            else parent):\n"
        "            raise LookupError(f\"helper {pid} ({label}) exited before it could be recorded\")\n",
        tests=[U_HELPERS + "test_a_helper_gone_before_its_record_or_no_child_of_the_agent_is_not_recorded"]),
    mutation(
        "helper-unrecorded-runs-on", "a helper whose record cannot be written runs on", COMMAND,
        "            reaped = on_spawn(proc.pid)\n",
        "            with contextlib.suppress(Exception):\n                reaped = on_spawn(proc.pid)\n",
        tests=[U_HELPERS + "test_a_helper_that_cannot_be_recorded_does_not_run_on"]),
    # -- issue 20: wake on request --------------------------------------------------------------------
    mutation(
        "edge-ignores-requests", "a request that reaches a worker asleep routable is not seen by the agent",
        EDGE,
        "            if n and n > 0:\n",
        "            if False:\n",
        tests=[WOR_TWO, U_BOUNDED + "test_one_trickling_sleeper_delays_no_other_sleepers_wake_on_request"]),
    mutation(
        "edge-one-round-for-all", "the wake-on-request watch waits for every sleeper's look each round", EDGE,
        "                        loops[key] = (s, start(s))\n",
        "                        await look(http, s)\n                        loops[key] = (s, start(s))\n",
        tests=[U_BOUNDED + "test_one_trickling_sleeper_delays_no_other_sleepers_wake_on_request"]),
    mutation(
        "edge-unbounded-said-every-look", "a routable sleeper whose gauge trickles is said at every look, not "
        "once per episode", EDGE,
        "                if said != e.cause and on_unbounded is not None:\n",
        "                if on_unbounded is not None:\n",
        tests=[EDGE_UNBOUNDED_SAID]),
    mutation(
        "edge-unbounded-unsaid", "a routable sleeper whose gauge trickles is never said", EDGE,
        "                    on_unbounded(s.key, e)\n",
        "                    pass\n",
        tests=[EDGE_UNBOUNDED_SAID]),
    mutation(
        "exchange-unbounded-in-time", "an exchange with a pod is bounded per read only (httpx's timeout)",
        "dynsnap/runtime/bounded_http.py", "        async with asyncio.timeout(deadline):\n",
        "        async with asyncio.timeout(None):\n",
        tests=[U_BOUNDED + "test_a_trickled_body_ends_at_the_deadline_though_every_read_is_quick"]),
    mutation(
        "exchange-unbounded-in-size", "an answer's body is read whatever its size", "dynsnap/runtime/bounded_http.py",
        "                    if len(body) > max_bytes:\n", "                    if False:\n",
        tests=[U_BOUNDED + "test_an_answer_over_the_cap_is_refused_as_it_comes"]),
    mutation(
        "request-wake-trigger-unrecorded", "the agent's wake for a request is not recorded as one (trigger)",
        NODE,
        "                status.last_wake.trigger = \"request\"\n",
        "                pass\n",
        tests=[WOR_TWO]),
    mutation(
        "failed-request-wake-holds-requests", "a wake on request that fails leaves the worker holding its "
        "requests (not stopped)", NODE,
        "            why = await self.executor.stop_worker(obs)\n",
        "            why = \"not stopped\"\n",
        tests=[WOR_FAILED]),
    # -- issue 19: a restored tree runs in its container's cgroups --------------------------------------
    mutation(
        "restored-cgroups-unchecked", "a tree CRIU restored outside its container's cgroups is woken (not "
        "compared with the container's PID 1, not killed)", WAKE_STEPS,
        "    wrong = CG.check(w.entrypoint, [p.pid for p in tree], ex.proc) if tree else []\n",
        "    wrong: list[str] = []\n",
        tests=[U_CGROUP + "test_a_tree_restored_outside_its_container_is_killed_and_the_capture_kept"]),
    # -- issue 19: a refusal for what a container holds is looked at again -----------------------------
    mutation(
        "container-refusal-final", "a worker refused for its container's contents is never looked at again "
        "until its pod or WorkerSnapshot changes", NODE,
        "            return CONTAINER_RELOOK_S\n",
        "            return None\n",
        tests=[RELOOK]),
    # -- issue 19: the agent-killed matrix on the real node ----------------------------------------------
    mutation(
        "helper-not-waited-for", "a restarted agent acts on a worker while a helper its predecessor started "
        "still runs for it", PLAN,
        "    if f.helper_running:\n        return Step.WAIT_HELPER\n",
        "    if False:\n        return Step.WAIT_HELPER\n",
        tests=[NODE_RESTART + "[capture-save-suspend]", NODE_RESTART + "[wake-resume-snapshot]"]),
    mutation(
        "maps-read-whole", "a process's /proc maps is read whatever its size", "dynsnap/runtime/procfs.py",
        "    if len(raw) > MAPS_READ_BOUND:\n", "    if False:\n",
        tests=["tests/unit/test_procfs_bounds.py::test_maps_past_the_bound_are_refused_and_within_it_read"]),
    mutation(
        "fds-read-whole", "every descriptor of a process is read whatever their number", "dynsnap/runtime/procfs.py",
        "            if len(names) == FD_COUNT_BOUND:\n", "            if False:\n",
        tests=["tests/unit/test_procfs_bounds.py::test_descriptors_past_the_bound_are_refused_before_any_is_read"]),
    mutation(
        "metrics-bound-said-every-scrape", "a worker whose metrics pass a bound is said at every scrape", NODE,
        "            if e.cause in (\"deadline\", \"size\") and self._unbounded.get(ws.key) != e.cause:\n",
        "            if e.cause in (\"deadline\", \"size\"):\n",
        tests=[U_BOUNDED + "test_a_worker_whose_metrics_pass_a_bound_is_said_once_per_episode"]),
    mutation(
        "gate-written-by-name-only", "the controller's serving gate is written to whichever pod has the name",
        "dynsnap/controller/writes.py", "        if meta.get(\"uid\"):\n            ident[\"uid\"] = meta[\"uid\"]\n",
        "        if False:\n            ident[\"uid\"] = meta[\"uid\"]\n",
        tests=["tests/integration/test_controller_gate_uid.py"]),
    mutation(
        "reconcile-unbounded", "a reconcile that never returns holds its worker for good (the bound ignored)",
        "dynsnap/runtime/workqueue.py", "            bound = asyncio.timeout(timeout)\n",
        "            bound = asyncio.timeout(None)\n",
        tests=[U_QUEUE + "test_a_reconcile_past_its_bound_is_cancelled_counted_and_queued_again"]),
    mutation(
        "criu-kill-said-after-its-log", "a CRIU killed from outside is summed up by the lines it logged before, "
        "not by the kill", CRIU_LOG,
        "        if self.cause == \"killed\":\n",
        "        if False:\n",
        tests=["tests/unit/test_agent_criu.py::test_a_criu_killed_from_outside_says_so_first_whatever_it_logged_before"]),
    mutation(
        "queue-no-group-limit", "one graph's keys may hold every reconcile worker (issue 39: the group limit "
        "ignored)", "dynsnap/runtime/workqueue.py",
        "            if self.group_limit and self._active.get(g, 0) >= self.group_limit:\n",
        "            if False:\n",
        tests=[U_QUEUE + "test_one_graphs_stuck_reconciles_hold_at_most_their_share_of_the_workers",
               U_QUEUE + "test_a_group_at_its_limit_waits_and_is_served_again_when_one_of_its_keys_is_done"]),
    mutation(
        "queue-groups-not-in-turn", "the waiting keys are served first come first served, one graph's backlog "
        "before another's one key (issue 39)", "dynsnap/runtime/workqueue.py",
        "            self._turns.rotate(-1)\n",
        "            pass\n",
        tests=[U_QUEUE + "test_the_groups_waiting_keys_are_taken_in_turn"]),
    mutation(
        "queue-not-shut-on-stop", "a stopping agent cancels its workers without shutting its queue down first: a "
        "worker whose cancellation went missing goes on reconciling", "dynsnap/runtime/manager.py",
        "        elif on_stop is not None:\n            on_stop()\n",
        "        elif False:\n            pass\n",
        tests=["tests/unit/test_runtime_manager.py::"
               "test_run_until_stopped_ends_a_worker_whose_cancellation_went_missing"]),
    mutation(
        "no-gpu-outside-tree-preflight", "a snapshot of a worker with a GPU process outside its tree is dumped",
        CAPTURE_STEPS,
        "    outside = W.gpu_outside_tree(w)\n",
        "    outside: list[NsPid] = []\n",
        tests=GPU_OUTSIDE),
    mutation(
        "criu-directories-taken-from-an-outliving-criu", "the agent stopping removes the directories CRIU still uses",
        CRIU, "        if not _cancelling():", "        if True:",
        tests=["tests/unit/test_agent_criu.py::test_an_agent_stopped_while_criu_runs_on_leaves_criu_its_directories"]),
    mutation(
        "status-lists-every-process", "a record lists every process of the worker, however many", STATUS,
        "for p in every[:STATUS_PIDS_MAX]]", "for p in every]",
        tests=["tests/unit/test_agent_status.py::test_a_record_of_thousands_of_processes_stays_small_gpu_processes_first"]),
    mutation(
        "snapshot-beyond-the-agents-capabilities", "a worker holding capabilities the agent lacks is snapshotted",
        CAPTURE_STEPS, "    if beyond:\n", "    if False and beyond:\n",
        tests=[U_CAPS + "test_the_snapshot_preflight_refuses_it_for_good_before_any_change", CAPS_NODE]),
    mutation(
        "capabilities-only-permitted", "only the worker's permitted set is compared with the agent's", WORKER,
        "            missing = caps.union(found) & ~own\n", "            missing = found[\"CapPrm\"] & ~own\n",
        tests=[U_CAPS + "test_a_capability_in_any_set_beyond_the_agents_is_named_per_process"]),
    mutation(
        "capabilities-unreadable-taken-as-none", "a worker whose sets cannot be read counts as holding none", WORKER,
        "            missing = ~own & ((1 << len(caps.NAMES)) - 1)\n", "            missing = 0\n",
        tests=[U_CAPS + "test_unreadable_sets_count_as_everything_and_a_gone_process_as_nothing"]),
    mutation(
        "agent-bounding-set-ignored", "the agent's permitted set is taken without its bounding set", WORKER,
        "    own = own_sets.get(\"CapPrm\", 0) & own_sets.get(\"CapBnd\", 0)\n",
        "    own = own_sets.get(\"CapPrm\", 0)\n",
        tests=[U_CAPS + "test_the_agents_bounding_set_limits_what_its_permitted_set_says"]),
    mutation(
        "tree-takes-every-process", "every process of the container counts as the worker's tree", WORKER,
        "        more = {p.pid for p in w.procs if p.ppid in tree} - tree\n",
        "        more = {p.pid for p in w.procs} - tree\n",
        tests=GPU_OUTSIDE[:2]),
    mutation(
        "own-write-hides-newer-store", "the answer to the agent's own write is read over a newer store", NODE,
        "        older(written, obj)\n",
        "        False\n",
        tests=["tests/unit/test_agent_own_writes.py"]),
    mutation(
        "criu-reads-worker-config", "CRIU reads the configuration files at its default paths (an action script "
        "there run by the node's root)", CRIU,
        '    args = ["--no-default-config", "-v4"]\n',
        '    args = ["-v4"]\n',
        tests=["tests/unit/test_agent_criu.py::test_criu_reads_no_configuration_file"]),
    mutation(
        "restore-outside-the-workers-mntns", "a restore leaves the restored tasks in CRIU's own mount namespace "
        "(no --join-ns mnt)", CRIU,
        '            "--manage-cgroups=ignore", "--join-ns", f"mnt:{MNTNS}"]\n',
        '            "--manage-cgroups=ignore"]\n',
        tests=[EXEC_SNAPSHOT]),
    mutation(
        "no-apiserver-reset", "a worker woken after a long sleep keeps the API-server connections frozen in its "
        "image (no reset)", WAKE_STEPS,
        "    if limit and slept is not None and slept > limit:\n",
        "    if False:\n",
        tests=["tests/integration/node/test_agent.py::"
               "test_a_sleep_past_reset_after_resets_the_workers_api_server_connections"]),
    mutation(
        "failed-status-write-forgotten", "a step whose status write failed (the API server away) is not "
        "written once the server is back", NODE,
        "            self._unwritten[ws.key] = status  # the step happened; its record goes out with the next write\n",
        "            pass\n",
        tests=["tests/integration/node/test_apiserver_restart.py::test_the_api_server_restarted_mid_wake"]),
    mutation(
        "request-kept-past-its-wake", "the request that woke a routable sleeper is forgotten only while the spec "
        "keeps the generation the wake began under (the controller's Active written mid-wake keeps it for good)",
        NODE,
        "            self._requests.pop(ws.key, None)\n        if step in S.ACTIVE_STEPS and for_request:\n",
        "            if S.woken_by_request(ws, status):\n                self._requests.pop(ws.key, None)\n"
        "        if step in S.ACTIVE_STEPS and for_request:\n",
        tests=["tests/unit/test_agent_request_wake.py"]),
    mutation(
        "criu-decisive-is-the-first", "a CRIU failure is led and classified by its first error line, one CRIU went "
        "on from, not the one that ended the run", CRIU_LOG,
        "    return next((x for x in reversed(errors) if not _CONSEQUENCE.search(x)), None)\n",
        "    return next((x for x in errors if not _CONSEQUENCE.search(x)), None)\n",
        tests=[CRIU_ERRORS]),
    mutation(
        "cut-off-restore-taken-for-the-worker", "a restore cut off (its marker standing, no CRIU) is finished as if "
        "the remnant at the worker's pid were the worker", PLAN,
        "    if f.restore_cut_off:  # what runs is a remnant of it, never the worker: restore again (the step "
        "clears it)\n",
        "    if False:  # what runs is a remnant of it, never the worker: restore again (the step clears it)\n",
        tests=[PLAN_UNIT]),
    mutation(
        "control-root-unpinned", "the entrypoint's control directory is reached through whatever process holds the "
        "located pid now (a container restarted since)", ENTRYPOINT_CONTROL,
        "            if self.pinned is not None and procfs.start_time(self.pinned[0], self.proc) != self.pinned[1]:\n",
        "            if False:\n",
        tests=["tests/unit/test_agent_pinned.py"]),
    mutation(
        "network-lock-left", "CRIU's network lock left by a cut-off dump is never found", NETLOCK,
        "        if isinstance(name, str) and (name == TABLE_PREFIX or name.startswith(TABLE_PREFIX + \"-\")) \\\n",
        "        if False and isinstance(name, str) and (name == TABLE_PREFIX or "
        "name.startswith(TABLE_PREFIX + \"-\")) \\\n",
        tests=["tests/native/test_netlock.py"]),
    mutation(
        "network-lock-takes-the-pods-tables", "every inet table of the pod's network namespace is taken for CRIU's",
        NETLOCK,
        "        if isinstance(name, str) and (name == TABLE_PREFIX or name.startswith(TABLE_PREFIX + \"-\")) \\\n",
        "        if isinstance(name, str) and (True or name.startswith(TABLE_PREFIX + \"-\")) \\\n",
        tests=["tests/native/test_netlock.py::test_a_left_lock_is_deleted_and_the_pods_own_table_kept"]),
    mutation(
        "finished-restore-taken-for-cut-off", "a restore CRIU finished while no agent watched is taken for one cut off "
        "(the whole tree killed and restored again)", EXECUTOR,
        "            and not restore_completed(source)\n",
        "            and True\n",
        tests=["tests/integration/node/test_agent_restart.py::test_agent_killed_during[wake-restore-snapshot]"]),
)

SUITE = Suite(
    name="agent",
    doc="docs/TESTING.md",
    mutations=MUTATIONS,
    # The rows of tests/integration/node/ run the agent from its image on the real node: every mutant's
    # image set is built from the mutated tree (tests/mutation/images.py).
    build=images.BUILD,
    env=images.ENV,
    default_env={"DYNSNAP_TEST_BRIDGE": "dsnmut1", "DYNSNAP_TEST_CIDR": "10.218.0.0/16",
                 "DYNSNAP_KEEP_LOGS": "{work}/test-logs"},  # a killed mutant's logs stay out of test-logs/
    timeout=1800,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
