"""kwok: the stand-in for kubelets on fake Nodes (a real binary; see TESTENV.md).

kwok manages only Nodes labelled ``dynsnap.io/fake-node=true`` with the stage files
shipped in its module (node-initialize, pod-ready, pod-complete, pod-delete): it marks
Nodes Ready, moves pods bound to them to Running with a pod IP from the Node's
``spec.podCIDR``, and finalises deleted pods. Pods that must really run, run on the real node
(``node.py``), whose kubelet gives them their readiness.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dynsnap.testenv.process import Supervised, require_binary

FAKE_NODE_LABEL = "dynsnap.io/fake-node"


def kwok_process(*, kubeconfig: Path, logs_dir: Path, server_port: int) -> Supervised:
    kwok_bin = require_binary(os.environ.get("DYNSNAP_KWOK"), "kwok", "DYNSNAP_KWOK")
    stages_dir = Path(os.environ.get("DYNSNAP_KWOK_STAGES", kwok_bin.parent / "stages"))
    stages = sorted(stages_dir.glob("*.yaml"))
    if not stages:
        raise FileNotFoundError(f"no kwok stage files in {stages_dir}; run `./run setup`")
    argv = [str(kwok_bin), f"--kubeconfig={kubeconfig}",
            f"--manage-nodes-with-label-selector={FAKE_NODE_LABEL}=true",
            f"--server-address=127.0.0.1:{server_port}"]
    argv += [f"--config={s}" for s in stages]
    return Supervised("kwok", argv, log_path=logs_dir / "kwok.log")


def fake_node(name: str, *, pod_cidr: str, node_ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {FAKE_NODE_LABEL: "true", "kubernetes.io/hostname": name,
                                               "type": "kwok"},
                     "annotations": {"kwok.x-k8s.io/node": "fake"}},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {"addresses": [{"type": "InternalIP", "address": node_ip}]},
    }
