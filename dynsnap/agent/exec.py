"""``dynsnap agent exec``: one capture or one wake of one worker on this machine, without
Kubernetes, through the same executor the node agent uses step by step. The GPU machine runs
it against a real CUDA process; a person can run it on a node to recover a worker by hand.

Layer: ``dynsnap.agent``. Prints one JSON line per step (name, seconds, what it did) and a final
line with the outcome; exits 0 when the worker reached the wanted state, 1 when a step failed
(the executor rolls back what it changed before giving up), 2 on bad arguments.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, TextIO

from dynsnap.agent import idle as I
from dynsnap.agent import worker as W
from dynsnap.agent.executor import Executor, StepFailure, Subject
from dynsnap.agent.images import new_capture_id
from dynsnap.agent.plan import Step
from dynsnap.agent.settings import AgentSettings
from dynsnap.models.ids import HostPid, PodUID
from dynsnap.models.protocol import DesiredState, ObservedState, Tier

# A capture or wake is at most a dozen steps; a rollback after a failure a few more.
MAX_STEPS = 40


@dataclass
class ExecOutcome:
    ok: bool
    state: ObservedState
    steps: list[dict[str, Any]]
    error: dict[str, Any] | None
    seconds: float


async def execute(settings: AgentSettings, subject: Subject, *, action: str, tier: Tier, quiesced: bool,
                  metrics_url: str | None = None, out: TextIO | None = None) -> ExecOutcome:
    """Take ``subject`` to Suspended (``capture``) or Active (``wake``) step by step."""
    ex = Executor(settings)
    want = DesiredState.SUSPENDED if action == "capture" else DesiredState.ACTIVE

    async def gate(w: W.WorkerProcs) -> str | None:
        if not quiesced:
            return "not confirmed out of serving: take the worker out of serving first, then pass --quiesced"
        if metrics_url:
            try:
                sample = await I.scrape(metrics_url)
            except I.MetricsUnavailable as e:
                return str(e)
            if sample.inflight > 0:
                return f"{sample.inflight} requests in flight"
        return None

    t0 = time.monotonic()
    steps: list[dict[str, Any]] = []
    error: dict[str, Any] | None = None
    capture_id = new_capture_id()
    rolling_back = False
    for _ in range(MAX_STEPS):
        obs = await ex.observe(subject)
        step = ex.next_step(obs, want=DesiredState.ACTIVE if rolling_back else want, tier=tier)
        if step == Step.NONE:
            break
        if step == Step.WAIT_HELPER:
            await asyncio.sleep(1.0)  # a helper an earlier run left is still working; bounded by MAX_STEPS
        try:
            res = await ex.run_step(subject, obs, step, tier=tier, gate=gate, capture_id=capture_id)
        except StepFailure as f:
            error = {"reason": f.reason.value, "step": step.value, "message": f.message, "changed": f.changed}
            _emit(out, {"step": step.value, "failed": error})
            if not f.changed or rolling_back:
                break
            rolling_back = True  # bring the worker back to a consistent, serving state, then stop
            continue
        rec = {"step": step.value, "seconds": round(res.seconds, 4), **_brief(res.info)}
        steps.append(rec)
        _emit(out, rec)
    final = await ex.observe(subject)
    ok = error is None and final.state == (ObservedState.SUSPENDED if want == DesiredState.SUSPENDED
                                           else ObservedState.ACTIVE)
    outcome = ExecOutcome(ok=ok, state=final.state, steps=steps, error=error, seconds=time.monotonic() - t0)
    _emit(out, {"outcome": "ok" if ok else "failed", "state": final.state.value, "seconds": round(outcome.seconds, 4),
                "error": error})
    return outcome


def _brief(info: dict[str, Any]) -> dict[str, Any]:
    keep = ("gpus", "helper", "criuSeconds", "pagesRead", "imageBytes", "image", "staging", "source", "removed",
            "engine")
    out = {k: info[k] for k in keep if k in info}
    if "pids" in info:
        out["pids"] = info["pids"]
    return out


def _emit(out: TextIO | None, obj: dict[str, Any]) -> None:
    if out is not None:
        out.write(json.dumps(obj, default=str) + "\n")
        out.flush()


def subject_for(uid: str, *, namespace: str = "default", pod: str = "worker", entrypoint: int | None = None,
                system_url: str | None = None) -> Subject:
    return Subject(namespace=namespace, pod=pod, uid=PodUID(uid),
                   entrypoint=HostPid(entrypoint) if entrypoint else None, system_url=system_url)
