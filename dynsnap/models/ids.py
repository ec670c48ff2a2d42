"""Identifier types: one ``NewType`` per kind of id, so a host pid is never passed where an
in-namespace pid is meant, nor a pod name where a pod UID is. Pure types (bottom layer)."""

from __future__ import annotations

from typing import NewType

PodUID = NewType("PodUID", str)
"""``metadata.uid`` of a pod: the only identity that tells a pod from its recreation."""

NodeName = NewType("NodeName", str)

HostPid = NewType("HostPid", int)
"""A pid as the node (the agent, with hostPID) sees it."""

NsPid = NewType("NsPid", int)
"""A pid as the pod's own pid namespace sees it (the last field of ``NSpid``). CRIU names its
images by these and restores them exactly."""

InstanceId = NewType("InstanceId", int)
"""A Dynamo worker's discovery instance id. Pinning headers take it in decimal; the worker's
metrics label ``worker_id`` carries it in hex."""
