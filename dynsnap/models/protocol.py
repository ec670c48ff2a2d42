"""The one place for API groups, labels, annotations, condition types and reasons,
and the constants shared with native/.

Pure constants (bottom layer). Each section names where its facts come from.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

# --- Dynamo (ai-dynamo 1.6.1; DESIGN.md section 3.4) -------------------------------------------

DYNAMO_GROUP: Final = "nvidia.com"
DGD_VERSION: Final = "v1beta1"
DWM_VERSION: Final = "v1alpha1"

LABEL_DGD_NAME: Final = "nvidia.com/dynamo-graph-deployment-name"
LABEL_COMPONENT_TYPE: Final = "nvidia.com/dynamo-component-type"
LABEL_SUB_COMPONENT_TYPE: Final = "nvidia.com/dynamo-sub-component-type"
LABEL_COMPONENT: Final = "nvidia.com/dynamo-component"
# A Service carrying both labels is one whose EndpointSlices Dynamo's Kubernetes discovery reads.
LABEL_DISCOVERY_BACKEND: Final = "nvidia.com/dynamo-discovery-backend"
LABEL_DISCOVERY_ENABLED: Final = "nvidia.com/dynamo-discovery-enabled"

HEADER_WORKER_INSTANCE_ID: Final = "x-dynamo-worker-instance-id"
HEADER_PREFILL_INSTANCE_ID: Final = "x-dynamo-prefill-instance-id"

DYNAMO_SYSTEM_PORT: Final = 9090
DYNAMO_FRONTEND_PORT: Final = 8000
DYNAMO_WORKER_FIELD_MANAGER: Final = "dynamo-worker"

# --- dynsnap ------------------------------------------------------------------------------------

DYNSNAP_GROUP: Final = "dynsnap.io"
FIELD_MANAGER: Final = "dynsnap"
# Pod readiness gate dynsnap owns: False takes a worker out of serving before any capture.
CONDITION_SERVING: Final = "dynsnap.io/serving"

# Policy annotations (DESIGN.md section 1), on the DGD or on one of its components (component wins);
# parsed and validated by dynsnap/models/policy.py. A bad value is an Event and a condition, and
# changes nothing.
ANNOTATION_PREFIX: Final = "dynsnap.io/"
ANN_ENABLED: Final = "dynsnap.io/enabled"  # "true" opts the component's workers in
ANN_IDLE_AFTER: Final = "dynsnap.io/idle-after"  # duration: idle this long -> may be captured
ANN_TIER: Final = "dynsnap.io/tier"  # suspend | snapshot
ANN_MIN_ACTIVE: Final = "dynsnap.io/min-active"  # workers of the component that stay awake (>= 1)
ANN_VERIFY_REQUESTS: Final = "dynsnap.io/verify-requests"  # pinned requests that prove a wake
ANN_WAKE_AT_INFLIGHT: Final = "dynsnap.io/wake-at-inflight"  # demand per awake worker that wakes another
ANN_ON_FAILED_WAKE: Final = "dynsnap.io/on-failed-wake"  # restart (delete the pod) | none
ANN_ENGINE_SLEEP_LEVEL: Final = "dynsnap.io/engine-sleep-level"  # tier engine: the engine's sleep level (1-3)
# "true": the component's last worker may sleep too (min-active 0), routable: its first request wakes it
ANN_WAKE_ON_REQUEST: Final = "dynsnap.io/wake-on-request"
POLICY_ANNOTATIONS: Final = (ANN_ENABLED, ANN_IDLE_AFTER, ANN_TIER, ANN_MIN_ACTIVE, ANN_VERIFY_REQUESTS,
                             ANN_WAKE_AT_INFLIGHT, ANN_ON_FAILED_WAKE, ANN_ENGINE_SLEEP_LEVEL, ANN_WAKE_ON_REQUEST)
# The manual override, on a worker pod: suspended | active (`dynsnap suspend|wake POD` sets it).
ANN_DESIRED_STATE: Final = "dynsnap.io/desired-state"  # the pod's override of earlier releases (deprecated)
# A person's override of one worker, on its WorkerSnapshot (``Suspended`` or ``Active``), written by
# `dynsnap suspend|wake`: an annotation, not a spec field, so that it is no new spec generation, which the
# agent takes as a new request (a failed step tried again at once).
ANN_OVERRIDE: Final = "dynsnap.io/override"
# On a WorkerSnapshot, set by the controller with each desiredState change: the W3C traceparent of
# the capture or wake it asks for, so the agent's spans join the controller's trace.
ANN_TRACEPARENT: Final = "dynsnap.io/traceparent"

CONTROLLER_COMPONENT: Final = "dynsnap-controller"  # Events' reportingController
CONTROLLER_LEASE: Final = "dynsnap-controller"  # the leader-election Lease (in the controller's namespace)

# --- dynsnap-entrypoint (native/include/dynsnap_protocol.h; docs/ENTRYPOINT.md) ----------------
# Mirrors of the C header's constants; tests/unit/test_protocol_native.py fails when they drift.

# The entrypoint starts the worker tree at pids >= this (ns_last_pid); the agent refuses to
# capture a worker whose pids are below it (a restore could collide with the namespace's own).
PID_FLOOR: Final = 10000

ENTRYPOINT_CONTROL_DIR: Final = "/run/dynsnap"
ENTRYPOINT_CONTROL_FILE: Final = "entrypoint.json"  # written by the entrypoint only
ENTRYPOINT_CONTROL_FORMAT: Final = 1
ENTRYPOINT_REQUEST_FILE: Final = "state-request"  # written by the agent only: "SEQ STATE\n"
ENTRYPOINT_LOG_FILE: Final = "worker.log"
ENTRYPOINT_PROBE_PORT: Final = 8081
# The entrypoint's exit status when the agent sets `active` and no worker is running.
ENTRYPOINT_EXIT_NO_WORKER: Final = 75


class EntrypointState(StrEnum):
    """What the worker is doing, as the entrypoint's control file and probes report it."""

    ACTIVE = "active"  # serving; probes are the worker's own
    SUSPENDING = "suspending"  # the agent is taking it out of service; the tree may exit (CRIU dump)
    SUSPENDED = "suspended"  # processes alive, GPU state checkpointed; their exit is a crash
    SNAPSHOTTED = "snapshotted"  # the tree was dumped and is gone; the container stays up
    RESTORING = "restoring"  # the agent is restoring the tree in place
    # asleep like suspended, but routable (wake on request): /health answers 200, the pod stays Ready
    ROUTABLE = "routable"

# --- WorkerSnapshot (dynsnap.io/v1alpha1; crds/workersnapshots.yaml is generated from
# dynsnap/models/workersnapshot.py by `dynsnap crd`) ----------------------------------------------

WS_VERSION: Final = "v1alpha1"
WS_KIND: Final = "WorkerSnapshot"
WS_PLURAL: Final = "workersnapshots"
WS_SINGULAR: Final = "workersnapshot"
WS_SHORT_NAMES: Final = ("wsnap",)
WS_CATEGORIES: Final = ("dynsnap",)

# Every WorkerSnapshot carries its pod's node here; an agent watches only its own node's.
LABEL_NODE: Final = "dynsnap.io/node"
# The agent's field manager: it owns the status fields it writes, the controller owns the rest.
AGENT_FIELD_MANAGER: Final = "dynsnap-agent"
AGENT_COMPONENT: Final = "dynsnap-agent"  # Events' reportingController
# `dynsnap suspend|wake` writes the override annotation on a pod under this manager, so the pod's
# managedFields say a person asked for it (not the controller, whose manager is FIELD_MANAGER).
CLI_FIELD_MANAGER: Final = "dynsnap-cli"

# The worker container Dynamo's operator creates (its main container is named "main").
DEFAULT_CONTAINER: Final = "main"


class Tier(StrEnum):
    """How deep a worker sleeps (DESIGN.md section 2)."""

    SUSPEND = "suspend"  # CUDA checkpoint of every GPU process; processes stay in host RAM
    SNAPSHOT = "snapshot"  # suspend, then CRIU dumps the worker tree to node disk; the pod stays
    # The engine's own sleep routes on the worker's system port (vLLM's control/sleep and wake_up,
    # TRT-LLM's release/resume_memory_occupation): weights to host memory, the KV pool dropped, by
    # the engine, which knows what it allocated but never wrote.
    ENGINE = "engine"
    AUTO = "auto"  # engine where the worker's engine has the routes, suspend where not (the agent picks)


# The tiers a capture really runs: auto is resolved to one of them by the agent, per capture.
CAPTURE_TIERS: Final = (Tier.SUSPEND, Tier.SNAPSHOT, Tier.ENGINE)


class DesiredState(StrEnum):
    ACTIVE = "Active"
    SUSPENDED = "Suspended"


class ObservedState(StrEnum):
    """What the agent last saw the worker doing (status.state)."""

    ACTIVE = "Active"  # running and on the GPU
    CAPTURING = "Capturing"  # a capture is under way (one step at a time)
    SUSPENDED = "Suspended"  # asleep: GPU memory freed (tier suspend: processes alive; snapshot: on disk)
    WAKING = "Waking"  # a wake is under way
    LOST = "Lost"  # the worker cannot be brought back in place; the pod must start it cold
    UNKNOWN = "Unknown"  # not (yet) found on this node, or refused (see the Accepted condition)


class ConditionType(StrEnum):
    ACCEPTED = "Accepted"  # the spec names a pod that exists here, with this UID, opted in, under the entrypoint
    PROGRESSING = "Progressing"  # a capture or wake is under way
    SUSPENDED = "Suspended"  # True while the worker sleeps
    DEGRADED = "Degraded"  # the last capture or wake failed; reason says why
    VERIFIED = "Verified"  # the last wake was proven by pinned requests (written by the controller)
    POLICY = "PolicyValid"  # the component's dynsnap.io/ annotations parse (written by the controller)


# Conditions and the status.controller record are the controller's (field manager "dynsnap"); the
# agent never writes them (it leaves them out of its server-side apply).
CONTROLLER_CONDITIONS: Final = (ConditionType.VERIFIED.value, ConditionType.POLICY.value)


class Reason(StrEnum):
    """Every reason a WorkerSnapshot condition, Event or error record can carry.

    docs/operations.md explains each (what happened, what to do); keep the two in step.
    """

    # Accepted
    ACCEPTED = "Accepted"
    POD_NOT_FOUND = "PodNotFound"
    POD_UID_MISMATCH = "PodUIDMismatch"
    WRONG_NODE = "WrongNode"
    NOT_OPTED_IN = "NotOptedIn"
    NOT_UNDER_ENTRYPOINT = "NotUnderEntrypoint"
    WORKER_NOT_RUNNING = "WorkerNotRunning"
    ENTRYPOINT_UNREADABLE = "EntrypointUnreadable"
    UNSAFE_CONTAINER_PATH = "UnsafeContainerPath"
    FOREIGN_NAMESPACE = "ForeignNamespace"
    SHARED_PROCESS_NAMESPACE = "SharedProcessNamespace"
    # Progressing
    CAPTURING = "Capturing"
    WAKING = "Waking"
    ROLLING_BACK = "RollingBack"
    IDLE = "Idle"
    # Suspended
    SUSPENDED = "Suspended"
    SNAPSHOTTED = "Snapshotted"
    ROUTABLE = "Routable"
    ACTIVE = "Active"
    # Degraded: refusals before any state change
    WORKER_SERVING = "WorkerServing"
    UNSAFE_MULTI_GPU = "UnsafeMultiGpu"
    PID_RESERVATION_MISSING = "PidReservationMissing"
    SECCOMP_OFF = "SeccompOff"
    IO_URING_IN_USE = "IoUringInUse"
    GPU_PROCESS_OUTSIDE_TREE = "GpuProcessOutsideTree"
    CAPABILITIES_BEYOND_AGENT = "CapabilitiesBeyondAgent"
    PROCESS_TOO_LARGE = "ProcessTooLarge"
    METRICS_OUT_OF_BOUNDS = "MetricsOutOfBounds"
    DISK_BUDGET_EXCEEDED = "DiskBudgetExceeded"
    ENGINE_ROUTES_MISSING = "EngineRoutesMissing"
    PIDS_IN_USE = "PidsInUse"
    NOT_ENOUGH_GPU_MEMORY = "NotEnoughGpuMemory"
    IMAGE_FORMAT_MISMATCH = "ImageFormatMismatch"
    IMAGE_MISSING = "ImageMissing"
    # Degraded: failures mid-way (the worker was rolled back or is restorable)
    ENTRYPOINT_UNRESPONSIVE = "EntrypointUnresponsive"
    CHECKPOINT_FAILED = "CheckpointFailed"
    RESTORE_FAILED = "RestoreFailed"
    HELPER_TIMEOUT = "HelperTimeout"
    DUMP_FAILED = "DumpFailed"
    ENGINE_ROUTE_FAILED = "EngineRouteFailed"
    ENGINE_ROUTE_TIMEOUT = "EngineRouteTimeout"
    DISK_FULL = "DiskFull"
    INCOMPLETE_CAPTURE = "IncompleteCapture"
    CRIU_RESTORE_FAILED = "CriuRestoreFailed"
    RESTORED_OUTSIDE_CONTAINER = "RestoredOutsideContainer"
    INTERRUPTED = "Interrupted"
    WORKER_LOST = "WorkerLost"
    POD_GONE = "PodGone"
    RECOVERED = "Recovered"
    # Controller: policy and decisions
    POLICY_VALID = "PolicyValid"
    INVALID_POLICY = "InvalidPolicy"
    INVALID_OVERRIDE = "InvalidOverride"
    DEPRECATED_OVERRIDE = "DeprecatedOverride"
    MIN_ACTIVE = "MinActive"
    QUIESCING = "Quiescing"
    QUIESCED = "Quiesced"
    CAPTURE_REQUESTED = "CaptureRequested"
    WAKE_REQUESTED = "WakeRequested"
    WOKEN_BY_REQUEST = "WokenByRequest"
    CAPTURE_REFUSED = "CaptureRefused"  # the agent refused the capture for a PERMANENT_REFUSALS reason
    CAPTURE_TIMED_OUT = "CaptureTimedOut"  # the capture asked for was not reported finished in time
    GRAPH_DELETED = "GraphDeleted"
    POD_REPLACED = "PodReplaced"
    # Verified (controller): a wake is proven, or why it is not
    VERIFYING = "Verifying"
    VERIFIED = "Verified"
    POD_CHANGED = "PodChanged"
    DWM_CHANGED = "DwmChanged"
    ENDPOINT_NOT_READY = "EndpointNotReady"
    PINNED_REQUEST_FAILED = "PinnedRequestFailed"
    ANSWERED_BY_ANOTHER_WORKER = "AnsweredByAnotherWorker"
    FRONTEND_UNAVAILABLE = "FrontendUnavailable"
    WAKE_FAILED = "WakeFailed"
    COLD_RESTART = "ColdRestart"


# Refusals that will not go away while the pod, its spec and the policy stay as they are: the
# entrypoint's io_uring filter is off, its pid range is not reserved (or the worker already holds
# pids below it), the worker's NCCL settings make a checkpoint impossible to undo, the node's image
# budget is spent, its engine has no sleep routes (tier engine). Retrying them only keeps a worker
# out of serving; the controller puts it back into serving at once and asks again only after the
# spec, the pod or the policy changed.
PERMANENT_REFUSALS: Final = frozenset({Reason.SECCOMP_OFF, Reason.PID_RESERVATION_MISSING, Reason.UNSAFE_MULTI_GPU,
                                       Reason.DISK_BUDGET_EXCEEDED, Reason.ENGINE_ROUTES_MISSING,
                                       Reason.GPU_PROCESS_OUTSIDE_TREE, Reason.CAPABILITIES_BEYOND_AGENT})


# Capture images on a node: <images root>/<namespace>_<pod>_<pod uid>/<capture id>/ (final) and
# .../.staging-<capture id>/ while being written; MANIFEST_FILE is written last, then the rename.
IMAGE_FORMAT: Final = 1
# The formats this agent restores from: the one it writes and every older one it still reads. A new
# format keeps the older ones here (and whatever reading their manifests needs), so an agent upgraded
# while workers sleep wakes them from the captures its predecessor wrote instead of sending each to a
# cold restart (tests/integration/node/test_agent_restart.py). An agent rolled back to a release older than
# a capture cannot read it: docs/install.md says to wake every worker before such a rollback.
IMAGE_FORMATS_READ: Final = frozenset({1})
MANIFEST_FILE: Final = "manifest.json"
STAGING_PREFIX: Final = ".staging-"
