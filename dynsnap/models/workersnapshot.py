"""The WorkerSnapshot API (``dynsnap.io/v1alpha1``) as pydantic models: the one source of truth
for the CRD's schema (``dynsnap/models/crd.py`` generates ``crds/workersnapshots.yaml`` from
these, and a test fails when the committed file drifts).

One WorkerSnapshot per opted-in worker pod, named after the pod, owned by it, labelled with its
node. The spec says which pod (name *and* UID: a recreated pod is a different worker) and how it
should be; the status says what the node agent saw and did: conditions, the observed state, the
last capture and the last wake with their per-step durations, bytes and pids, the image on disk,
the last error, and the worker's idle facts. Pure types (bottom layer).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from dynsnap.models.protocol import ConditionType, DesiredState, ObservedState, Reason, Tier

# Kubernetes names: a pod name is a DNS-1123 subdomain, a container name a DNS-1123 label. The
# patterns are what keeps a path-like or cross-namespace name ("../x", "ns/pod") out at the API
# server, before any agent reads it.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
UID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
REASON_PATTERN = r"^[A-Z][A-Za-z0-9]*$"  # CamelCase, as the API conventions ask
# The processes an operation record lists (its GPU processes first); the rest are counted in pidsOmitted,
# so a worker with thousands of processes keeps its object small (the agent keeps the whole list on disk).
STATUS_PIDS_MAX = 64


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_enum_values=False)

    def wire(self) -> dict[str, Any]:
        """The JSON the API server gets: camelCase, no nulls."""
        out: dict[str, Any] = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return out


class WorkerSnapshotSpec(_Model):
    pod_name: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN,
                                   description="The worker pod, in this WorkerSnapshot's namespace.")]
    pod_uid: Annotated[str, Field(alias="podUID", pattern=UID_PATTERN, description=(
        "The pod's metadata.uid. A pod recreated under the same name has another UID and is another "
        "worker: the agent refuses to act on a pod whose UID differs."),
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": "self == oldSelf", "message": "podUID is immutable: make a new WorkerSnapshot"}]})]
    container: Annotated[str, Field(max_length=63, pattern=DNS1123_LABEL, description=(
        "The worker container (Dynamo's operator names it main)."))] = "main"
    tier: Annotated[Tier, Field(description=(
        "suspend: CUDA checkpoint only; snapshot: also CRIU to node disk; engine: the engine's own sleep "
        "routes; auto: engine where the worker's engine has them, else suspend (picked by the agent)."))]
    desired_state: Annotated[DesiredState, Field(description="Active or Suspended.")] = DesiredState.ACTIVE
    engine_sleep_level: Annotated[int, Field(ge=1, le=3, description=(
        "Tier engine: the level the engine sleeps at (vLLM: 1 weights to host memory and the KV cache "
        "dropped; 2 and 3 drop more). Engines whose route takes no level ignore it."))] = 1
    routable: Annotated[bool, Field(description=(
        "With desiredState Suspended, tier suspend: sleep routable (wake on request): the worker stays in "
        "serving (its pod Ready, its endpoint and registration kept), GPU memory freed, and the first request "
        "that reaches it wakes it. The controller sets it for the last worker of a component with "
        "dynsnap.io/wake-on-request."))] = False


class Condition(_Model):
    type: Annotated[str, Field(max_length=316)]
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[str, Field(max_length=1024, pattern=REASON_PATTERN)]
    message: Annotated[str, Field(max_length=32768)] = ""
    last_transition_time: datetime
    observed_generation: Annotated[int, Field(ge=0)] | None = None


class StepTiming(_Model):
    name: str
    seconds: Annotated[float, Field(ge=0)]


class PidRecord(_Model):
    host: Annotated[int, Field(ge=1)]
    ns: Annotated[int, Field(ge=1)]
    gpu: bool = False


class GpuMemory(_Model):
    """Free memory of one GPU before and after a capture or a wake (NVML, read by dynsnap-cuda)."""

    uuid: str
    free_before: int | None = None
    free_after: int | None = None
    total: int | None = None


class ErrorRecord(_Model):
    reason: Annotated[Reason, Field(description="CamelCase reason; docs/operations.md says what to do.")]
    message: Annotated[str, Field(max_length=4096)]
    step: str | None = None
    at: datetime
    generation: Annotated[int | None, Field(description="The spec generation the failure happened under.")] = None


class ImageRef(_Model):
    path: str
    format: Annotated[int, Field(ge=1)]
    bytes: Annotated[int, Field(ge=0)]


class OperationRecord(_Model):
    """One capture or one wake: when, how (per step), what it moved, and how it ended."""

    id: Annotated[str, Field(max_length=64)]
    tier: Tier
    started: datetime
    finished: datetime | None = None
    ok: bool | None = None
    steps: list[StepTiming] = []
    pids: Annotated[list[PidRecord], Field(max_length=STATUS_PIDS_MAX, description=(
        f"The worker's processes, GPU processes first, at most {STATUS_PIDS_MAX}; pidsOmitted counts the rest."
    ))] = []
    pids_omitted: Annotated[int, Field(ge=0, description="Processes of the worker beyond those pids lists.")] \
        | None = None
    gpus: list[GpuMemory] = []
    image_bytes: Annotated[int, Field(ge=0)] | None = None
    image: ImageRef | None = None
    error: ErrorRecord | None = None
    trace_context: Annotated[str | None, Field(description="W3C traceparent of the trace this joins.")] = None
    trigger: Annotated[Literal["request"] | None, Field(description=(
        "A wake's: request when the agent woke a worker asleep routable because a request reached it "
        "(wake on request), on its own; absent when the spec asked for it."))] = None
    generation: Annotated[int, Field(ge=0)] | None = None  # the spec's generation the operation began under


class IdleFacts(_Model):
    """What the agent scraped from the worker's own metrics (written only when it changes)."""

    inflight: Annotated[int, Field(ge=0)] | None = None
    requests_total: Annotated[float, Field(ge=0)] | None = None
    last_activity: datetime | None = None
    idle_since: datetime | None = None


class WorkerIdentity(_Model):
    """Who the worker was when the controller took it out of serving; a wake is verified against it
    (DESIGN.md section 4: same pod UID, pod IP, DWM UID and instance id; and the DWM still leading to
    it: the same generate transport)."""

    pod_uid: Annotated[str, Field(alias="podUID")]
    pod_ip: Annotated[str, Field(alias="podIP")]
    dwm_uid: Annotated[str, Field(alias="dwmUID")]
    instance_id: Annotated[int, Field(ge=0, description="Decimal Dynamo instance id of the generate endpoint.")]
    transport: Annotated[str | None, Field(max_length=2048, description=(
        "Where the DWM's generate endpoint leads (its transport): the frontend names the instance it "
        "routed to, not who served, so a DWM that leads elsewhere is not this worker."))] = None
    recorded: datetime


class Verification(_Model):
    """The proof (or disproof) of one wake: which wake, how many pinned requests, who answered."""

    wake_id: Annotated[str, Field(max_length=64, description="status.lastWake.id this verifies.")]
    ok: bool | None = None
    reason: Reason
    message: Annotated[str, Field(max_length=4096)] = ""
    started: datetime
    finished: datetime | None = None
    requests: Annotated[int, Field(ge=0)] = 0
    answered: Annotated[int, Field(ge=0, description="Pinned requests answered by this worker's id.")] = 0
    headers: list[str] = []
    worker_id: Annotated[int | None, Field(ge=0, description="The instance id the requests were pinned to.")] = None
    prefill_id: Annotated[int | None, Field(ge=0)] = None
    steps: list[StepTiming] = []
    fallback: Annotated[str | None, Field(description="What was done about a failed wake (ColdRestart).")] = None


class Refusal(_Model):
    """A capture the agent refused for a reason retrying cannot cure (``protocol.PERMANENT_REFUSALS``),
    and what the refusal depends on: while the pod (its UID), the WorkerSnapshot's spec (its generation
    once Active was asked back) and the component's policy (its hash) stay as recorded, the controller
    does not ask this worker to sleep again."""

    reason: Reason
    message: Annotated[str, Field(max_length=4096)] = ""
    at: datetime
    capture_id: Annotated[str, Field(max_length=64, description="status.controller.capture.id that was refused.")]
    pod_uid: Annotated[str, Field(alias="podUID")]
    generation: Annotated[int | None, Field(ge=0, description=(
        "metadata.generation once desiredState Active was asked back: a later spec change asks again."))] = None
    policy_hash: Annotated[str, Field(max_length=64, description=(
        "Hash of the component's parsed dynsnap.io/ policy: a policy change asks again."))]


class ControllerRecord(_Model):
    """The controller's part of the status (field manager ``dynsnap``; the agent never writes it)."""

    identity: WorkerIdentity | None = None
    quiesce: OperationRecord | None = None
    capture: Annotated[OperationRecord | None, Field(description=(
        "The capture the controller asked for (desiredState Suspended): when it asked, and how it ended: ok once "
        "the agent reported it captured; ok false with the error when it was refused, called off or past "
        "its deadline."))] = None
    refusal: Annotated[Refusal | None, Field(description=(
        "The last capture the agent refused for good, and what that depends on (docs/CONTROLLER.md)."))] = None
    wake: Annotated[OperationRecord | None, Field(description=(
        "The last wake the controller asked for: when, and the trace it and the agent's wake steps join."))] = None
    verification: Verification | None = None
    traced: Annotated[list[str], Field(max_length=8, description=(
        "Operations (quiesce or wake ids) whose controller spans were emitted, newest last: each once."))] = []
    decision: Annotated[str | None, Field(max_length=1024,
                                          description="The planner's last word on this worker.")] = None
    decided: datetime | None = None


class WorkerSnapshotStatus(_Model):
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    state: ObservedState | None = None
    conditions: Annotated[list[Condition], Field(json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})] = []
    last_capture: OperationRecord | None = None
    last_wake: OperationRecord | None = None
    image: ImageRef | None = None
    last_error: ErrorRecord | None = None
    consecutive_failures: Annotated[int, Field(ge=0)] | None = None
    idle: IdleFacts | None = None
    controller: ControllerRecord | None = None


class ObjectMeta(_Model):
    """The metadata fields dynsnap reads; everything else the server keeps is ignored."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class WorkerSnapshot(_Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    api_version: str = "dynsnap.io/v1alpha1"
    kind: str = "WorkerSnapshot"
    metadata: ObjectMeta
    spec: WorkerSnapshotSpec
    status: WorkerSnapshotStatus = WorkerSnapshotStatus()

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"

    def condition(self, ctype: ConditionType) -> Condition | None:
        return next((c for c in self.status.conditions if c.type == ctype.value), None)


def set_condition(conditions: list[Condition], ctype: ConditionType, status: bool | None, reason: Reason, message: str,
                  *, generation: int | None, now: datetime | None = None) -> list[Condition]:
    """``conditions`` with ``ctype`` set; ``lastTransitionTime`` moves only when the status flips."""
    value: Literal["True", "False", "Unknown"] = "Unknown" if status is None else ("True" if status else "False")
    now = now or utcnow()
    out = []
    found = False
    for c in conditions:
        if c.type == ctype.value:
            found = True
            ltt = c.last_transition_time if c.status == value else now
            out.append(Condition(type=ctype.value, status=value, reason=reason.value, message=message[:32768],
                                 last_transition_time=ltt, observed_generation=generation))
        else:
            out.append(c)
    if not found:
        out.append(Condition(type=ctype.value, status=value, reason=reason.value, message=message[:32768],
                             last_transition_time=now, observed_generation=generation))
    return out
