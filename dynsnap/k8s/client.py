"""A small JSON client over kubernetes_asyncio's transport.

Objects are plain dicts exactly as the API server sent them: rebuilding a foreign
object from a generated model drops fields the model does not know (STYLE.md), so
nothing here deserialises into models. Writes are server-side apply by default,
under one field manager set on the client. ``watch`` yields raw events and raises
``Gone`` on 410 so the caller relists.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from dynsnap.k8s.errors import ApiError, error_for
from dynsnap.models import protocol
from dynsnap.models.resources import Resource

Obj = dict[str, Any]

_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"
_JSON_PATCH = "application/json-patch+json"


class Kube:
    """One API server connection with a fixed field manager."""

    def __init__(self, api: k8s_client.ApiClient, *, field_manager: str = protocol.FIELD_MANAGER) -> None:
        self._api = api
        self.field_manager = field_manager

    @classmethod
    async def from_kubeconfig(cls, path: Path | str, *, field_manager: str = protocol.FIELD_MANAGER) -> Kube:
        cfg = k8s_client.Configuration()
        await k8s_config.load_kube_config(config_file=str(path), client_configuration=cfg)
        return cls(k8s_client.ApiClient(configuration=cfg), field_manager=field_manager)

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

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Obj:
        resp = await self._raw(method, path, query=query, body=body, content_type=content_type, timeout=timeout)
        try:
            text = await resp.text()
        finally:
            resp.release()
        if not 200 <= resp.status <= 299:
            raise error_for(resp.status, text, method=method, path=path)
        out: Obj = json.loads(text) if text else {}
        return out

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
    ) -> Obj:
        query = {"labelSelector": label_selector, "fieldSelector": field_selector, "resourceVersion": resource_version}
        return await self.request("GET", res.path(namespace=namespace), query=query)

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
        grace_period_seconds: int | None = None,
    ) -> Obj:
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if propagation:
            body["propagationPolicy"] = propagation
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        return await self.request("DELETE", res.path(namespace=namespace, name=name), body=body)

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
    ) -> AsyncIterator[Obj]:
        """Yield watch events (``{"type": ..., "object": ...}``) until the server closes the stream.

        An ``ERROR`` event carrying a 410 Status is raised as ``Gone``; the caller relists.
        ``send_initial_events`` asks for a streaming list: ADDED events for what exists, then a
        BOOKMARK annotated ``k8s.io/initial-events-end``. The server ends the stream after
        ``timeout_seconds``; the client gives up if no byte
        arrives for that long plus a margin (a silent stream is a dead one).
        """
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
        resp = await self._raw("GET", path, query=query,
                               timeout=aiohttp.ClientTimeout(connect=10.0, sock_read=timeout_seconds + 30.0))
        try:
            if not 200 <= resp.status <= 299:
                raise error_for(resp.status, await resp.text(), method="WATCH", path=path)
            while True:
                line = await resp.content.readline()
                if not line:
                    return
                event: Obj = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object", {})
                    raise error_for(int(status.get("code", 500)), json.dumps(status), method="WATCH", path=path)
                yield event
        finally:
            resp.release()


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


__all__ = ["ApiError", "Kube", "Obj"]
