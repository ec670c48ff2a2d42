"""Errors raised by ``dynsnap.k8s`` (layer: k8s).

    K8sError                     base of everything this package raises on purpose
    ├── ApiError                 any non-2xx answer from the API server (status, reason, message, retry_after)
    │   ├── Unauthorized         401: the token is unknown or expired
    │   ├── Forbidden            403: RBAC refuses this identity
    │   ├── NotFound             404
    │   ├── Conflict             409 (optimistic concurrency, a failed precondition, SSA field conflict)
    │   ├── Gone                 410: a watch/list resourceVersion or continue token is too old; relist
    │   ├── Invalid              422: the object failed validation
    │   └── TooManyRequests      429: throttled; ``retry_after`` says how long the server asks us to wait
    ├── WatchSilent              a watch stream sent no byte, not even a bookmark, for longer than its deadline
    ├── RetryExhausted           a named retry policy gave up (attempts or total time); the last error is the cause
    ├── InformerFailed           an informer failed too often too fast (its rate bound); the owner should exit
    └── ConfigError              in-cluster / token configuration is missing or unreadable

Transport errors (aiohttp client errors, ``OSError``, ``TimeoutError``) are not wrapped where they
happen: ``dynsnap.k8s.retry`` classifies them, and what survives its policy arrives as ``RetryExhausted``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from dynsnap.k8s.backoff import parse_retry_after


class K8sError(Exception):
    """Base of the errors this package raises."""


class ApiError(K8sError):
    """The API server answered with a non-2xx status."""

    def __init__(
        self, status: int, body: str, *, method: str = "", path: str = "", headers: Mapping[str, str] | None = None
    ) -> None:
        self.status = status
        self.method = method
        self.path = path
        self.reason = ""
        self.message = body[:500]
        self.details: dict[str, Any] = {}
        try:
            status_obj: Any = json.loads(body)
            if isinstance(status_obj, dict):
                self.reason = str(status_obj.get("reason", ""))
                self.message = str(status_obj.get("message", self.message))
                details = status_obj.get("details")
                if isinstance(details, dict):
                    self.details = details
        except ValueError:
            pass
        # The header wins; a Status body may carry details.retryAfterSeconds instead (the API server
        # sets both on 429 and on some 5xx such as "the server is currently unable to handle the request").
        header = (headers or {}).get("Retry-After")
        self.retry_after: float | None = parse_retry_after(header)
        if self.retry_after is None and isinstance(self.details.get("retryAfterSeconds"), int | float):
            self.retry_after = float(self.details["retryAfterSeconds"])
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")


class Unauthorized(ApiError):
    """401 Unauthorized."""


class Forbidden(ApiError):
    """403 Forbidden."""


class NotFound(ApiError):
    """404 Not Found."""


class Conflict(ApiError):
    """409 Conflict."""


class Gone(ApiError):
    """410 Gone: the resourceVersion asked for is no longer available."""


class Invalid(ApiError):
    """422 Unprocessable Entity."""


class TooManyRequests(ApiError):
    """429 Too Many Requests."""


class WatchSilent(K8sError):
    """A watch stream stayed silent past its deadline: treated as dead."""


class RetryExhausted(K8sError):
    """A retry policy gave up. ``policy`` names it; ``last`` is the final error (also ``__cause__``)."""

    def __init__(self, policy: str, what: str, *, attempts: int, elapsed: float, last: BaseException) -> None:
        self.policy = policy
        self.what = what
        self.attempts = attempts
        self.elapsed = elapsed
        self.last = last
        super().__init__(f"retry policy {policy!r} gave up on {what} after {attempts} attempts "
                         f"({elapsed:.1f}s): {type(last).__name__}: {last}")


class InformerFailed(K8sError):
    """An informer saw more consecutive failures within its window than its settings allow."""

    def __init__(self, name: str, *, failures: int, window: float, last: BaseException | None) -> None:
        self.name = name
        self.failures = failures
        self.window = window
        self.last = last
        super().__init__(f"informer {name}: {failures} consecutive failures within {window:.0f}s "
                         f"with no successful list or watch; last: {type(last).__name__}: {last}")


class ConfigError(K8sError):
    """Connection configuration is missing or unusable."""


_BY_STATUS: dict[int, type[ApiError]] = {
    401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 410: Gone, 422: Invalid, 429: TooManyRequests,
}


def error_for(
    status: int, body: str, *, method: str, path: str, headers: Mapping[str, str] | None = None
) -> ApiError:
    cls = _BY_STATUS.get(status, ApiError)
    return cls(status, body, method=method, path=path, headers=headers)
