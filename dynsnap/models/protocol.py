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
