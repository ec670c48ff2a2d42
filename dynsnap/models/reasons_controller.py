"""What every Reason the controller reports means and what to do about it (pure data, bottom
layer): policy and decisions, the proof of a wake. Joined with the agent's in dynsnap/models/reasons.py.
"""

from __future__ import annotations

from typing import Final

from dynsnap.models.protocol import Reason
from dynsnap.models.reasondoc import POLICY, VERIFY, ReasonDoc
from dynsnap.models.reasondoc import RESERVED_ACTION as _RESERVED_ACTION

CONTROLLER_REASON_DOCS: Final[dict[Reason, ReasonDoc]] = {
    # -- policy and decisions --------------------------------------------------------------------------
    Reason.POLICY_VALID: ReasonDoc(
        POLICY, "normal", "`PolicyValid=True` (controller)",
        "The component's `dynsnap.io/` annotations parse.",
        "Nothing."),
    Reason.INVALID_POLICY: ReasonDoc(
        POLICY, "refusal", "`PolicyValid=False`; Warning Event on the DGD (controller)",
        "A `dynsnap.io/` annotation of the graph has a bad value (the message names it, its value and why, "
        "e.g. `min-active` 0). Nothing is changed until it is fixed.",
        "Fix the annotation on the DynamoGraphDeployment (values are strings: quote numbers)."),
    Reason.INVALID_OVERRIDE: ReasonDoc(
        POLICY, "refusal", "Warning Event on the pod (controller)",
        "The pod's `dynsnap.io/desired-state` is neither `suspended` nor `active`; it is ignored.",
        "Use `dynsnap suspend|wake POD`, or remove the annotation."),
    Reason.DEPRECATED_OVERRIDE: ReasonDoc(
        POLICY, "refusal", "Warning Event on the pod (controller), once per pod",
        "The pod carries `dynsnap.io/desired-state`, the override of earlier releases, and its WorkerSnapshot "
        "has no `dynsnap.io/override`: the annotation is still obeyed, for this release. The override lives on the "
        "WorkerSnapshot now, which dynsnap owns, so that people who drive dynsnap need no right to patch pods "
        "(which would let them change a pod's image).",
        "Use `dynsnap suspend|wake POD` (it writes the WorkerSnapshot's `dynsnap.io/override`, which wins over the "
        "annotation), and remove the annotation."),
    Reason.MIN_ACTIVE: ReasonDoc(
        POLICY, "refusal", "Warning Event on the pod (controller)",
        "A manual `suspended` was refused: it would leave fewer than `min-active` workers of the component "
        "serving.",
        "Wake another worker first, or lower `dynsnap.io/min-active` (at least 1)."),
    Reason.QUIESCING: ReasonDoc(
        POLICY, "normal", "Event on the pod (controller)",
        "The controller takes the worker out of serving before a capture (serving gate False, then waits "
        "for the endpoint, the frontend and the in-flight requests).",
        "Nothing."),
    Reason.QUIESCED: ReasonDoc(
        POLICY, "normal", "Event (controller)",
        "Reserved: the quiesce's end is said by `CaptureRequested`.",
        _RESERVED_ACTION, reserved=True),
    Reason.CAPTURE_REQUESTED: ReasonDoc(
        POLICY, "normal", "Event on the pod (controller)",
        "The worker is quiesced; the controller set `spec.desiredState: Suspended` and the agent captures.",
        "Nothing."),
    Reason.WAKE_REQUESTED: ReasonDoc(
        POLICY, "normal", "Event on the pod (controller)",
        "Demand (or the manual override) wakes the worker: the controller set `spec.desiredState: Active`.",
        "Nothing; the wake is verified next."),
    Reason.WOKEN_BY_REQUEST: ReasonDoc(
        POLICY, "normal", "Event (agent: the wake done); Event on the pod (controller: the spec follows); "
        "`status.lastWake.trigger: request`",
        "A request reached a worker asleep routable and the agent woke it on its own (wake on request); the "
        "controller then set `desiredState: Active` and verifies the wake with pinned requests as any wake's.",
        "Nothing. A wake on request that fails stops the worker, so the requests it held end with an error "
        "instead of waiting for ever; the controller records the failed wake and applies `on-failed-wake`."),
    Reason.CAPTURE_REFUSED: ReasonDoc(
        POLICY, "refusal",
        "Warning Event on the pod; `status.controller.refusal`; `dynsnap status` shows `capture refused` (controller)",
        "The agent refused the capture the controller asked for with a reason retrying cannot cure "
        "(`SeccompOff`, `PidReservationMissing`, `UnsafeMultiGpu`, `DiskBudgetExceeded`; the note names it). "
        "The worker was put back into serving at once (desiredState Active, verified like a called-off "
        "quiesce) and the controller does not ask it to sleep again, not even for `dynsnap suspend`, until "
        "the pod (its UID), its WorkerSnapshot's spec or the component's `dynsnap.io/` policy changes. "
        "A note beginning `capture called off: the agent does not accept the pod: <Reason>` says the agent "
        "refused the pod itself (`Accepted=False`: `EntrypointUnreadable`, `UnsafeContainerPath`, ...) while "
        "the controller was taking the worker out of serving: it went back at once, verified, and nothing is "
        "remembered (once the agent accepts the pod it is planned as any other).",
        "Fix what the agent's reason names (docs/operations.md has an entry for each), or change the policy "
        "(e.g. `dynsnap.io/tier: suspend` for a refusal of tier snapshot); the next policy change, spec change "
        "or a new pod makes the worker eligible again."),
    Reason.CAPTURE_TIMED_OUT: ReasonDoc(
        POLICY, "failure", "Warning Event on the pod; `status.controller.capture.error` (controller)",
        "The agent did not report the capture it was asked for as finished within `--capture-timeout` (it "
        "kept failing and retrying, or it reports nothing). The capture was called off: desiredState Active, "
        "and the worker returns to serving (a wake, verified, if it had already gone to sleep).",
        "Read the worker's `status.lastError` and the agent's log on its node; check that the node's agent "
        "runs. Raise `--capture-timeout` only for workers whose captures really take that long."),
    Reason.GRAPH_DELETED: ReasonDoc(
        POLICY, "normal", "Event (controller)",
        "Reserved: a deleted graph's pods and WorkerSnapshots go with the garbage collector.",
        _RESERVED_ACTION, reserved=True),
    Reason.POD_REPLACED: ReasonDoc(
        POLICY, "normal", "Event on the pod (controller)",
        "The pod was recreated (new UID): the old WorkerSnapshot is deleted and a new one created; the old "
        "capture is never restored into the new pod.",
        "Nothing."),
    # -- verification ----------------------------------------------------------------------------------
    Reason.VERIFYING: ReasonDoc(
        VERIFY, "normal", "`Verified=Unknown`, `status.controller.verification` (controller)",
        "The worker is awake and the controller is proving the wake: identity, endpoint ready, then "
        "pinned requests.",
        "Nothing."),
    Reason.VERIFIED: ReasonDoc(
        VERIFY, "normal", "`Verified=True`; Event (controller)",
        "Same pod UID, IP, DWM and instance id, endpoint ready, and every pinned request was answered by "
        "this worker.",
        "Nothing."),
    Reason.POD_CHANGED: ReasonDoc(
        VERIFY, "failure", "`Verified=False`; Warning Event (controller)",
        "The pod's UID or IP is not the one recorded before the worker slept.",
        "The pod was recreated or its network changed: the fallback applies (`on-failed-wake`). Look for "
        "who deleted the pod (`kubectl get events`)."),
    Reason.DWM_CHANGED: ReasonDoc(
        VERIFY, "failure", "`Verified=False`; Warning Event (controller)",
        "The worker's DynamoWorkerMetadata is gone, has another UID, or names another instance id: Dynamo's "
        "discovery no longer leads to this worker.",
        "Check the worker's log for re-registration errors (its API-server watches after a long sleep: "
        "`--reset-apiserver-connections-after`). The fallback applies."),
    Reason.ENDPOINT_NOT_READY: ReasonDoc(
        VERIFY, "failure", "`Verified=False`; Warning Event (controller)",
        "The worker's EndpointSlice endpoint did not become ready (with the same `targetRef.uid`) within "
        "`--verify-timeout`.",
        "The pod's readiness probe (the entrypoint's `/health`, i.e. the worker's own) fails: read the "
        "worker's log. The fallback applies."),
    Reason.PINNED_REQUEST_FAILED: ReasonDoc(
        VERIFY, "failure", "`Verified=False`; Warning Event (controller)",
        "Requests pinned to the worker through the frontend were refused or timed out until "
        "`--verify-timeout`.",
        "The worker is up but does not serve: read its log (a restored engine that cannot reach its GPU "
        "or its peers). The fallback applies."),
    Reason.ANSWERED_BY_ANOTHER_WORKER: ReasonDoc(
        VERIFY, "failure", "`Verified=False`; Warning Event (controller)",
        "A request pinned to this worker came back with another worker's id: the frontend's idea of this "
        "instance leads elsewhere.",
        "The frontend's view of discovery is stale or wrong: check its log and the DWMs. The fallback "
        "applies."),
    Reason.FRONTEND_UNAVAILABLE: ReasonDoc(
        VERIFY, "failure", "`Verified=False`; Warning Event (controller)",
        "No frontend of the graph could be reached to send the pinned requests, or it lists no model.",
        "Check the graph's frontend pod and Service; the controller must reach it (network policies). The "
        "fallback applies."),
    Reason.WAKE_FAILED: ReasonDoc(
        VERIFY, "failure", "`Verified=False`; Warning Event on the pod (controller)",
        "A wake did not end: the agent lost the worker (`WorkerLost`: its image gone, say), or the worker was "
        "not Active and verified within `--wake-timeout` of the wake request (its restore kept failing: "
        "`CriuRestoreFailed` ...; the message names the agent's last error). The worker no longer counts as "
        "awake: the controller wakes another worker of the component in its place, and the policy's "
        "`on-failed-wake` applies (`restart`: the pod deleted so it starts cold; `none`: left out of serving).",
        "Read the agent's error in the message and `status.lastWake.error`; with `on-failed-wake: none` "
        "delete the pod yourself once you have looked (a new pod starts cold). Raise `--wake-timeout` only "
        "for workers whose restores really take that long."),
    Reason.COLD_RESTART: ReasonDoc(
        VERIFY, "failure", "Warning Event on the pod; `status.controller.verification.fallback` (controller)",
        "A wake was not verified and `dynsnap.io/on-failed-wake: restart` applies: the pod was deleted (with "
        "a UID precondition) so the operator recreates it and it starts cold.",
        "Nothing for this worker; find why the wake failed from the `Verified=False` reason before it. "
        "`on-failed-wake: none` leaves the pod out of serving for you to look at instead."),
}
