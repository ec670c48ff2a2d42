"""Before any phase: the worker's WorkerSnapshot made (or replaced, for a pod recreated under the
same name), a gated pod of a component not opted in let serve, and a policy that does not parse
reported (nothing new is decided; a return to serving under way still ends).

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

from dynsnap.controller import fleet as F
from dynsnap.controller import wake as W
from dynsnap.controller.plan import Decision, Phase, Want
from dynsnap.controller.scope import Scope
from dynsnap.controller.writes import Ctx
from dynsnap.models import protocol as P
from dynsnap.models.policy import Policy
from dynsnap.models.protocol import ConditionType, DesiredState, Reason

POLL = 0.25


async def create(ctx: Ctx, s: Scope, policy: Policy) -> float | None:
    node = (s.pod.get("spec") or {}).get("nodeName")
    if not node:
        return None  # not scheduled: the pod's next change brings it back
    meta = s.pod["metadata"]
    body = {"apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
            # The graph and component labels let `dynsnap status` and selectors find a worker's
            # snapshots without reading its pod.
            "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                         "labels": {P.LABEL_NODE: node, P.LABEL_DGD_NAME: s.dgd_name, P.LABEL_COMPONENT: s.component},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                              "uid": meta["uid"], "blockOwnerDeletion": False}]},
            "spec": {"podName": meta["name"], "podUID": meta["uid"], "container": P.DEFAULT_CONTAINER,
                     "tier": policy.tier.value, "desiredState": DesiredState.ACTIVE.value,
                     "engineSleepLevel": policy.engine_sleep_level}}
    return None if await ctx.create_ws(body) else POLL


async def replaced(ctx: Ctx, s: Scope) -> float | None:
    """A WorkerSnapshot for an earlier pod of this name: never acted on for the new one; delete it
    (UID precondition: only that object) and start afresh."""
    ws = s.snap
    await ctx.delete_ws(ws)
    await ctx.say(s.pod, "Normal", Reason.POD_REPLACED,
                  f"pod recreated (UID {s.pod_uid}, was {ws.spec.pod_uid}): the old capture is never "
                  "restored into it; a new WorkerSnapshot follows", occurrence=ws.metadata.uid)
    return POLL


async def serve_unmanaged(ctx: Ctx, s: Scope) -> float | None:
    """A gated pod of a component that is not opted in: let it serve (a gate nobody sets is False
    forever, and the pod never Ready)."""
    if F.pod_condition(s.pod, P.CONDITION_SERVING) != "True":
        await ctx.gate(s.pod, True)
    return None


def policy_condition_ok(s: Scope) -> bool:
    c = s.snap.condition(ConditionType.POLICY)
    return c is not None and c.status == "True"


async def bad_policy(ctx: Ctx, s: Scope) -> None:
    msg = (f"component {s.component or '?'}: {s.parsed.message()}; nothing new is decided until it is fixed (a "
           "return to serving under way still ends)")
    await ctx.say(s.dgd, "Warning", Reason.INVALID_POLICY, msg, subject=f"policy/{s.dgd_key}/{s.component}")
    if s.ws is not None:
        c = s.ws.condition(ConditionType.POLICY)
        if c is None or c.status != "False" or c.message != msg:
            await ctx.write(s.ws, s.rec, policy_ok=False, policy_msg=msg)


async def finish_return(ctx: Ctx, s: Scope) -> float | None:
    """While the policy does not parse nothing new is decided, but a worker on its way back to
    serving gets there: a quiesce under way is called off, a woken (or recalled) worker is verified
    and its gate set. Left alone, a typo would keep it out of serving with Active wanted for as long
    as it stands (the quiesce timeout is on the policy's path). Defaults stand in for the policy it
    cannot read, and a failed verification deletes nothing (the user's on-failed-wake is unreadable)."""
    ws = s.ws
    if ws is None or ws.spec.pod_uid != s.pod_uid or ws.spec.desired_state != DesiredState.ACTIVE:
        return None
    if s.phase not in (Phase.QUIESCING, Phase.STARTING):
        return None
    why = "the policy does not parse; the return to serving under way ends"
    return await W.awake(ctx, s, Policy(on_failed_wake="none"), Decision(Want.AWAKE, why))
