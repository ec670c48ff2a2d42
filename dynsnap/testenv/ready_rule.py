"""ready_rule: kubelet's rule for a pod's Ready condition, for pods no kubelet runs (the scale bench's
kwok pods, bench/scale/fake_kubelet.py): Ready only when the containers are ready *and* every readiness
gate condition is True. The real node's kubelet computes it for the pods it runs.
"""

from __future__ import annotations

from dynsnap.k8s.client import Obj


def compute_ready(pod: Obj, containers_ready: bool) -> bool:
    """kubelet's rule: Ready = ContainersReady and every readiness gate condition True."""
    conds = {c["type"]: c.get("status") for c in pod.get("status", {}).get("conditions", [])}
    gates = [g["conditionType"] for g in pod.get("spec", {}).get("readinessGates", [])]
    return containers_ready and all(conds.get(g) == "True" for g in gates)
