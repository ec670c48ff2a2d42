"""The controller's settings: every default with the reason it is that value.

Layer: ``dynsnap.controller``. ``dynsnap controller`` builds one from its flags (``--lease-namespace``
for ``lease_namespace``) and ``DYNSNAP_CONTROLLER_<FIELD>`` environment variables (flags win). The
configuration reference is generated from these descriptions (:func:`reference_table`).
"""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

ENV_PREFIX = "DYNSNAP_CONTROLLER_"


class ControllerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: Annotated[str, Field(description=(
        "Watch only this namespace (empty: every namespace; the ClusterRole then applies cluster-wide)."))] = ""
    lease_namespace: Annotated[str, Field(description=(
        "Namespace of the leader-election Lease (the controller's own; POD_NAMESPACE in the Deployment)."))] = (
        "dynsnap-system")
    lease_name: Annotated[str, Field(description="Name of the leader-election Lease.")] = "dynsnap-controller"
    identity: Annotated[str, Field(description=(
        "This replica's holder identity in the Lease (empty: hostname + pid; POD_NAME in the Deployment)."))] = ""
    leader_elect: Annotated[bool, Field(description=(
        "Elect one active replica through the Lease. Off only for a single replica you run by hand."))] = True
    lease_duration: Annotated[int, Field(ge=2, description=(
        "Seconds a leader's Lease lasts without renewal before another replica may take it (client-go's 15)."))] = 15
    renew_deadline: Annotated[float, Field(gt=0, description=(
        "Seconds the leader keeps trying to renew before it stops acting, well before the Lease can expire for the "
        "others (client-go's 10)."))] = 10.0
    retry_period: Annotated[float, Field(gt=0, description=(
        "Seconds between acquire attempts and between renewals (client-go's 2)."))] = 2.0
    workers: Annotated[int, Field(ge=1, le=64, description=(
        "Concurrent reconciles (one per worker pod at a time). Verification waits on HTTP, so a few keep "
        "one slow wake from holding up the rest."))] = 8
    workers_per_graph: Annotated[int, Field(ge=1, le=64, description=(
        "The most reconciles of one graph's workers at a time, of `workers`: a graph whose frontend answers "
        "slowly (each exchange bounded, a reconcile by reconcile-timeout) holds at most this many, and the "
        "graphs' waiting workers are taken in turn, so the others' wakes and deadlines go on."))] = 4
    scrape_interval: Annotated[float, Field(gt=0, description=(
        "Seconds between scrapes of each opted-in graph's frontend metrics (demand). 2 s: a burst of load "
        "is seen within one scrape of the mocker's time to first token; cheap (one GET per graph)."))] = 2.0
    quiesce_timeout: Annotated[float, Field(gt=0, description=(
        "Seconds a quiesce may take (serving gate False -> endpoint not ready, frontend no longer routing, "
        "nothing in flight) before it is called off and the worker put back into serving."))] = 120.0
    capture_timeout: Annotated[float, Field(gt=0, description=(
        "Seconds from asking for a capture (desiredState Suspended) until the agent must report it finished; "
        "past it the capture is called off (desiredState Active, Warning Event CaptureTimedOut) and the worker "
        "returns to serving. 900: beyond the agent's own bounds on a capture's slow steps (a dynsnap-cuda save "
        "and a CRIU dump, 300 s each by default), so a wedged step is killed and reported by the agent first; "
        "this catches an agent that reports nothing, or retries for ever."))] = 900.0
    wake_timeout: Annotated[float, Field(gt=0, description=(
        "Seconds from asking for a wake until the worker must be Active and verified; past it the wake is "
        "failed (Verified=False WakeFailed, the policy's on-failed-wake applied) and the planner wakes another "
        "worker in its place. 600: the agent's own bounds on a restore (CRIU and dynsnap-cuda, 300 s each) "
        "plus the verification, far above a 16 GiB snapshot wake (17.7 s on an H200, docs/BENCHMARKS.md), "
        "while a worker whose restore keeps failing does not hold the capacity it was woken for for longer."
        ))] = 600.0
    verify_timeout: Annotated[float, Field(gt=0, description=(
        "Seconds a verification may take from its start (the worker back in Active: identity, gate, endpoint "
        "ready, pinned answers); past it the return is failed and the fallback applied. A wake as a whole is "
        "bounded by the wake timeout too."))] = 120.0
    verify_request_timeout: Annotated[float, Field(gt=0, description=(
        "Seconds one pinned verification request may take (a frozen worker answers 504 after 5 s)."))] = 30.0
    reconcile_timeout: Annotated[float, Field(gt=0, description=(
        "Seconds one reconcile of a worker may take before it is cancelled and tried again after a backoff: a "
        "graph whose frontend answers slowly holds a reconcile worker at most this long, and a phase's deadline "
        "is looked at again by the next reconcile. Above one pinned verification request's bound."))] = 90.0
    health_port: Annotated[int, Field(ge=0, lt=65536, description=(
        "Port of /healthz, /readyz and /metrics (0: an ephemeral port, logged)."))] = 8080
    health_host: Annotated[str, Field(description="Address the health and metrics port binds.")] = "0.0.0.0"
    otlp_endpoint: Annotated[str, Field(description=(
        "OpenTelemetry collector's OTLP/HTTP endpoint for traces: its base URL (http://otel-collector:4318; "
        "/v1/traces is appended) or the full traces URL (http://otel-collector:4318/v1/traces), as the agent's. "
        "Empty: none."))] = ""
    trace_file: Annotated[str, Field(description=(
        "Also write spans as JSON lines to this file (the demo and the tests read it; empty: none)."))] = ""

    @classmethod
    def from_env(cls, overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None
                 ) -> ControllerSettings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = raw
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.model_validate(values)


def reference_table() -> str:
    """The controller's settings as a Markdown table (the README's reference is this text)."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, f in ControllerSettings.model_fields.items():
        shown = "(none)" if f.default == "" else str(f.default)
        flag = "--" + name.replace("_", "-")
        rows.append(f"| `{flag}` | `{ENV_PREFIX}{name.upper()}` | `{shown}` | {f.description} |")
    return "\n".join(rows) + "\n"
