"""Connection configuration: in-cluster files and environment, token rotation, IPv6 hosts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynsnap.k8s.config import TokenFile, in_cluster, join_host_port, token_configuration
from dynsnap.k8s.errors import ConfigError


def _sa_dir(tmp_path: Path, *, token: str = "tok-1", namespace: str | None = "dynamo") -> Path:
    d = tmp_path / "sa"
    d.mkdir()
    (d / "token").write_text(token + "\n")
    (d / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n...\n")
    if namespace is not None:
        (d / "namespace").write_text(namespace)
    return d


def test_join_host_port_brackets_ipv6() -> None:
    assert join_host_port("10.96.0.1", 443) == "10.96.0.1:443"
    assert join_host_port("fd00::1", "6443") == "[fd00::1]:6443"
    assert join_host_port("[fd00::1]", 443) == "[fd00::1]:443"
    assert join_host_port("fe80::1%eth0", 443) == "[fe80::1%eth0]:443"
    assert join_host_port("kubernetes.default.svc", 443) == "kubernetes.default.svc:443"


def test_in_cluster_reads_the_directory_and_the_environment(tmp_path: Path) -> None:
    d = _sa_dir(tmp_path)
    ic = in_cluster(sa_dir=d, environ={"KUBERNETES_SERVICE_HOST": "fd00:10:96::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert ic.server == "https://[fd00:10:96::1]:443"
    assert ic.namespace == "dynamo" and ic.token_file == d / "token" and ic.ca_cert == d / "ca.crt"
    # Explicit host/port win over the environment.
    assert in_cluster(sa_dir=d, host="127.0.0.1", port=6443, environ={}).server == "https://127.0.0.1:6443"


def test_in_cluster_refuses_what_is_missing(tmp_path: Path) -> None:
    d = _sa_dir(tmp_path, namespace=None)
    with pytest.raises(ConfigError, match="not in a cluster"):
        in_cluster(sa_dir=d, environ={})
    with pytest.raises(ConfigError, match="not in a cluster"):
        in_cluster(sa_dir=d, environ={"KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": "443"})
    assert in_cluster(sa_dir=d, host="h", port=1, environ={}).namespace is None
    (d / "ca.crt").write_text("")
    with pytest.raises(ConfigError, match="CA"):
        in_cluster(sa_dir=d, host="h", port=1, environ={})
    with pytest.raises(ConfigError, match="token"):
        in_cluster(sa_dir=tmp_path / "nowhere", host="h", port=1, environ={})


def test_token_file_is_reread_when_rotated(tmp_path: Path) -> None:
    d = _sa_dir(tmp_path)
    tf = TokenFile(d / "token")
    assert tf.current() == "tok-1" and tf.current() == "tok-1" and tf.reads == 1
    # kubelet's atomic writer: a new file renamed over the old one.
    (d / "new").write_text("tok-2-longer")
    os.replace(d / "new", d / "token")
    assert tf.current() == "tok-2-longer" and tf.reads == 2
    # Mid-rotation the path may vanish for an instant, or be empty: keep the last good token.
    (d / "token").unlink()
    assert tf.current() == "tok-2-longer"
    (d / "token").write_text("")
    assert tf.current() == "tok-2-longer"
    with pytest.raises(ConfigError):
        TokenFile(tmp_path / "missing")


def test_token_configuration_sets_a_refreshing_bearer(tmp_path: Path) -> None:
    d = _sa_dir(tmp_path)
    cfg, source = token_configuration(server="https://127.0.0.1:6443/", token_file=d / "token",
                                      ca_cert=d / "ca.crt")
    assert cfg.host == "https://127.0.0.1:6443" and source is not None
    assert cfg.api_key["BearerToken"] == "tok-1" and cfg.api_key_prefix["BearerToken"] == "Bearer"
    (d / "new").write_text("tok-rotated")
    os.replace(d / "new", d / "token")
    cfg.refresh_api_key_hook(cfg)  # type: ignore[operator,misc]  # typed there as "None or a coroutine"
    assert cfg.api_key["BearerToken"] == "tok-rotated"
    literal, none = token_configuration(server="https://h:1", token="abc")
    assert literal.api_key["BearerToken"] == "abc" and none is None and literal.refresh_api_key_hook is None
    with pytest.raises(ConfigError):
        token_configuration(server="https://h:1")
    with pytest.raises(ConfigError):
        token_configuration(server="https://h:1", token="a", token_file=d / "token")
    with pytest.raises(ConfigError):
        token_configuration(server="https://h:1", token="a", ca_cert=tmp_path / "no-ca.crt")
