"""Errors raised by ``dynsnap.k8s``.

    ApiError                 any non-2xx answer from the API server (status, reason, message)
    ├── NotFound             404
    ├── Conflict             409 (optimistic concurrency or SSA field conflict)
    └── Gone                 410: a watch or list resourceVersion is too old; relist
"""

from __future__ import annotations

import json
from typing import Any


class ApiError(Exception):
    """The API server answered with a non-2xx status."""

    def __init__(self, status: int, body: str, *, method: str = "", path: str = "") -> None:
        self.status = status
        self.method = method
        self.path = path
        self.reason = ""
        self.message = body[:500]
        try:
            status_obj: Any = json.loads(body)
            if isinstance(status_obj, dict):
                self.reason = str(status_obj.get("reason", ""))
                self.message = str(status_obj.get("message", self.message))
        except ValueError:
            pass
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")


class NotFound(ApiError):
    """404 Not Found."""


class Conflict(ApiError):
    """409 Conflict."""


class Gone(ApiError):
    """410 Gone: the resourceVersion asked for is no longer available."""


def error_for(status: int, body: str, *, method: str, path: str) -> ApiError:
    cls = {404: NotFound, 409: Conflict, 410: Gone}.get(status, ApiError)
    return cls(status, body, method=method, path=path)
