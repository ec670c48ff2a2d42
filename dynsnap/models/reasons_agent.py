"""What every Reason the node agent reports means and what to do about it (pure data, bottom layer):
admission, progress and sleep, refusals, failures mid-way. Joined with the controller's in
dynsnap/models/reasons.py.
"""

from __future__ import annotations

from typing import Final

from dynsnap.models.protocol import Reason
from dynsnap.models.reasondoc import ACCEPTED, FAILED, PROGRESS, REFUSED, ReasonDoc
from dynsnap.models.reasondoc import RESERVED_ACTION as _RESERVED_ACTION

AGENT_REASON_DOCS: Final[dict[Reason, ReasonDoc]] = {
    # -- Accepted -------------------------------------------------------------------------------------
    Reason.ACCEPTED: ReasonDoc(
        ACCEPTED, "normal", "`Accepted=True`",
        "The spec names a pod that exists on this node with this UID, carries the `dynsnap.io/serving` "
        "readiness gate and runs under dynsnap-entrypoint: the agent acts on it.",
        "Nothing to do."),
    Reason.POD_NOT_FOUND: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False` (or Unknown while the agent's informer catches up)",
        "The pod the WorkerSnapshot names does not exist (deleted, or not yet seen by the agent).",
        "Usually transient: the WorkerSnapshot is owned by the pod and the garbage collector deletes it "
        "with the pod. If it stays, check that the agent of the pod's node runs and can list pods."),
    Reason.WORKER_NOT_RUNNING: ReasonDoc(
        ACCEPTED, "normal", "`Accepted=Unknown`, `Suspended=Unknown`, `state: Unknown` (agent)",
        "The pod is on this node but none of its processes runs: its container is starting, or restarting "
        "(after `WorkerLost`, say). The agent cannot tell whether the worker sleeps, and says so.",
        "Usually transient: the agent looks again every 5 s. If it stays, the pod's container does not start "
        "(`kubectl describe pod`)."),
    Reason.POD_UID_MISMATCH: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False`",
        "A pod of that name exists with another UID: it was recreated. A new pod is a new worker, and a "
        "capture of the old one is never restored into it.",
        "Nothing: the controller deletes the stale WorkerSnapshot (Event `PodReplaced`) and creates one for "
        "the new pod."),
    Reason.WRONG_NODE: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False`",
        "The WorkerSnapshot's `dynsnap.io/node` label names this agent's node, but the pod runs on another.",
        "The controller sets the label from the pod's node when it creates the WorkerSnapshot; another value "
        "was written by hand. Delete the WorkerSnapshot: the controller creates it again with the right node."),
    Reason.NOT_OPTED_IN: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False`",
        "The pod has no `dynsnap.io/serving` readiness gate, so nothing could take it out of serving "
        "before a capture.",
        "Add `readinessGates: [{conditionType: dynsnap.io/serving}]` to the component's "
        "`podTemplate.spec` (examples/dgd/)."),
    Reason.NOT_UNDER_ENTRYPOINT: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False`",
        "The pod's processes are on this node but not under dynsnap-entrypoint (no control file found "
        "through `/proc/<pid>/root`).",
        "Run the worker under the entrypoint: the init container that copies it in and the main "
        "container's `command: [/dynsnap/bin/dynsnap-entrypoint, ..., --]` (examples/dgd/)."),
    Reason.ENTRYPOINT_UNREADABLE: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False` (agent); `Degraded=True`, `status.lastError` when it turns "
        "unreadable mid-way",
        "The entrypoint's control file (`entrypoint.json`) exists but is no file the agent will use: larger "
        "than 64 KiB, not a regular file, not JSON, of another `format`, or a field of the wrong type or out of "
        "its bounds (the message names the field). The agent reads it from inside the worker's container, "
        "where the worker can rewrite it; nothing was done to the worker.",
        "Only dynsnap-entrypoint writes that file: something in the worker's container overwrote it. Find what "
        "(the worker runs as root in its container?) and restart the pod; the entrypoint writes the file anew "
        "at start and on every state change. The agent looks at a refused worker again every 10 s: once the "
        "file is right again the worker is accepted, with nothing else to change."),
    Reason.UNSAFE_CONTAINER_PATH: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False` (agent); `Degraded=True`, `status.lastError` when met mid-way",
        "A path the agent would open inside the worker's container is refused: a symlink at one of its "
        "components, a `..` component, not absolute, or too long. The agent resolves every path in a "
        "container from the container's own root and follows no symlink there (a symlink would otherwise "
        "resolve against the node's root: an absolute one in the control directory would have the privileged "
        "agent read or write node files). The message names the path and the component.",
        "Start the entrypoint with a plain `--control-dir` (default `/run/dynsnap`, an emptyDir): an absolute "
        "path without `..` whose every component is a real directory. If the path is right, something in the "
        "container planted the symlink: find what."),
    Reason.FOREIGN_NAMESPACE: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False` (agent); `Degraded=True`, `status.lastError` when met at a step",
        "The worker container's PID 1 is not in the namespaces its runtime made: its user namespace is not the "
        "node's, or its mount, pid, network, IPC, UTS or cgroup namespace is owned by another user namespace. A "
        "PID 1 can move itself into a user namespace of its own (where seccomp is Unconfined and unprivileged "
        "user namespaces are allowed) and then owns whatever namespaces it makes; the agent, root on the node, "
        "enters a worker's namespaces to run CRIU, so it enters only those. Checked when the agent locates the "
        "worker and again by dynsnap-nsexec right before anything runs there; nothing was done to the worker. A "
        "pod with `hostUsers: false` is refused the same way (not supported yet).",
        "Run the worker's entrypoint as the container's PID 1 as the runtime started it: nothing in the image may "
        "`unshare` or `setns` it. For `hostUsers: false`, leave the component out of dynsnap."),
    Reason.SHARED_PROCESS_NAMESPACE: ReasonDoc(
        ACCEPTED, "refusal", "`Accepted=False`; the worker serves, uncaptured",
        "The pod sets `shareProcessNamespace: true`: the pause container is PID 1 of the pod's pid namespace "
        "and every container's processes share it. dynsnap-entrypoint must be PID 1 of its own pid namespace "
        "(it reserves the pid range a restore needs, and a restored tree is given back to it), so dynsnap does "
        "not capture such a pod. The controller lets it serve (its gate True) and never asks it to sleep.",
        "Remove `shareProcessNamespace: true` from the component's pod template, or leave the component out of "
        "dynsnap (`dynsnap.io/enabled: \"false\"` on it)."),
    # -- Progressing and Suspended ---------------------------------------------------------------------
    Reason.CAPTURING: ReasonDoc(
        PROGRESS, "normal", "`Progressing=True`; Event (agent)",
        "A capture is under way; `status.lastCapture.steps` grows by one step per reconcile.",
        "Nothing. `dynsnap status` shows the step it is on."),
    Reason.WAKING: ReasonDoc(
        PROGRESS, "normal", "`Progressing=True`; Event (agent)",
        "A wake is under way; `status.lastWake.steps` grows by one step per reconcile.",
        "Nothing. The controller verifies the wake once the worker is Active."),
    Reason.ROLLING_BACK: ReasonDoc(
        PROGRESS, "normal", "`Progressing=True` (agent)",
        "A capture failed or was called off and the agent is bringing the worker back to serving "
        "(GPU rollback, CRIU restore of what was dumped, entrypoint back to active).",
        "Nothing; `status.lastError` says what failed. It ends in `Active` or, if the worker cannot come "
        "back in place, `WorkerLost`."),
    Reason.IDLE: ReasonDoc(
        PROGRESS, "normal", "`Progressing=False` (agent)",
        "No capture or wake is under way.",
        "Nothing."),
    Reason.SUSPENDED: ReasonDoc(
        PROGRESS, "normal", "`Suspended=True`; Event (agent)",
        "The worker sleeps at tier suspend: its GPU memory is freed, its processes stay in host RAM.",
        "Nothing. It wakes on demand, or with `dynsnap wake POD`."),
    Reason.SNAPSHOTTED: ReasonDoc(
        PROGRESS, "normal", "`Suspended=True` (agent)",
        "The worker sleeps at tier snapshot: CRIU dumped its process tree to the node's image directory; "
        "the pod and its PID 1 stay.",
        "Nothing. It wakes on demand, or with `dynsnap wake POD`."),
    Reason.ROUTABLE: ReasonDoc(
        PROGRESS, "normal", "`Suspended=True` (agent); `dynsnap status` shows `routable` (wake on request)",
        "The worker sleeps routable: tier suspend, its GPU memory freed, but still in serving (its pod Ready, its "
        "endpoint ready, its DWM kept, the model listed). It is the last worker of a component with "
        "`dynsnap.io/wake-on-request`; a request that reaches it waits in the worker and wakes it within about "
        "`--routable-poll-interval` (the agent watches its in-flight gauge).",
        "Nothing: its first request wakes it (that request is the slow one), then the controller verifies the wake."),
    Reason.ACTIVE: ReasonDoc(
        PROGRESS, "normal", "`Suspended=False`; Event (agent); Event (controller: a capture called off)",
        "The worker runs and holds its GPU memory. From the controller: the capture it had started was "
        "called off (demand came back during the quiesce) and the worker serves again.",
        "Nothing."),
    # -- refusals --------------------------------------------------------------------------------------
    Reason.WORKER_SERVING: ReasonDoc(
        REFUSED, "refusal",
        "`Degraded=True`, `status.lastError` (agent); Warning Event (controller: the quiesce timed out)",
        "The agent refused a capture while the pod's `dynsnap.io/serving` condition was not False or the "
        "worker had requests in flight; or the controller's quiesce (gate False, endpoint not ready, "
        "frontend no longer routing, nothing in flight) did not finish within `--quiesce-timeout`, and the "
        "capture was called off.",
        "Check that the controller can write pod status (its RBAC, field manager `dynsnap`), that the "
        "EndpointSlice controller marks the endpoint not ready, and that the frontend stops routing to the "
        "worker. Requests that run for minutes keep it busy: raise `--quiesce-timeout`."),
    Reason.UNSAFE_MULTI_GPU: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent)",
        "Several GPU processes use NCCL with settings the CUDA driver could not restore after a "
        "checkpoint; the capture is refused before any lock. The message names each rank's settings.",
        "Run the worker with `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_CUMEM_ENABLE=0` (or the slower "
        "alternative the message names), or leave the component out of dynsnap."),
    Reason.PID_RESERVATION_MISSING: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); tier snapshot only",
        "The entrypoint could not reserve the pid range (`pid_reserved: false` in its control file), or "
        "worker processes run below pid 10000: a CRIU restore could collide with the pod's own pids.",
        "The entrypoint's log says why both ways failed: its write of `ns_last_pid` (container runtimes mount "
        "`/proc/sys` read-only in a container that is not privileged) and its walk of the pid counter by "
        "short-lived children (not made where the node's `pid_max` is 10,000 or less, or with "
        "`--no-pid-cycle`). Raise `pid_max`, or use tier suspend, which needs none of this. No capability is "
        "needed (docs/install.md, \"What a namespace needs\")."),
    Reason.SECCOMP_OFF: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); tier snapshot only",
        "The entrypoint's io_uring filter is off or failed to install (control file `seccomp`), so the "
        "worker may hold io_uring, which CRIU cannot dump.",
        "Do not pass `--no-seccomp` to the entrypoint; if its log says the filter failed, the container's "
        "seccomp profile forbids installing one: allow `seccomp(2)` for the worker."),
    Reason.IO_URING_IN_USE: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); tier snapshot only",
        "A process of the worker holds an io_uring descriptor; CRIU 4.2.1 cannot dump it (\"Can't retrieve "
        "FDs\").",
        "The worker must start under the entrypoint with its filter on (then io_uring_setup fails with "
        "ENOSYS and Dynamo falls back to epoll). A process started another way (`kubectl exec`) can still "
        "hold one: end it."),
    Reason.GPU_PROCESS_OUTSIDE_TREE: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); tier snapshot only",
        "A GPU process of the container is outside the worker's tree (e.g. a daemon a wrapper script started "
        "before exec'ing the engine, reparented to the entrypoint). CRIU dumps the worker's tree only, so a "
        "snapshot would leave it out; the capture is refused before any lock, naming its pid in the container.",
        "Start every GPU process from the engine (in the worker's tree), or use tier suspend, which checkpoints "
        "every GPU process of the container."),
    Reason.CAPABILITIES_BEYOND_AGENT: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); tier snapshot only",
        "A process of the worker holds a capability (in any of its sets, the bounding set included) that the "
        "agent's container does not: CRIU gives a restored task back only capabilities it holds itself, so the "
        "restore would fail (`Unable to restore capabilities`) or the worker would come back without it. The "
        "capture is refused before any lock, naming the capabilities and the processes.",
        "Drop the capability from the worker container, or add it to the agent's (`agent.extraCapabilities` "
        "in the chart; docs/install.md says which it holds and why). Or use tier suspend, which restores no "
        "credentials."),
    Reason.PROCESS_TOO_LARGE: ReasonDoc(
        REFUSED, "refusal", "`Accepted=False` while it lasts (at the look), or `Degraded=True` at a step; any tier",
        "A process of the worker's container maps more than the agent reads of `/proc/<pid>/maps` (16 MiB, about "
        "100,000 mappings) or holds more than 65,536 descriptors. The agent reads neither further (a pod could "
        "otherwise make every look at the node cost seconds and memory) and touches nothing of the worker, "
        "which keeps serving; it looks again every minute.",
        "Find the process the message names (a leak of mappings or descriptors, or a deliberate one). A worker "
        "this large cannot be captured by dynsnap; leave the component out, or end the process."),
    Reason.METRICS_OUT_OF_BOUNDS: ReasonDoc(
        REFUSED, "refusal", "Warning Event on the WorkerSnapshot (agent), once per episode; any tier",
        "The worker's `/metrics` answer did not come whole within the agent's bound (3 s) or passed its size cap "
        "(4 MiB). The agent bounds every exchange with what a pod runs (dynsnap/runtime/bounded_http.py), so such "
        "a worker costs it one bounded look per scrape and delays no other worker; its idle facts stay as they "
        "were, and a capture, which asks the in-flight count first, is refused (`WorkerServing`) until it answers. "
        "A worker asleep routable (wake on request) is said the same way by the watch of its in-flight gauge "
        "(the note begins `wake-on-request watch:`; its bound is 1 s a look): it is not woken by such answers, "
        "and no other sleeper's watch waits for it.",
        "Look at what serves the worker's system port (Dynamo's metrics are tens of KiB, answered in "
        "milliseconds); the Event is said again only after an answer within the bounds."),
    Reason.DISK_BUDGET_EXCEEDED: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); tier snapshot only",
        "The capture's estimate (the worker's resident memory) would pass the node's image budget "
        "(`--images-budget-bytes`) or the free space of `--images-root`.",
        "Raise the budget or free the disk; images of pods gone from the node are deleted every "
        "`--gc-interval`. Or use tier suspend for this component."),
    Reason.ENGINE_ROUTES_MISSING: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); tier engine",
        "The worker's engine has no sleep routes on its system port: neither vLLM's `control/sleep` and "
        "`control/wake_up` nor TRT-LLM's `control/release_memory_occupation` and `resume_memory_occupation` "
        "(each answered 404 to a wake, which changes nothing on an awake engine). Not asked again until the "
        "spec changes.",
        "Use tier `auto` (engine where the routes exist, suspend where not) or `suspend` for this component; "
        "or run an engine that registers the routes (Dynamo's vLLM and TRT-LLM workers do)."),
    Reason.PIDS_IN_USE: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); a snapshot wake",
        "Processes of the pod's pid namespace hold pids of the capture; CRIU restores pids exactly.",
        "Something entered the pod while the worker slept (`kubectl exec`, an exec probe) and got those "
        "pids: end it; the agent retries after its backoff."),
    Reason.NOT_ENOUGH_GPU_MEMORY: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent); a wake",
        "The GPUs have less free memory than the capture freed: something else took it while the worker "
        "slept. Nothing was restored.",
        "Free the GPU (another workload scheduled onto it while this one slept); the agent retries after its "
        "backoff. `nvidia-smi` on the node shows who holds the memory."),
    Reason.IMAGE_FORMAT_MISMATCH: ReasonDoc(
        REFUSED, "refusal", "`Degraded=True`, `status.lastError` (agent)",
        "Reserved for a capture written in an image format this agent does not read (an agent upgraded "
        "while a worker slept). Such a capture is never restored; today the agent treats it as no capture.",
        _RESERVED_ACTION, reserved=True),
    Reason.IMAGE_MISSING: ReasonDoc(
        REFUSED, "failure", "`Degraded=True`, `status.lastError` (agent); a snapshot wake",
        "There is no capture of this container to restore from, or it was taken from an earlier container "
        "of the pod (the container restarted while the worker slept).",
        "The worker cannot come back in place: the agent gives up and the container restarts cold "
        "(`WorkerLost`). Check the node's `--images-root` was not cleaned by hand."),
    # -- failures mid-way ------------------------------------------------------------------------------
    Reason.ENTRYPOINT_UNRESPONSIVE: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent)",
        "The entrypoint did not acknowledge a state request within `--entrypoint-timeout`.",
        "Look at the container's log (`kubectl logs`): the entrypoint writes its own lines there. A "
        "container that is being restarted answers again once it is up; the agent retries."),
    Reason.CHECKPOINT_FAILED: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent)",
        "`dynsnap-cuda save` failed: a lock or a checkpoint of a GPU process returned an error (the message "
        "has the driver's error per pid). Locks taken are rolled back; the worker serves again.",
        "A lock that times out means GPU work did not drain within `--lock-timeout-ms` (a rank stuck in a "
        "collective). Other driver errors: check the driver version (r580 or later) and `dmesg`."),
    Reason.RESTORE_FAILED: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent)",
        "Bringing GPU processes back failed: `dynsnap-cuda resume` (restore, unlock) or a rollback left "
        "processes not running.",
        "The message has the driver's error per pid. The agent retries after its backoff; if the processes "
        "are lost the worker restarts cold (`WorkerLost`)."),
    Reason.HELPER_TIMEOUT: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent)",
        "CRIU or dynsnap-cuda ran past its bound (`--criu-timeout`, `--helper-timeout`) and was killed.",
        "A very large worker may need a longer bound (a 16 GiB worker dumped in 24 s on an H200). A helper "
        "hung in the driver: check `dmesg` and the driver."),
    Reason.DUMP_FAILED: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent)",
        "CRIU's dump failed; the worker tree was left running and is put back into serving. The message "
        "carries CRIU's error and warning lines and the cause named from them (traced, io_uring, ...).",
        "Read CRIU's lines in the message. `criu check` on the node shows missing kernel support."),
    Reason.ENGINE_ROUTE_FAILED: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent); tier engine",
        "The engine answered its sleep or wake route with an error (`{\"status\": \"error\"}`, another HTTP "
        "status, or no JSON); its message is quoted. A failed sleep is rolled back by the wake route (idempotent: "
        "an awake engine answers \"already awake\"), and the worker returns to serving.",
        "Read the engine's message and the worker's log; the capture is tried again after the backoff."),
    Reason.ENGINE_ROUTE_TIMEOUT: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent); tier engine",
        "The engine did not answer its sleep or wake route within `--engine-route-timeout`. The sleep may be half "
        "done: the wake route settles it, and the controller's wake deadline ends a wake that never comes back.",
        "Look at the worker's log (a drain that does not end: requests the engine cannot abort?); raise the "
        "bound if the engine is just slow."),
    Reason.DISK_FULL: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent)",
        "The image directory filled up during the dump; the partial images are removed and the worker "
        "serves again.",
        "Free space under `--images-root` or lower `--images-budget-bytes` so captures are refused "
        "beforehand (`DiskBudgetExceeded`)."),
    Reason.INCOMPLETE_CAPTURE: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent)",
        "The dump finished, but images of some GPU processes are missing (the completeness guard); the "
        "capture is rejected and the worker restored from what was dumped.",
        "Report it with the agent's log: it means CRIU skipped a process it should have dumped."),
    Reason.CRIU_RESTORE_FAILED: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent)",
        "CRIU's restore in place failed; the message carries the tail of CRIU's log.",
        "The agent retries after its backoff; if the tree cannot come back, the container restarts cold "
        "(`WorkerLost`)."),
    Reason.RESTORED_OUTSIDE_CONTAINER: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError` (agent); a snapshot wake",
        "CRIU restored the tree, but a restored process is not in its container's cgroups (those of the "
        "container's PID 1, dynsnap-entrypoint, in every hierarchy: cgroup v1 and v2): it would escape the "
        "container's memory and pids limits. The agent killed the restored tree (SIGKILL) at once, before its "
        "GPU processes were resumed or the worker was put back into serving; the capture is kept, so the "
        "worker stays restorable (`state: Waking`). The message names each process (host pid), hierarchy, "
        "the cgroup it was in and the container's.",
        "The agent retries after its backoff and fails alike while the cause stays. CRIU puts each process "
        "back into the cgroups it was dumped from, as the worker's cgroup namespace shows them (CRIU runs "
        "in it); a process found in the agent's own cgroups or another pod's means that did not happen: "
        "report it with the agent's log and CRIU's `restore.log` in the capture's directory. The controller's "
        "`--wake-timeout` ends a wake that keeps failing (`WakeFailed`, then `on-failed-wake`)."),
    Reason.INTERRUPTED: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.lastError`; Warning Event (agent)",
        "An agent (or its helper) died mid-step, or a step raised an unexpected error: GPU processes were "
        "found locked or checkpointed with no helper running for them.",
        "Nothing: the new agent rolls them back to running. The agent's log has the error when it was "
        "one."),
    Reason.WORKER_LOST: ReasonDoc(
        FAILED, "failure", "`Degraded=True`, `status.state: Lost` (agent)",
        "The worker cannot come back in place (its tree is gone and no capture can restore it): the "
        "entrypoint exits 75 and kubelet restarts the container cold. `Suspended=False` for this reason "
        "while it is lost; `WorkerNotRunning` while its container restarts.",
        "Nothing: the container starts cold and serves again. `status.lastError` history and the events "
        "before it say why."),
    Reason.POD_GONE: ReasonDoc(
        FAILED, "failure", "`Degraded=True` (agent)",
        "Reserved for a pod deleted in the middle of a capture or wake.",
        _RESERVED_ACTION, reserved=True),
    Reason.RECOVERED: ReasonDoc(
        FAILED, "normal", "`Degraded=False`; Event (agent)",
        "After a failure, a capture or wake succeeded: the worker is back to normal.",
        "Nothing."),
}
