"""stub_gpu_stack: stands in for NVIDIA's GPU stack on the real node, which has no GPU: the device
plugin's advertisement (``nvidia.com/gpu`` in the Node's capacity), GPU feature discovery's label
(``nvidia.com/gpu.present=true``, the chart's default agent nodeSelector), and the driver's
libraries that a GPU node's container toolkit mounts into a container asking for a GPU, here the
stub driver (dynsnap_parts.StubDriver: stub_libcuda as libcuda.so.1, stub_nvml as
libnvidia-ml.so.1) as a hostPath volume.

Layer: ``dynsnap.testenv`` (test harness only).

Why a hostPath, at the same path inside as on the node: NVIDIA's device plugin and container
toolkit give a GPU container the driver's libraries from the node's file system by bind mounts;
a hostPath volume is the one way a pod spec says the same to a kubelet with no NVIDIA runtime. The
stub driver's state directory (the per-process checkpoint state, keyed by pid namespace) must be
the same files for the worker's preloaded stub and for the agent's dynsnap-cuda, as the real
driver's state is one driver's; the agent gets it through the chart's ``agent.extraVolumes``
(GKE's driver arrives in the agent the same way: a hostPath of the node's driver directory). A
CUDA engine loads libcuda itself; the mocker does not, so the worker preloads it
(``LD_PRELOAD``): the agent finds GPU processes by what they map (dynsnap/agent/worker.py).

No device plugin runs (kubelet's device-plugin API is gRPC): the capacity is written to the Node's
status as Kubernetes documents for extended resources, and kubelet keeps it and admits pods that ask
for it; nothing is allocated.
"""

from __future__ import annotations

import copy
from typing import Any

from dynsnap.k8s.client import Kube
from dynsnap.models import resources as R
from dynsnap.testenv.dynsnap_parts import StubDriver

Obj = dict[str, Any]
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
DRIVER_VOLUME = "stub-nvidia-driver"  # the stand-in for the driver libraries the container toolkit mounts
DRIVER_STATE_VOLUME = "stub-nvidia-driver-state"


async def advertise(api: Kube, node: str, *, gpus: int) -> None:
    """``gpus`` GPUs on ``node``, as the device plugin and GPU feature discovery would say it."""
    if gpus < 1:
        raise ValueError(f"a GPU node has at least one GPU, not {gpus}")
    await api.merge_patch(R.NODES, node, {"metadata": {"labels": {GPU_PRESENT_LABEL: "true"}}})
    await api.merge_patch(R.NODES, node, {"status": {"capacity": {GPU_RESOURCE: str(gpus)},
                                                     "allocatable": {GPU_RESOURCE: str(gpus)}}},
                          subresource="status")


def asks_for_gpu(container: Obj) -> bool:
    res = container.get("resources") or {}
    return any(GPU_RESOURCE in (res.get(k) or {}) for k in ("limits", "requests"))


def with_driver(pod_spec: Obj, driver: StubDriver) -> Obj:
    """``pod_spec`` with the stub driver where the container toolkit would put the real one: its
    libraries (read-only) and its state directory in every container that asks for a GPU, the
    driver preloaded there. A copy; the input is not changed."""
    spec = copy.deepcopy(pod_spec)
    gpu = [c for c in spec.get("containers") or [] if asks_for_gpu(c)]
    if not gpu:
        return spec
    lib, state = driver.libcuda.parent, driver.state_dir
    spec.setdefault("volumes", []).extend([
        {"name": DRIVER_VOLUME, "hostPath": {"path": str(lib), "type": "Directory"}},
        {"name": DRIVER_STATE_VOLUME, "hostPath": {"path": str(state), "type": "Directory"}},
    ])
    for c in gpu:
        c.setdefault("volumeMounts", []).extend([
            {"name": DRIVER_VOLUME, "mountPath": str(lib), "readOnly": True},
            {"name": DRIVER_STATE_VOLUME, "mountPath": str(state)},
        ])
        env = [e for e in c.get("env") or [] if e.get("name") not in ("LD_PRELOAD", "DYNSNAP_STUB_DIR")]
        preload = next((e.get("value", "") for e in c.get("env") or [] if e.get("name") == "LD_PRELOAD"), "")
        c["env"] = [*env, {"name": "LD_PRELOAD", "value": " ".join(filter(None, [str(driver.libcuda), preload]))},
                    {"name": "DYNSNAP_STUB_DIR", "value": str(state)}]
    return spec


def agent_values(driver: StubDriver) -> Obj:
    """The chart values that give the agent the same driver (agent.extraVolumes, extraVolumeMounts,
    extraEnv: dynsnap-cuda loads what DYNSNAP_LIBCUDA / DYNSNAP_LIBNVML name)."""
    lib, state = driver.libcuda.parent, driver.state_dir
    return {
        "extraVolumes": [{"name": DRIVER_VOLUME, "hostPath": {"path": str(lib), "type": "Directory"}},
                         {"name": DRIVER_STATE_VOLUME, "hostPath": {"path": str(state), "type": "Directory"}}],
        "extraVolumeMounts": [{"name": DRIVER_VOLUME, "mountPath": str(lib), "readOnly": True},
                              {"name": DRIVER_STATE_VOLUME, "mountPath": str(state)}],
        "extraEnv": [{"name": k, "value": v} for k, v in driver.env().items()],
    }
