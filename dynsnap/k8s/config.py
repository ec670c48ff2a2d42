"""Where the API server is and who we are to it (layer: k8s).

Three ways to build a kubernetes_asyncio ``Configuration``:

- a kubeconfig file (``Kube.from_kubeconfig``; kubernetes_asyncio reads it);
- a bearer token (literal or a file) + server URL + CA file (``token_configuration``): what the
  tests use with tokens from the TokenRequest API, and what a process given a token uses;
- in-cluster (``in_cluster_configuration``): the pod's service-account directory (``token``,
  ``ca.crt``, ``namespace``) and ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT``.

Tokens from a file are re-read whenever the file changes: projected service-account tokens are
bound and expire (kubelet rewrites them at 80% of their lifetime), so a long-lived process that
read its token once would start failing with 401 after about an hour. The check is one ``stat``
per request; the file is read again only when its inode, mtime or size moved (kubelet swaps the
whole directory through a symlink, which changes the inode).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client as k8s_client

from dynsnap.k8s.errors import ConfigError

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
HOST_ENV = "KUBERNETES_SERVICE_HOST"
PORT_ENV = "KUBERNETES_SERVICE_PORT"


class TokenFile:
    """A bearer token file, re-read when it changes."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.reads = 0
        self._sig: tuple[int, int, int] | None = None
        self._token = ""
        self.current()  # fail now, not at the first request, if the file is missing or empty

    def current(self) -> str:
        try:
            st = self.path.stat()
        except OSError as e:
            if self._token:  # mid-rotation the path can vanish for an instant: keep the last good token
                log.warning("token file %s: %s; keeping the token read before", self.path, e)
                return self._token
            raise ConfigError(f"token file {self.path}: {e}") from e
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig != self._sig:
            token = self.path.read_text().strip()
            if not token:
                if self._token:
                    return self._token
                raise ConfigError(f"token file {self.path} is empty")
            self._token, self._sig = token, sig
            self.reads += 1
        return self._token


def token_configuration(
    *, server: str, token: str | None = None, token_file: Path | str | None = None, ca_cert: Path | str | None = None
) -> tuple[k8s_client.Configuration, TokenFile | None]:
    """A Configuration authenticating with a bearer token (exactly one of ``token``/``token_file``)."""
    if (token is None) == (token_file is None):
        raise ConfigError("give exactly one of token= or token_file=")
    if ca_cert is not None and not Path(ca_cert).is_file():
        raise ConfigError(f"CA file {ca_cert} does not exist")
    cfg = k8s_client.Configuration()
    cfg.host = server.rstrip("/")
    if ca_cert is not None:
        cfg.ssl_ca_cert = str(ca_cert)
    cfg.api_key_prefix["BearerToken"] = "Bearer"
    source = TokenFile(token_file) if token_file is not None else None
    cfg.api_key["BearerToken"] = source.current() if source else token
    if source is not None:
        def refresh(configuration: Any) -> None:
            configuration.api_key["BearerToken"] = source.current()
        cfg.refresh_api_key_hook = refresh
    return cfg, source


@dataclass(frozen=True)
class InCluster:
    """What the service-account directory and the environment say."""

    server: str
    token_file: Path
    ca_cert: Path
    namespace: str | None


def join_host_port(host: str, port: str | int) -> str:
    """``host:port``, with an IPv6 literal bracketed (Go's net.JoinHostPort)."""
    host = host.strip()
    if (":" in host or "%" in host) and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def in_cluster(
    *, sa_dir: Path | str = SERVICE_ACCOUNT_DIR, host: str | None = None, port: str | int | None = None,
    environ: Mapping[str, str] | None = None,
) -> InCluster:
    """Read the in-cluster settings; ``host``/``port`` override the environment (tests point them anywhere)."""
    env = os.environ if environ is None else environ
    host = host if host is not None else env.get(HOST_ENV, "")
    port = port if port is not None else env.get(PORT_ENV, "")
    if not host or not str(port):
        raise ConfigError(f"not in a cluster: {HOST_ENV}/{PORT_ENV} unset or empty")
    sa = Path(sa_dir)
    token_file, ca = sa / "token", sa / "ca.crt"
    if not token_file.is_file():
        raise ConfigError(f"service-account token {token_file} does not exist")
    if not ca.is_file() or ca.stat().st_size == 0:
        raise ConfigError(f"service-account CA {ca} is missing or empty")
    ns_file = sa / "namespace"
    namespace = (ns_file.read_text().strip() or None) if ns_file.is_file() else None
    return InCluster(server=f"https://{join_host_port(host, port)}", token_file=token_file, ca_cert=ca,
                     namespace=namespace)
