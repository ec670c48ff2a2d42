"""What every `dynsnap` command that talks to the cluster starts with (layer: controller): the
client and the namespace commands default to (``connect``: --kubeconfig, $KUBECONFIG, ~/.kube/config,
in-cluster, as kubectl), a refused request in words a person can act on (``explain``), names checked
before they reach the API server, and one cheap list that turns an RBAC refusal or a missing CRD
into an error now (``preflight``). Bad input is ``UsageError`` (exit 2), found before anything changed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from dynsnap.k8s.client import Kube
from dynsnap.k8s.errors import ConfigError, Forbidden, K8sError, NotFound, RetryExhausted, Unauthorized
from dynsnap.models import protocol as P
from dynsnap.models import resources as R


class UsageError(Exception):
    """Bad input or a refused request, found before anything changed (exit 2)."""


def _kubeconfig_path(explicit: str | None) -> str | None:
    """--kubeconfig, then $KUBECONFIG (its first file), then ~/.kube/config when it exists, as kubectl."""
    if explicit:
        if not Path(explicit).is_file():
            raise UsageError(f"kubeconfig {explicit} does not exist")
        return explicit
    env = os.environ.get("KUBECONFIG", "")
    first = next((p for p in env.split(os.pathsep) if p), None)
    if first:
        if not Path(first).is_file():
            raise UsageError(f"kubeconfig {first} (from $KUBECONFIG) does not exist")
        return first
    home = Path.home() / ".kube" / "config"
    return str(home) if home.is_file() else None


def _context_namespace(path: str) -> str | None:
    """The namespace of the kubeconfig's current context, if it names one."""
    try:
        cfg = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    current = cfg.get("current-context")
    for ctx in cfg.get("contexts") or []:
        if ctx.get("name") == current:
            ns = (ctx.get("context") or {}).get("namespace")
            return str(ns) if ns else None
    return None


async def connect(kubeconfig: str | None) -> tuple[Kube, str]:
    """A client (kubeconfig, else in-cluster) and the namespace commands default to."""
    path = _kubeconfig_path(kubeconfig)
    ns = _context_namespace(path) if path is not None else None
    try:
        if path is not None:
            kube = await Kube.from_kubeconfig(path, field_manager=P.CLI_FIELD_MANAGER)
            return kube, ns or "default"
        kube = Kube.in_cluster(field_manager=P.CLI_FIELD_MANAGER)
    except ConfigError as e:
        raise UsageError(f"no cluster to talk to: pass --kubeconfig or set KUBECONFIG ({e})") from e
    except UsageError:
        raise
    except Exception as e:  # kubernetes_asyncio's own config errors: a bad file, an unknown context
        raise UsageError(f"kubeconfig {path}: {type(e).__name__}: {e}") from e
    return kube, kube.namespace or "default"


def explain(e: BaseException) -> str:
    """A refused or failed request in words a person can act on."""
    if isinstance(e, Forbidden):
        return (f"forbidden: {e.message} (the dynsnap-user ClusterRole of deploy/rbac/user.yaml grants what "
                "these commands need)")
    if isinstance(e, Unauthorized):
        return f"unauthorized: the API server refused these credentials ({e.message})"
    if isinstance(e, RetryExhausted):
        return f"cannot reach the API server: {e.last}"
    return f"{type(e).__name__}: {e}"


def check_name(what: str, value: str, pattern: str) -> None:
    if not re.match(pattern, value) or len(value) > 253:
        raise UsageError(f"{what} {value!r} is not a valid Kubernetes name")


async def preflight(kube: Kube, namespace: str | None) -> None:
    """One cheap list, so that a refusal (RBAC, no CRD) is an error now, not an informer retrying."""
    try:
        await kube.list(R.WORKER_SNAPSHOTS, namespace=namespace, limit=1)
    except NotFound as e:
        raise UsageError("the WorkerSnapshot CRD is not installed in this cluster "
                         "(`dynsnap crd | kubectl apply -f -`)") from e
    except K8sError as e:
        raise UsageError(explain(e)) from e
