"""Mutation check of the controller's guards (issue 9; docs/TESTING.md, "Mutation checks"): each guard
broken on purpose as an exact replacement in dynsnap/controller/ (and the agent's half of the status
contract in dynsnap/agent/status.py), then the tests that must go red. Not collected by pytest (no
test_ prefix). From the repository root, as root, with the environment of `./run env`:

    source <(./run env | sed 's/^/export /')
    $DYNSNAP_VENV/bin/python tests/mutation/mutate_controller.py [--list] [--all-failures] [INDEX|ID ...]

The controller and the agents run as their own processes in the integration tests here (`python -m
dynsnap controller|agent`), which import the mutated module themselves: for those rows the mutant
stays on disk for the whole pytest run (no early restore), so do not run this beside other work in
the same tree (or run it in a copy of the tree: `git archive HEAD | tar -x -C DIR`, then this script
from DIR; `python -m dynsnap` imports the copy's package from its working directory). The rows whose
tests are in tests/integration/node/ run the controller from its image on the real node, so every
mutant (and the baseline) first builds the image set of the mutated tree (tests/mutation/images.py),
which the tests get as $DYNSNAP_IMAGES. Rows whose tests are unit tests only restore the file as soon
as pytest has collected. The cluster gets its own
bridge and /16 (dsnmut2, 10.219.0.0/16) unless DYNSNAP_TEST_BRIDGE / DYNSNAP_TEST_CIDR say otherwise.
tests/mutation/runner.py says how a run goes and what each outcome means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mutation import images
from tests.mutation.runner import Suite, main, mutation

PLAN = "dynsnap/controller/plan.py"
RECONCILER = "dynsnap/controller/reconciler.py"
FRONTEND = "dynsnap/controller/frontend.py"
AGENT_STATUS = "dynsnap/agent/status.py"
PHASES = "dynsnap/controller/phases.py"
VERIFY = "dynsnap/controller/verify.py"
QUIESCE_PY = "dynsnap/controller/quiesce.py"
ROUTING = "dynsnap/controller/routing.py"
WAKE = "dynsnap/controller/wake.py"
WRITES = "dynsnap/controller/writes.py"
FLEET = "dynsnap/controller/fleet.py"
STORE = "dynsnap/k8s/store.py"
MAIN = "dynsnap/controller/main.py"

PLAN_UNIT = "tests/unit/test_controller_plan.py::"
REQUEUE_UNIT = "tests/unit/test_controller_requeue.py::test_a_demand_change_requeues_only_the_workers_it_can_move"
WAKE_UNIT = "tests/unit/test_controller_wake_request.py::test_a_stale_reconcile_asks_again_as_the_same_wake"
VIEW_UNIT = "tests/unit/test_controller_view.py"
TURN_UNIT = "tests/unit/test_controller_min_active_turn.py"
FLEET_UNIT = "tests/unit/test_controller_fleet.py::test_phase"
STORE_UNIT = "tests/unit/test_k8s_store.py::test_an_earlier_version_does_not_replace_a_later_one"
FRONTEND_UNIT = "tests/unit/test_frontend_parse.py::"
PINNED_UNIT = FRONTEND_UNIT + "test_a_pinned_answer_is_this_workers_only_when_it_names_every_pinned_id"
FALSE = ("tests/integration/node/test_controller_false_wake.py::"
         "test_a_wake_that_does_not_serve_is_not_verified_while_the_peer_serves")
FROZEN = FALSE + "[frozen-none]"
REPLACED = FALSE + "[frozen-replaced-restart]"
DWM = ("tests/integration/node/test_controller_false_wake.py::"
       "test_a_woken_worker_whose_dwm_changed_is_not_verified_nor_served_while_the_peer_serves")
DWM_ID = DWM + "[dwm-instance-id]"
DWM_UID = DWM + "[dwm-recreated]"
DWM_TRANSPORT = DWM + "[dwm-transport]"
QUIESCE = "tests/integration/node/test_controller_quiesce.py::"
SLICES_LAG = QUIESCE + "test_no_capture_while_the_controller_still_sees_the_endpoint_ready"
FRONTEND_LAG = QUIESCE + "test_no_capture_while_the_frontend_still_routes_to_the_worker"
DISAGG = ("tests/integration/node/test_controller_disagg.py::"
          "test_prefill_and_decode_each_sleep_to_min_active_and_wake_verified_with_their_headers[suspend]")
FRONTEND_DOWN = QUIESCE + "test_no_capture_while_the_frontend_cannot_say_it_stopped_routing"
PHASES_UNIT = "tests/unit/test_controller_phases.py::"
CAPTURE_DEADLINE_UNIT = PHASES_UNIT + "test_a_capture_ends_once_by_what_the_agent_reports_or_its_deadline"
WAKE_DEADLINE_UNIT = PHASES_UNIT + "test_a_wake_fails_when_lost_or_not_active_and_verified_by_its_deadline"
REFUSAL_HOLDS_UNIT = PHASES_UNIT + "test_a_refusal_holds_until_the_pod_the_spec_or_the_policy_changes"
ROUTING_UNIT = "tests/unit/test_controller_routing.py::"
WOR_LAST_UNIT = PLAN_UNIT + "test_with_wake_on_request_only_the_last_worker_sleeps_routable"
WOR_HELD_UNIT = PLAN_UNIT + "test_a_routable_sleeper_is_its_agents_to_wake_and_counts_as_waking"
UNACCEPTED_UNIT = "tests/unit/test_controller_unaccepted.py::"
NODE_TRUST = ("tests/integration/node/test_agent_trust.py::"
              "test_an_unusable_entrypoint_report_in_a_real_container_is_refused_and_nothing_is_touched[malformed]")
WOR_TWO = "tests/integration/node/test_wake_on_request.py::test_two_requests_at_once_wake_one_worker_not_two"
REFUSED_FOR_GOOD = ("tests/integration/node/test_controller_refusals.py::"
                    "test_a_capture_refused_for_good_puts_the_worker_back_into_serving_and_is_not_asked_again")
WAKE_FAILS = ("tests/integration/node/test_controller_wake_deadline.py::"
              "test_a_wake_that_never_reaches_active_fails_and_another_worker_is_woken_in_its_place")

IDENTITY = ("    problem = identity_problem(s, rec.identity, F.dwm_of(ctx.stores.dwms, s.pod))\n"
            "    if problem is not None:\n"
            "        return await fail(ctx, s, policy, *problem)\n")
GATE_TRUE = ("    if F.pod_condition(s.pod, P.CONDITION_SERVING) != \"True\":\n"
             "        await ctx.gate(s.pod, True)\n"
             "        return POLL\n"
             "    late = left_of(v.started, ctx.settings.verify_timeout, now) < 0\n")

MUTATIONS = (
    # -- verification: what counts as proof ----------------------------------------------------------
    mutation(
        "any-200-is-mine", "any answered pinned request counts as this worker's answer", FRONTEND,
        "        return (self.ok and (worker_id is None or self.worker_id == worker_id)\n"
        "                and (prefill_id is None or self.prefill_id == prefill_id))\n",
        "        return self.ok\n",
        tests=[PINNED_UNIT], modules=["dynsnap.controller.frontend"]),
    mutation(
        "prefill-id-unchecked", "the prefill id an answer names is not checked (a prefill worker's own; the one "
        "a decode worker was pinned with)", FRONTEND,
        "                and (prefill_id is None or self.prefill_id == prefill_id))\n",
        "                and True)\n",
        tests=[PINNED_UNIT], modules=["dynsnap.controller.frontend"]),
    mutation(
        "decode-pinned-alone", "a decode worker is pinned by its own id alone (no prefill header)", ROUTING,
        "        return int(iid), prefill, [P.HEADER_WORKER_INSTANCE_ID, P.HEADER_PREFILL_INSTANCE_ID] if "
        "prefill \\\n            is not None else [P.HEADER_WORKER_INSTANCE_ID]\n",
        "        return int(iid), None, [P.HEADER_WORKER_INSTANCE_ID]\n",
        tests=[DISAGG]),
    mutation(
        "no-identity-check", "a woken worker's pod and DWM are not compared with what they were", VERIFY,
        "    problem = identity_problem(s, rec.identity, F.dwm_of(ctx.stores.dwms, s.pod))\n",
        "    problem = None\n",
        tests=[DWM_ID, DWM_UID, DWM_TRANSPORT]),
    mutation(
        "no-transport-check", "a DWM whose generate endpoint leads to another worker passes the identity check",
        VERIFY,
        "    if ident.transport is not None and transport != ident.transport:\n",
        "    if False:\n",
        tests=[DWM_TRANSPORT]),
    mutation(
        "gate-before-identity", "a woken worker is put back into serving before its identity is checked",
        VERIFY, IDENTITY + GATE_TRUE, GATE_TRUE + IDENTITY,
        tests=[DWM_ID, DWM_UID]),
    mutation(
        "refused-round-accepted", "fewer than N answers accepted: a round that ended in a refused pinned "
        "request counts as proof", VERIFY,
        "    if answered < policy.verify_requests:\n",
        "    if answered < policy.verify_requests and not refused:\n",
        tests=[FROZEN]),
    mutation(
        "fallback-delete-without-uid", "the cold-restart fallback deletes the pod by name, without the UID "
        "precondition", WRITES,
        "            await self.kube.delete(R.PODS, pod[\"metadata\"][\"name\"], "
        "namespace=pod[\"metadata\"][\"namespace\"],\n"
        "                                   uid=str(pod[\"metadata\"].get(\"uid\", \"\")))\n",
        "            await self.kube.delete(R.PODS, pod[\"metadata\"][\"name\"], "
        "namespace=pod[\"metadata\"][\"namespace\"])\n",
        tests=[REPLACED]),
    # -- quiesce: each condition waited for itself ---------------------------------------------------
    mutation(
        "quiesce-skips-endpoint-wait", "the quiesce does not wait for the endpoint to be not ready",
        QUIESCE_PY,
        "    if s.endpoint_ready:\n        return POLL\n",
        "    if False:\n        return POLL\n",
        tests=[SLICES_LAG]),
    mutation(
        "quiesce-skips-routing-probe", "the quiesce does not ask the frontend whether it still routes there",
        QUIESCE_PY,
        "    if await routing(ctx, s) != RT.Routed.NO:\n",
        "    if False:\n",
        tests=[FRONTEND_LAG]),
    mutation(
        "routing-fails-open", "any answer but 200 counts as the frontend no longer routing there (a 404, 5xx, "
        "another 400 or a timeout)", ROUTING,
        "    return Routed.NO if refused_instance(a) else Routed.UNKNOWN\n",
        "    return Routed.NO\n",
        tests=[ROUTING_UNIT + "test_only_the_frontends_explicit_refusal_counts_as_not_routed", FRONTEND_DOWN]),
    mutation(
        "routing-any-400", "any 400 counts as the frontend's refusal of the instance, whatever it says", ROUTING,
        "    return isinstance(body, dict) and all(body.get(k) == v for k, v in REFUSAL_BODY.items())\n",
        "    return True\n",
        tests=[ROUTING_UNIT + "test_only_the_frontends_explicit_refusal_counts_as_not_routed"]),
    mutation(
        "routing-nothing-to-ask-not-routed", "with no ready frontend or no model to ask, the worker counts as "
        "no longer routed", QUIESCE_PY,
        "    if ident is None or url is None:\n        return RT.Routed.UNKNOWN\n",
        "    if ident is None or url is None:\n        return RT.Routed.NO\n",
        tests=[ROUTING_UNIT + "test_no_frontend_to_ask_is_no_refusal"], modules=["dynsnap.controller.quiesce"]),
    # -- the phases' deadlines and terminal outcomes (issue 18) ----------------------------------------
    mutation(
        "capture-no-deadline", "a capture the agent never reports finished is waited for (almost) for ever",
        PHASES,
        "    return _wait_or_fail(cap.started, timeout, now, Reason.CAPTURE_TIMED_OUT,\n",
        "    return _wait_or_fail(cap.started, timeout * 1000, now, Reason.CAPTURE_TIMED_OUT,\n",
        tests=[CAPTURE_DEADLINE_UNIT], modules=["dynsnap.controller.phases"]),
    mutation(
        "wake-no-deadline", "a wake that never reaches Active and verified is waited for (almost) for ever",
        PHASES,
        "    return _wait_or_fail(w.started, timeout, now, Reason.WAKE_FAILED,\n",
        "    return _wait_or_fail(w.started, timeout * 1000, now, Reason.WAKE_FAILED,\n",
        tests=[WAKE_DEADLINE_UNIT, WAKE_FAILS + "[corrupted-restart]"]),
    mutation(
        "wake-lost-waits", "a wake whose worker the agent gave up (Lost) waits for the deadline instead of "
        "failing at once", PHASES,
        "    if ws.status.state == ObservedState.LOST or (err is not None and err.reason == Reason.WORKER_LOST):\n",
        "    if False:\n",
        tests=[WAKE_DEADLINE_UNIT, WAKE_FAILS + "[deleted-none]"]),
    mutation(
        "wake-failure-not-acted-on", "a wake past its deadline is not made a failed wake (no verdict, no "
        "fallback)", WAKE,
        "        return await V.fail(ctx, s, policy, out.reason, out.message)\n",
        "        return NEXT\n",
        tests=[WAKE_FAILS + "[corrupted-restart]"]),
    mutation(
        "failed-wake-counts-awake", "a worker whose wake failed still counts as awake (nothing is woken in its "
        "place)", FLEET,
        "    if verification_failed(ws):\n        return Phase.BROKEN\n",
        "",
        # with on-failed-wake none the failed pod stays (restart deletes it, which makes room anyway)
        tests=[WAKE_FAILS + "[deleted-none]"]),
    mutation(
        "refusal-retried", "a permanent refusal is waited out like any failure (the worker out of serving until "
        "the capture deadline)", PHASES,
        "    if err is not None and err.reason in PERMANENT_REFUSALS:\n",
        "    if False:\n",
        tests=[CAPTURE_DEADLINE_UNIT, REFUSED_FOR_GOOD + "[SeccompOff]"]),
    mutation(
        "refusal-not-remembered", "the planner is not told of a refusal on record: the worker is quiesced again "
        "while idle", RECONCILER,
        "            refused = PH.refusal_note(ref)\n",
        "            refused = None\n",
        tests=[VIEW_UNIT, REFUSED_FOR_GOOD + "[SeccompOff]"]),
    mutation(
        "refusal-outlives-the-policy", "a refusal still stands after the component's policy changed", PHASES,
        "            and ref.policy_hash == policy_hash(policy))\n",
        "            )\n",
        # unit only: in the integration test the policy change is the tier, which moves the spec's
        # generation too (the controller writes the tier into the spec), so the refusal ends either way
        tests=[REFUSAL_HOLDS_UNIT], modules=["dynsnap.controller.phases"]),
    # -- the planner ---------------------------------------------------------------------------------
    mutation(
        "plan-below-min-active", "the planner lets the serving workers drop below what is needed "
        "(`others >= need` -> `others + 1 >= need`)", PLAN,
        "        elif w.phase == Phase.SERVING and others >= need:\n",
        "        elif w.phase == Phase.SERVING and others + 1 >= need:\n",
        tests=[PLAN_UNIT + "test_idle_serving_workers_sleep_down_to_min_active_never_below"],
        modules=["dynsnap.controller.plan"]),
    mutation(
        "plan-waking-counts-as-ready", "a worker still waking or verifying counts as serving", PLAN,
        "    ready = sum(1 for w in awake if w.phase == Phase.SERVING and _settled(w, now))\n",
        "    ready = len(awake)\n",
        tests=[PLAN_UNIT + "test_a_worker_still_waking_or_verifying_does_not_count_as_serving"],
        modules=["dynsnap.controller.plan"]),
    mutation(
        "plan-suspend-not-refused", "a manual suspend is granted even when it breaks min-active", PLAN,
        "            if w.phase == Phase.SERVING and others >= policy.min_active:\n",
        "            if w.phase == Phase.SERVING:\n",
        tests=[PLAN_UNIT + "test_manual_suspend_is_refused_with_min_active_when_it_would_break_it"],
        modules=["dynsnap.controller.plan"]),
    mutation(
        "plan-unsettled-counts", "a worker back in serving moments ago (kubelet may still take it out of its "
        "EndpointSlice) counts at once as the floor that lets another sleep", PLAN,
        "    return w.serving_since is None or (now - w.serving_since).total_seconds() >= SETTLE_S\n",
        "    return True\n",
        tests=[PLAN_UNIT + "test_a_worker_just_back_in_serving_is_no_floor_for_another_to_sleep"],
        modules=["dynsnap.controller.plan"]),
    mutation(
        "plan-unknown-demand-sleeps", "unknown demand (frontend not scraped) lets idle workers sleep", PLAN,
        "        if demand is None:\n            out[w.name] = Decision(Want.AWAKE, \"demand unknown",
        "        if False:\n            out[w.name] = Decision(Want.AWAKE, \"demand unknown",
        tests=[PLAN_UNIT + "test_unknown_demand_sleeps_nothing_and_wakes_nothing_beyond_min_active"],
        modules=["dynsnap.controller.plan"]),
    mutation(
        "plan-wakes-before-calling-off", "a deficit wakes a sleeper without first calling off a quiesce", PLAN,
        "        elif deficit > 0 and w.override != suspended_override:\n"
        "            out[w.name] = Decision(Want.AWAKE, f\"{len(awake)} awake of {need} needed: capture called",
        "        elif False:\n"
        "            out[w.name] = Decision(Want.AWAKE, f\"{len(awake)} awake of {need} needed: capture called",
        tests=[PLAN_UNIT + "test_a_deficit_calls_off_a_quiesce_first_then_wakes_the_most_recently_captured"],
        modules=["dynsnap.controller.plan"]),
    mutation(
        "plan-wakes-least-recent", "a deficit wakes the least recently captured sleeper first", PLAN,
        "                                   -(w.last_capture.timestamp() if w.last_capture else 0.0), w.name))\n",
        "                                   (w.last_capture.timestamp() if w.last_capture else 0.0), w.name))\n",
        tests=[PLAN_UNIT + "test_a_deficit_calls_off_a_quiesce_first_then_wakes_the_most_recently_captured"],
        modules=["dynsnap.controller.plan"]),
    mutation(
        "plan-idle-across-sleep", "a worker back in serving is idle from before its sleep (the agent's idleSince "
        "alone): woken for load, it is quiesced again at once", PLAN,
        "    since = w.idle_since if w.serving_since is None else max(w.idle_since, w.serving_since)\n",
        "    since = w.idle_since\n",
        tests=[PLAN_UNIT + "test_a_worker_back_in_serving_is_idle_only_from_its_return"],
        modules=["dynsnap.controller.plan"]),
    mutation(
        "view-no-return", "the planner is not told when the worker last returned to serving", RECONCILER,
        "                          serving_since=ver.finished if ver is not None and ver.ok else None,\n",
        "                          serving_since=None,\n",
        tests=[VIEW_UNIT],
        modules=["dynsnap.controller.reconciler"]),
    mutation(
        "view-failed-return", "a failed verification counts as a return to serving", RECONCILER,
        "                          serving_since=ver.finished if ver is not None and ver.ok else None,\n",
        "                          serving_since=ver.finished if ver is not None else None,\n",
        tests=[VIEW_UNIT],
        modules=["dynsnap.controller.reconciler"]),
    # -- one wake, one record: read your own write -----------------------------------------------------
    mutation(
        "wake-asked-anew", "a reconcile that still sees Suspended opens a second wake with a new trace",
        WAKE,
        "    if asked is not None and asked.trace_context:\n",
        "    if False:\n",
        tests=[WAKE_UNIT], modules=["dynsnap.controller.wake"]),
    mutation(
        "store-goes-back", "the store takes an earlier version over a later one (a late watch event undoes "
        "our own write)", STORE,
        "        if old is not None and older(obj, old):\n            return old\n",
        "",
        tests=[WAKE_UNIT, STORE_UNIT], modules=["dynsnap.k8s.store"]),
    mutation(
        "demand-rise-skips-sleepers", "a rise in demand requeues the serving workers and not the sleeping ones",
        MAIN,
        "        return Phase.SERVING if after.total > before.total else Phase.ASLEEP\n",
        "        return Phase.ASLEEP if after.total > before.total else Phase.SERVING\n",
        tests=[REQUEUE_UNIT], modules=["dynsnap.controller.main"]),
    # -- the status contract between agent and controller --------------------------------------------
    mutation(
        "agent-applies-controller-conditions", "the agent's status apply keeps the controller's conditions "
        "(Verified, PolicyValid)", AGENT_STATUS,
        "    wire[\"conditions\"] = [c for c in wire.get(\"conditions\", []) if c[\"type\"] not in "
        "P.CONTROLLER_CONDITIONS]\n",
        "    wire[\"conditions\"] = list(wire.get(\"conditions\", []))\n",
        tests=[DISAGG]),
    # -- issue 20: wake on request --------------------------------------------------------------------
    mutation(
        "every-sleeper-routable", "under wake on request every sleeper sleeps routable, not only the last",
        PLAN,
        "    return policy.wake_on_request and not quiescing and [x.name for x in awake] == [w.name]\n",
        "    return policy.wake_on_request\n",
        tests=[WOR_LAST_UNIT], modules=["dynsnap.controller.plan"]),
    mutation(
        "routable-sleeper-not-counted", "a routable sleeper holding the demand is not counted as waking: the "
        "controller wakes it (and others) itself", PLAN,
        "    held = [w for w in asleep if w.routable and w.override is None]\n",
        "    held: list[WorkerView] = []\n",
        tests=[WOR_HELD_UNIT], modules=["dynsnap.controller.plan"]),
    mutation(
        "request-wake-unverified", "the agent's wake for a request is not taken up by the controller (never "
        "verified)", WAKE,
        "    if ws.spec.desired_state != DesiredState.SUSPENDED or w is None or w.trigger != \"request\" or \\\n",
        "    if True or w is None or w.trigger != \"request\" or \\\n",
        tests=[WOR_TWO]),
    mutation(
        "no-component-turn", "serving workers of one component plan and leave serving side by side: plans made "
        "while the first quiesce's record is on its way put every worker out of serving", RECONCILER,
        "        async with turn:\n            return await self._step(s, policy)\n",
        "        return await self._step(s, policy)\n",
        tests=[TURN_UNIT], modules=["dynsnap.controller.reconciler"]),
    mutation(
        "open-wake-verified", "a worker showing Active while the agent's wake is still open counts as back: "
        "verified before the agent has finished (or failed) its wake", FLEET,
        "            (st.last_wake is not None and st.last_wake.finished is None):\n",
        "            False:\n",
        tests=[FLEET_UNIT], modules=["dynsnap.controller.fleet"]),
    # -- a worker the agent does not accept, taken out of serving -------------------------------------
    mutation(
        "unaccepted-left-out", "a worker the agent refuses (Accepted=False) while the controller takes it out "
        "of serving is left out of serving until the capture's deadline", RECONCILER,
        "            return await W.unaccepted(self.ctx, s, policy)\n",
        "            return None\n",
        tests=[NODE_TRUST]),
    mutation(
        "unaccepted-captured-called-back", "a worker the agent captured before it refused the pod is asked "
        "Active by the controller as if it had never left", WAKE,
        "    return lc is None or q is None or lc.started < q.started or "
        "(lc.finished is not None and lc.ok is False)\n",
        "    return True\n",
        tests=[UNACCEPTED_UNIT + "test_the_agents_capture_record_since_the_quiesce_decides"],
        modules=["dynsnap.controller.wake"]),
    mutation(
        "demand-queue-added", "the frontend's queued requests added to its in-flight ones, though Dynamo counts "
        "a request before its first token in both (one request a demand of 2)", PLAN,
        "        return max(self.inflight, self.queued)",
        "        return self.inflight + self.queued",
        tests=[PLAN_UNIT + "test_demand_sets_how_many_are_needed",
               FRONTEND_UNIT + "test_demand_is_in_flight_over_every_model_its_queue_among_them"],
        modules=["dynsnap.controller.plan"]),
)

SUITE = Suite(
    name="controller",
    doc="docs/TESTING.md",
    mutations=MUTATIONS,
    # The rows of tests/integration/node/ run the controller from its image on the real node: every
    # mutant's image set is built from the mutated tree (tests/mutation/images.py).
    build=images.BUILD,
    env=images.ENV,
    default_env={"DYNSNAP_TEST_BRIDGE": "dsnmut2", "DYNSNAP_TEST_CIDR": "10.219.0.0/16",
                 "DYNSNAP_KEEP_LOGS": "{work}/test-logs"},  # a killed mutant's logs stay out of test-logs/
    timeout=1800,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
