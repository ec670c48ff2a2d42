"""A small JSON client over kubernetes_asyncio's transport (layer: k8s).

Objects are plain dicts exactly as the API server sent them: rebuilding a foreign
object from a generated model drops fields the model does not know (STYLE.md), so
nothing here deserialises into models. Writes are server-side apply by default,
under one field manager set on the client.

Every plain request (get/list/create/apply/patch/replace/delete) runs under the client's
named retry policy (``dynsnap.k8s.retry``; ``retry=False`` on a call opts out). ``watch``
is never retried here: it yields raw events, raises ``Gone`` on 410 and ``WatchSilent``
when no byte arrives within its deadline, and the informer's own loop reconnects.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from dynsnap.k8s import config, retry
from dynsnap.k8s.errors import ApiError, WatchSilent, error_for
from dynsnap.models import protocol
from dynsnap.models.resources import SERVICE_ACCOUNTS, Resource

Obj = dict[str, Any]

_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"
_JSON_PATCH = "application/json-patch+json"

# What the TokenRequest API mints by default: the in-cluster issuer/audience of the local
# control plane and of a kubeadm cluster alike.
DEFAULT_AUDIENCE = "https://kubernetes.default.svc"


def _read_environment_once(api: k8s_client.ApiClient) -> None:
    """kubernetes_asyncio's aiohttp session trusts the environment, and aiohttp then looks up
    ``~/.netrc`` and the proxy variables in a worker thread on every request: two thread hops per
    request, about a sixth of the controller's CPU at 10,000 workers (bench/scale, docs/BENCHMARKS.md).
    The proxy the environment names for the API server (``HTTPS_PROXY``/``HTTP_PROXY``, ``NO_PROXY``)
    is read once, here, and given to every request as kubernetes_asyncio's ``proxy`` (as a kubeconfig's
    ``proxy-url`` would be); ``.netrc``, which never holds a Kubernetes credential, is not read."""
    rest = api.rest_client
    session = rest.pool_manager
    if not session.trust_env:
        return
    if not rest.proxy:
        url = urlsplit(str(api.configuration.host))
        proxy = urllib.request.getproxies_environment().get(url.scheme or "https")
        # On Linux proxy_bypass is proxy_bypass_environment: NO_PROXY (no_proxy), as aiohttp reads it.
        if proxy and url.hostname and not urllib.request.proxy_bypass(url.hostname):
            rest.proxy = proxy
    session._trust_env = False  # aiohttp reads it per request; it has no setter


class Kube:
    """One API server connection with a fixed field manager and retry policy.

    Build it with ``from_kubeconfig``, ``from_token`` or ``in_cluster``, inside the running event
    loop (the HTTP session binds to it). ``namespace`` is the service account's namespace when in
    a cluster, else None.
    """

    def __init__(
        self,
        api: k8s_client.ApiClient,
        *,
        field_manager: str = protocol.FIELD_MANAGER,
        retry_policy: retry.RetryPolicy = retry.DEFAULT,
        namespace: str | None = None,
        token_file: config.TokenFile | None = None,
    ) -> None:
        self._api = api
        _read_environment_once(api)
        self.field_manager = field_manager
        self.retry_policy = retry_policy
        self.namespace = namespace
        self.token_file = token_file
        # Called with the HTTP method of every request sent (each retry's too): the owner's request
        # counter (dynsnap_api_requests_total). A callable, so this layer needs no metrics library.
        self.on_request: Callable[[str], None] | None = None

    @classmethod
    async def from_kubeconfig(cls, path: Path | str, *, field_manager: str = protocol.FIELD_MANAGER) -> Kube:
        cfg = k8s_client.Configuration()
        await k8s_config.load_kube_config(config_file=str(path), client_configuration=cfg)
        return cls(k8s_client.ApiClient(configuration=cfg), field_manager=field_manager)

    @classmethod
    def from_token(
        cls,
        *,
        server: str,
        token: str | None = None,
        token_file: Path | str | None = None,
        ca_cert: Path | str | None = None,
        field_manager: str = protocol.FIELD_MANAGER,
        retry_policy: retry.RetryPolicy = retry.DEFAULT,
        namespace: str | None = None,
    ) -> Kube:
        """A client authenticating with a bearer token (literal, or a file re-read when it changes)."""
        cfg, source = config.token_configuration(server=server, token=token, token_file=token_file, ca_cert=ca_cert)
        return cls(k8s_client.ApiClient(configuration=cfg), field_manager=field_manager, retry_policy=retry_policy,
                   namespace=namespace, token_file=source)

    @classmethod
    def in_cluster(
        cls,
        *,
        sa_dir: Path | str = config.SERVICE_ACCOUNT_DIR,
        host: str | None = None,
        port: str | int | None = None,
        field_manager: str = protocol.FIELD_MANAGER,
        retry_policy: retry.RetryPolicy = retry.DEFAULT,
    ) -> Kube:
        """The pod's own service account: token (re-read on rotation), CA and namespace from ``sa_dir``,
        the server from ``host``/``port`` or ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT``."""
        ic = config.in_cluster(sa_dir=sa_dir, host=host, port=port)
        return cls.from_token(server=ic.server, token_file=ic.token_file, ca_cert=ic.ca_cert,
                              field_manager=field_manager, retry_policy=retry_policy, namespace=ic.namespace)

    async def close(self) -> None:
        await self._api.close()

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- transport ---------------------------------------------------------------------------------

    async def _raw(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | aiohttp.ClientTimeout = 30.0,
    ) -> Any:
        params = [(k, _query_value(v)) for k, v in (query or {}).items() if v is not None]
        if self.on_request is not None:
            self.on_request(method)
        resp = await self._api.call_api(
            path,
            method,
            query_params=params,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )
        return resp

    async def _once(
        self, method: str, path: str, *, query: Mapping[str, Any] | None, body: Any, content_type: str, timeout: float
    ) -> Obj:
        resp = await self._raw(method, path, query=query, body=body, content_type=content_type, timeout=timeout)
        try:
            text = await resp.text()
        finally:
            resp.release()
        if not 200 <= resp.status <= 299:
            raise error_for(resp.status, text, method=method, path=path, headers=resp.headers)
        out: Obj = json.loads(text) if text else {}
        return out

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
        retry: bool = True,
    ) -> Obj:
        """One API call, under the client's retry policy unless ``retry=False``; ``timeout`` is per attempt."""
        async def once() -> Obj:
            return await self._once(method, path, query=query, body=body, content_type=content_type, timeout=timeout)
        if not retry:
            return await once()
        return await self.retry_policy.call(f"{method} {path}", once)

    # -- verbs -------------------------------------------------------------------------------------

    async def get(
        self, res: Resource, name: str, *, namespace: str | None = None, subresource: str | None = None
    ) -> Obj:
        return await self.request("GET", res.path(namespace=namespace, name=name, subresource=subresource))

    async def list(
        self,
        res: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        resource_version: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
        retry: bool = True,
    ) -> Obj:
        """One list request (one page when ``limit`` is set; pass back ``metadata.continue`` for the next)."""
        query = {"labelSelector": label_selector, "fieldSelector": field_selector, "resourceVersion": resource_version,
                 "limit": limit, "continue": continue_token}
        return await self.request("GET", res.path(namespace=namespace), query=query, retry=retry)

    async def create(self, res: Resource, body: Obj, *, namespace: str | None = None) -> Obj:
        ns = namespace if namespace is not None else body.get("metadata", {}).get("namespace")
        return await self.request(
            "POST", res.path(namespace=ns if res.namespaced else None), body=body,
            query={"fieldManager": self.field_manager},
        )

    async def apply(
        self,
        res: Resource,
        body: Obj,
        *,
        subresource: str | None = None,
        force: bool = False,
        field_manager: str | None = None,
    ) -> Obj:
        """Server-side apply ``body`` (which names itself) under this client's field manager."""
        meta = body.get("metadata", {})
        body = {"apiVersion": res.api_version, "kind": res.kind, **body}
        path = res.path(namespace=meta.get("namespace") if res.namespaced else None, name=meta["name"],
                        subresource=subresource)
        query = {"fieldManager": field_manager or self.field_manager, "force": "true" if force else None}
        return await self.request("PATCH", path, body=body, content_type=_APPLY, query=query)

    async def merge_patch(
        self, res: Resource, name: str, patch: Obj, *, namespace: str | None = None, subresource: str | None = None
    ) -> Obj:
        path = res.path(namespace=namespace, name=name, subresource=subresource)
        return await self.request("PATCH", path, body=patch, content_type=_MERGE,
                                  query={"fieldManager": self.field_manager})

    async def replace(self, res: Resource, body: Obj, *, subresource: str | None = None) -> Obj:
        """PUT with the object's resourceVersion (optimistic concurrency). Only for objects we own."""
        meta = body["metadata"]
        path = res.path(namespace=meta.get("namespace") if res.namespaced else None, name=meta["name"],
                        subresource=subresource)
        return await self.request("PUT", path, body=body, query={"fieldManager": self.field_manager})

    async def delete(
        self, res: Resource, name: str, *, namespace: str | None = None, propagation: str | None = None,
        grace_period_seconds: int | None = None, uid: str | None = None, resource_version: str | None = None,
    ) -> Obj:
        """Delete ``name``; with ``uid`` (and/or ``resource_version``) only that very object.

        The preconditions make the API server answer 409 Conflict instead of deleting an object
        that was deleted and recreated under the same name since we read it.
        """
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if propagation:
            body["propagationPolicy"] = propagation
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v is not None}
        if preconditions:
            body["preconditions"] = preconditions
        return await self.request("DELETE", res.path(namespace=namespace, name=name), body=body)

    async def request_token(
        self, service_account: str, *, namespace: str, audiences: Sequence[str] | None = None,
        expiration_seconds: int = 3600,
    ) -> str:
        """A bound token for ``service_account`` from the TokenRequest API (needs ``create`` on
        ``serviceaccounts/token``). The API server may shorten ``expiration_seconds`` (minimum 600)."""
        spec = {"audiences": [*audiences] if audiences else [DEFAULT_AUDIENCE], "expirationSeconds": expiration_seconds}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = SERVICE_ACCOUNTS.path(namespace=namespace, name=service_account, subresource="token")
        out = await self.request("POST", path, body=body)
        return str(out["status"]["token"])

    async def watch(
        self,
        res: Resource,
        *,
        namespace: str | None = None,
        resource_version: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        bookmarks: bool = True,
        send_initial_events: bool = False,
        timeout_seconds: int = 300,
        silent_deadline: float | None = None,
    ) -> AsyncIterator[Obj]:
        """Yield watch events (``{"type": ..., "object": ...}``) until the server closes the stream.

        An ``ERROR`` event carrying a 410 Status is raised as ``Gone``; the caller relists.
        ``send_initial_events`` asks for a streaming list: ADDED events for what exists, then a
        BOOKMARK annotated ``k8s.io/initial-events-end``. The server ends the stream after
        ``timeout_seconds``; if no byte arrives for ``silent_deadline`` seconds (default: that
        timeout plus 30 s) the stream is dead and ``WatchSilent`` is raised.
        """
        deadline = silent_deadline if silent_deadline is not None else timeout_seconds + 30.0
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "labelSelector": label_selector,
            "fieldSelector": field_selector,
            "allowWatchBookmarks": "true" if bookmarks else None,
            "sendInitialEvents": "true" if send_initial_events else None,
            "resourceVersionMatch": "NotOlderThan" if send_initial_events else None,
            "timeoutSeconds": timeout_seconds,
        }
        path = res.path(namespace=namespace)
        try:
            resp = await self._raw("GET", path, query=query,
                                   timeout=aiohttp.ClientTimeout(connect=10.0, sock_read=deadline))
        except aiohttp.SocketTimeoutError as e:
            raise WatchSilent(f"WATCH {path}: no response within {deadline:.1f}s") from e
        finished = False
        try:
            if not 200 <= resp.status <= 299:
                raise error_for(resp.status, await resp.text(), method="WATCH", path=path, headers=resp.headers)
            while True:
                try:
                    line = await resp.content.readline()
                except TimeoutError as e:  # aiohttp's sock_read timeout: no byte within the deadline
                    raise WatchSilent(f"WATCH {path}: no byte for {deadline:.1f}s") from e
                if not line:
                    finished = True
                    return
                event: Obj = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object", {})
                    raise error_for(int(status.get("code", 500)), json.dumps(status), method="WATCH", path=path)
                yield event
        finally:
            # A stream left half-read cannot go back to the pool: close its connection.
            if finished:
                resp.release()
            else:
                resp.close()


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


__all__ = ["ApiError", "Kube", "Obj"]
