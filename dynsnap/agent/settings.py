"""The node agent's settings: every default with the reason it is that value.

Layer: ``dynsnap.agent``. ``dynsnap agent`` builds one from its flags (each field is a flag,
``--images-root`` for ``images_root``) and from ``DYNSNAP_AGENT_<FIELD>`` environment variables
(flags win). The configuration reference in the docs is generated from these descriptions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

ENV_PREFIX = "DYNSNAP_AGENT_"


class AgentSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_name: Annotated[str, Field(description=(
        "The node this agent serves; it watches only WorkerSnapshots labelled dynsnap.io/node=<this> and "
        "the pods bound here. From the downward API (spec.nodeName) in the DaemonSet."))] = ""
    images_root: Annotated[Path, Field(description=(
        "Node directory for capture images (mode 0700: images hold the worker's environment, its secrets). "
        "Node-local disk: a restore reads it at disk speed."))] = Path("/var/lib/dynsnap/images")
    images_budget_bytes: Annotated[int, Field(ge=0, description=(
        "Most bytes the images of this node may use; a capture whose estimate would pass it is refused before it "
        "starts. 200 GiB: two 80 GiB-GPU workers fully captured, with room."))] = 200 * 2**30
    state_dir: Annotated[Path, Field(description=(
        "dynsnap-cuda's record of what each checkpoint freed (DYNSNAP_CUDA_STATE_DIR), for the free-memory "
        "check before a restore, and the agent's registry of the helpers it runs (helpers/, mode 0700), by "
        "which a restarted agent finds a CRIU or dynsnap-cuda an earlier one left running. A node path that "
        "outlives the agent's pod; tmpfs is right: both only matter while the node is up."
    ))] = Path("/run/dynsnap-cuda")
    cuda_helper: Annotated[str, Field(description=(
        "The dynsnap-cuda binary (also CRIU's cuda-checkpoint)."))] = "dynsnap-cuda"
    criu: Annotated[str, Field(description=(
        "The CRIU binary, 4.2.1 or later with dynsnap's patches (docs/CRIU_PATCHES.md: 0003's --tree-mntns is "
        "needed; 0001 and 0002 make a snapshot wake faster), as the agent finds it (a bare name: on the agent's "
        "PATH). dynsnap-nsexec starts it in the worker's pid, network, IPC, UTS and cgroup namespaces but in a "
        "mount namespace of its own, a copy of the agent's: the binary, its loader, libraries and plugins are the "
        "agent's files (a wrapper script of the agent's works too), never the worker's."))] = "criu"
    nsexec: Annotated[str, Field(description=(
        "The dynsnap-nsexec binary (native/nsexec), which starts CRIU and ss in a worker's namespaces and never "
        "in its mount namespace, after checking they are the ones its runtime made (docs/threat-model.md)."
    ))] = "dynsnap-nsexec"
    criu_libdir: Annotated[str, Field(description=(
        "CRIU's plugin directory (--libdir), a directory of the agent's. Empty: no plugin (an empty directory)."
    ))] = ""
    criu_cuda_plugin: Annotated[bool, Field(description=(
        "Let CRIU's CUDA plugin run (its cuda-checkpoint, i.e. dynsnap-cuda, on CRIU's PATH: the directory of "
        "--cuda-helper, the agent's; the plugin itself from --criu-libdir). Off: CRIU's PATH is empty, and the "
        "agent saves every GPU process (every lock before any checkpoint, one helper for all) before the dump "
        "and resumes them after the restore, which the plugin, one pid per exec, cannot do; it would find them "
        "checkpointed and skip them anyway."))] = False
    criu_read_threads: Annotated[int, Field(ge=0, le=16, description=(
        "Threads CRIU's restorer reads a snapshot's pages with (DYNSNAP_CRIU_READ_THREADS, hack/patches/criu/0002; "
        "a stock CRIU ignores it). 0: CRIU's default, one per CPU the agent may run on, at most 16. 1 reads as "
        "stock CRIU does. On the H200 node a 16 GiB worker's image came back in 0.82 s with 16 threads against "
        "6.19 s with one (docs/CRIU_PATCHES.md)."))] = 0
    criu_timeout: Annotated[float, Field(gt=0, description=(
        "Bound on one CRIU dump or restore, seconds. A 16 GiB worker dumped in 23.8 s and restored in 17.7 s on "
        "the H200 (docs/BENCHMARKS.md); ten times that before CRIU is called wedged and killed."))] = 300.0
    helper_timeout: Annotated[float, Field(gt=0, description=(
        "Bound on one dynsnap-cuda call, seconds. A 32 GiB checkpoint took 14.4 s on the H200."))] = 300.0
    lock_timeout_ms: Annotated[int, Field(gt=0, description=(
        "How long a save waits for each GPU process's lock (in-flight GPU work drains first). A rank stuck in a "
        "collective must fail the capture within this, not hang it: 10 s, dynsnap-cuda's own default."))] = 10_000
    entrypoint_timeout: Annotated[float, Field(gt=0, description=(
        "Bound on the entrypoint acknowledging a state request; it looks every 100 ms."))] = 10.0
    reset_apiserver_connections_after: Annotated[float, Field(ge=0, description=(
        "After a snapshot wake from a sleep longer than this (seconds), the worker's connections to the API "
        "server are reset, so its watches reconnect at once. While it slept the server went on sending (watch "
        "bookmarks about once a minute, events, the end of a watch at the client's timeoutSeconds: 290 s for "
        "Dynamo 1.6.1) into connections frozen in the images, then gave them up; restored as they were they are "
        "half-open, and the worker's discovery view would stay frozen until its client's read timeout (295 s). "
        "Other connections (the frontend's) are kept: resetting them fails a request. 0: never."))] = 30.0
    tcp_established: Annotated[bool, Field(description=(
        "Dump and restore live TCP connections (the worker's request plane and its API-server watch). In place, "
        "the pod IP is unchanged, so they come back as they were."))] = True
    network_lock: Annotated[str, Field(description=(
        "CRIU's network lock while dumping: nftables needs no iptables binary on the node."))] = "nftables"
    engine_route_timeout: Annotated[float, Field(gt=0, description=(
        "Tier engine: bound on one call of an engine's sleep or wake route, seconds. vLLM's sleep drains what is "
        "in flight (its own bound is 30 s) and copies the weights to host memory at pinned-memory speed (tens of "
        "GB/s); two minutes before the call is a named failure (EngineRouteTimeout)."))] = 120.0
    metrics_port: Annotated[int, Field(gt=0, lt=65536, description=(
        "The worker's Dynamo system port, where the agent scrapes in-flight and request counters."))] = 9090
    routable_poll_interval: Annotated[float, Field(gt=0, le=5, description=(
        "Seconds between looks at the in-flight gauge of each worker asleep routable (wake on request): a request "
        "that reaches one is seen within this and wakes it. 50 ms: a wake on request is asked for within a "
        "tenth of a second of the request (issue 20), at 20 small GETs a second per routable sleeper (one per "
        "component at most)."))] = 0.05
    scrape_interval: Annotated[float, Field(gt=0, description=(
        "Seconds between scrapes of an active worker's metrics. Idle is measured in minutes; 10 s is fine-grained "
        "enough and costs one local HTTP request per worker."))] = 10.0
    activity_granularity: Annotated[float, Field(ge=0, description=(
        "A busy worker's lastActivity is rewritten at most this often (seconds): a status write per request would "
        "load the API server for nothing."))] = 30.0
    failure_backoff: Annotated[float, Field(gt=0, description=(
        "First wait after a failed capture or wake before trying again, seconds; doubles per consecutive failure."
    ))] = 10.0
    failure_backoff_max: Annotated[float, Field(gt=0, description=(
        "Longest wait between attempts, seconds."))] = 600.0
    workers: Annotated[int, Field(ge=1, description=(
        "Reconciles run at once. Captures of different workers overlap on a node with several GPUs; the same "
        "worker is never handled twice at once."))] = 4
    gc_interval: Annotated[float, Field(gt=0, description=(
        "Seconds between deletions of the images of pods gone from this node (images hold the worker's "
        "secrets). A minute keeps the cost of the scan negligible; tests shorten it."))] = 60.0
    health_port: Annotated[int, Field(ge=0, lt=65536, description=(
        "Port of /healthz, /readyz and /metrics (0: none)."))] = 8090
    otlp_endpoint: Annotated[str, Field(description=(
        "OpenTelemetry collector's OTLP/HTTP endpoint for traces: its base URL (http://otel-collector:4318; "
        "/v1/traces is appended) or the full traces URL, as the controller's. Each finished capture and wake "
        "is exported as one span per step, in the trace the controller named on the WorkerSnapshot. Empty: not "
        "exported."))] = ""
    trace_file: Annotated[Path | None, Field(description=(
        "Also append every span to this file as one JSON object per line (tests and dynsnap demo read it; no "
        "collector needed). Empty: none."))] = None
    cuda_env: Annotated[dict[str, str], Field(description=(
        "Extra environment for dynsnap-cuda (the local environment points DYNSNAP_LIBCUDA at its stub)."))] = {}

    @field_validator("trace_file", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if v == "" else v  # DYNSNAP_AGENT_TRACE_FILE= (empty) means none, not "."

    @classmethod
    def from_env(cls, overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None
                 ) -> AgentSettings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and name != "cuda_env":
                values[name] = raw
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.model_validate(values)


def reference_table() -> str:
    """The agent's settings as a Markdown table (README's configuration reference is this text;
    tests/unit/test_agent_settings.py fails when they differ)."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, f in AgentSettings.model_fields.items():
        default = f.default
        shown = "(none)" if default in ("", {}, None) else str(default)
        flag = "--" + name.replace("_", "-")
        rows.append(f"| `{flag}` | `{ENV_PREFIX}{name.upper()}` | `{shown}` | {f.description} |")
    return "\n".join(rows) + "\n"
