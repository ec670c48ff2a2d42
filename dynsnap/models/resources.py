"""Kubernetes resource coordinates (group, version, plural) as plain values.

Used by ``dynsnap.k8s`` to build REST paths; pure data, no client types.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynsnap.models import protocol


@dataclass(frozen=True, slots=True)
class Resource:
    """One REST resource: ``/apis/<group>/<version>/[namespaces/<ns>/]<plural>``."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, *, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced:
            if namespace is not None:
                base += f"/namespaces/{namespace}"
            elif name is not None:
                raise ValueError(f"{self.kind} is namespaced: a name needs a namespace")
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        elif subresource:
            raise ValueError("a subresource needs a name")
        return base


NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
NODES = Resource("", "v1", "nodes", "Node", namespaced=False)
PODS = Resource("", "v1", "pods", "Pod")
SERVICES = Resource("", "v1", "services", "Service")
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
CONFIG_MAPS = Resource("", "v1", "configmaps", "ConfigMap")
EVENTS = Resource("events.k8s.io", "v1", "events", "Event")
ENDPOINT_SLICES = Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice")
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", namespaced=False)
CLUSTER_ROLES = Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False)
CLUSTER_ROLE_BINDINGS = Resource(
    "rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False
)
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")

DGDS = Resource(protocol.DYNAMO_GROUP, protocol.DGD_VERSION, "dynamographdeployments", "DynamoGraphDeployment")
DWMS = Resource(protocol.DYNAMO_GROUP, protocol.DWM_VERSION, "dynamoworkermetadatas", "DynamoWorkerMetadata")
WORKER_SNAPSHOTS = Resource(protocol.DYNSNAP_GROUP, protocol.WS_VERSION, protocol.WS_PLURAL, protocol.WS_KIND)
