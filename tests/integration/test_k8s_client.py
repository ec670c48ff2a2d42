"""``Kube`` against the real API server: delete preconditions, the retry policy under injected
faults (``fake_apiproxy``), and identities from the TokenRequest API used in-cluster style with
least-privilege RBAC."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from dynsnap.k8s import retry
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import ApiError, Conflict, Forbidden, NotFound, RetryExhausted, Unauthorized
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster
from dynsnap.testenv.controlplane import free_port
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault

pytestmark = pytest.mark.cluster


@pytest.fixture(autouse=True)
def instant_retries() -> Iterator[list[retry.RetryEvent]]:
    retry.set_instant(True)
    events: list[retry.RetryEvent] = []
    retry.add_hook(events.append)
    yield events
    retry.remove_hook(events.append)
    retry.set_instant(None)


@pytest.fixture
async def proxy(cluster: LocalCluster) -> AsyncIterator[FakeApiProxy]:
    assert cluster.cp is not None
    async with FakeApiProxy.in_front_of(cluster.cp) as p:
        yield p


def _admin_via(cluster: LocalCluster, server: str, *, retry_policy: retry.RetryPolicy = retry.DEFAULT) -> Kube:
    assert cluster.cp is not None and cluster.cp.pki is not None
    return Kube.from_token(server=server, token=cluster.cp.identities["admin"].token,
                           ca_cert=cluster.cp.pki.ca_cert, retry_policy=retry_policy)


def _cm(name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": TEST_NAMESPACE},
            "data": {"k": "v"}}


async def test_delete_with_uid_precondition_spares_a_recreated_object(cluster: LocalCluster) -> None:
    api = cluster.api
    name = f"pre-{uuid.uuid4().hex[:6]}"
    first = await api.create(R.CONFIG_MAPS, _cm(name))
    await api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
    second = await api.create(R.CONFIG_MAPS, _cm(name))
    # A delete meant for the first object must not take the second, which has the same name.
    with pytest.raises(Conflict):
        await api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE, uid=first["metadata"]["uid"])
    still = await api.get(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
    assert still["metadata"]["uid"] == second["metadata"]["uid"]
    # A stale resourceVersion is refused the same way; the right uid and version delete it.
    await api.merge_patch(R.CONFIG_MAPS, name, {"data": {"k": "w"}}, namespace=TEST_NAMESPACE)
    with pytest.raises(Conflict):
        await api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE, uid=second["metadata"]["uid"],
                         resource_version=second["metadata"]["resourceVersion"])
    await api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE, uid=second["metadata"]["uid"])
    with pytest.raises(NotFound):
        await api.get(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)


async def test_retry_honours_retry_after_then_succeeds(cluster: LocalCluster, proxy: FakeApiProxy,
                                                       instant_retries: list[retry.RetryEvent]) -> None:
    name = f"ra-{uuid.uuid4().hex[:6]}"
    await cluster.api.create(R.CONFIG_MAPS, _cm(name))
    proxy.add(Fault("respond", status=429, headers={"Retry-After": "2"}, times=2, path_contains=name))
    async with _admin_via(cluster, proxy.url) as kube:
        got = await kube.get(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
    assert got["metadata"]["name"] == name
    assert len(proxy.seen(method="GET", path_contains=name)) == 3
    # The delays the policy chose are the server's 2 s (our own backoff would be under 0.4 s).
    assert [(e.policy, e.attempt, e.delay) for e in instant_retries] == [("k8s-request", 1, 2.0),
                                                                         ("k8s-request", 2, 2.0)]
    await cluster.api.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)


async def test_retry_gives_up_on_a_permanent_503_with_a_named_error(cluster: LocalCluster, proxy: FakeApiProxy,
                                                                    instant_retries: list[retry.RetryEvent]) -> None:
    proxy.add(Fault("respond", status=503, times=None, path_contains="/configmaps/"))
    policy = retry.RetryPolicy("test-503", attempts=4, timeout=60.0)
    async with _admin_via(cluster, proxy.url, retry_policy=policy) as kube:
        with pytest.raises(RetryExhausted) as err:
            await kube.get(R.CONFIG_MAPS, "anything", namespace=TEST_NAMESPACE)
    assert err.value.policy == "test-503" and err.value.attempts == 4
    assert getattr(err.value.last, "status", None) == 503
    assert len(proxy.seen(path_contains="/configmaps/")) == 4
    assert [e.gave_up for e in instant_retries] == [False, False, False, True]


async def test_client_errors_are_never_retried(cluster: LocalCluster, proxy: FakeApiProxy,
                                               instant_retries: list[retry.RetryEvent]) -> None:
    name = f"nr-{uuid.uuid4().hex[:6]}"
    async with _admin_via(cluster, proxy.url) as kube:
        with pytest.raises(NotFound):
            await kube.get(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
        await kube.create(R.CONFIG_MAPS, _cm(name))
        with pytest.raises(Conflict):
            await kube.create(R.CONFIG_MAPS, _cm(name))
        proxy.add(Fault("respond", status=501, path_contains=name))
        with pytest.raises(ApiError) as err:
            await kube.get(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
        assert err.value.status == 501
        await kube.delete(R.CONFIG_MAPS, name, namespace=TEST_NAMESPACE)
    # GET 404, POST, POST 409, GET 501, DELETE: each asked once.
    assert [s.method for s in proxy.requests] == ["GET", "POST", "POST", "GET", "DELETE"]
    assert instant_retries == []


async def test_connection_resets_and_refusals_are_retried(cluster: LocalCluster, proxy: FakeApiProxy,
                                                          instant_retries: list[retry.RetryEvent]) -> None:
    async with _admin_via(cluster, proxy.url) as kube:
        proxy.refuse_next(2)
        got = await kube.get(R.NAMESPACES, TEST_NAMESPACE)
        assert got["metadata"]["name"] == TEST_NAMESPACE
        proxy.add(Fault("reset", path_contains="/namespaces/", times=2))
        await kube.get(R.NAMESPACES, TEST_NAMESPACE)
    # The refused two never sent a request; of the reset ones aiohttp itself resends an idempotent
    # request once, so the policy saw one failure out of two resets.
    assert len(instant_retries) == 3 and [s.fault for s in proxy.requests] == [None, "reset", "reset", None]
    assert all(isinstance(e.error, aiohttp.ClientError) for e in instant_retries)
    # Nothing listens on a fresh port: a real ECONNREFUSED, retried until the policy's cap.
    async with _admin_via(cluster, f"https://127.0.0.1:{free_port()}",
                          retry_policy=retry.RetryPolicy("test-refused", attempts=3)) as kube:
        with pytest.raises(RetryExhausted) as err:
            await kube.get(R.NAMESPACES, TEST_NAMESPACE)
    assert isinstance(err.value.last, aiohttp.ClientConnectorError) and err.value.attempts == 3


async def _service_account_with_role(api: Kube, name: str) -> None:
    """A ServiceAccount that may read ConfigMaps in the test namespace, and nothing else."""
    ns = TEST_NAMESPACE
    await api.create(R.SERVICE_ACCOUNTS, {"metadata": {"name": name, "namespace": ns}})
    await api.apply(R.ROLES, {"metadata": {"name": name, "namespace": ns}, "rules": [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]})
    await api.apply(R.ROLE_BINDINGS, {
        "metadata": {"name": name, "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]})


def _write_sa_dir(directory: Path, *, token: str, ca: Path) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "token").write_text(token)
    (directory / "ca.crt").write_bytes(ca.read_bytes())
    (directory / "namespace").write_text(TEST_NAMESPACE)


def _rotate(path: Path, text: str) -> None:
    """Replace the file atomically, as kubelet's atomic writer does."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_in_cluster_with_a_token_request_token_and_least_privilege(cluster: LocalCluster,
                                                                         tmp_path: Path) -> None:
    api = cluster.api
    assert cluster.cp is not None and cluster.cp.pki is not None
    sa, other = f"sa-{uuid.uuid4().hex[:6]}", f"sa-{uuid.uuid4().hex[:6]}"
    await _service_account_with_role(api, sa)
    await api.create(R.SERVICE_ACCOUNTS, {"metadata": {"name": other, "namespace": TEST_NAMESPACE}})
    cm = f"ic-{uuid.uuid4().hex[:6]}"
    await api.create(R.CONFIG_MAPS, _cm(cm))
    token = await api.request_token(sa, namespace=TEST_NAMESPACE, expiration_seconds=600)
    sa_dir = tmp_path / "serviceaccount"
    _write_sa_dir(sa_dir, token=token, ca=cluster.cp.pki.ca_cert)
    url = urlsplit(cluster.cp.url)
    assert url.hostname and url.port

    async with Kube.in_cluster(sa_dir=sa_dir, host=url.hostname, port=url.port) as kube:
        assert kube.namespace == TEST_NAMESPACE
        got = await kube.get(R.CONFIG_MAPS, cm, namespace=kube.namespace)
        assert got["data"] == {"k": "v"}
        # What the Role does not grant is refused: least privilege holds.
        with pytest.raises(Forbidden):
            await kube.list(R.PODS, namespace=TEST_NAMESPACE)
        with pytest.raises(Forbidden):
            await kube.create(R.CONFIG_MAPS, _cm(f"{cm}-x"))
        # The token file is re-read when it changes (kubelet rotates bound tokens): another
        # account's token, without the Role, is refused; a garbage token is unknown.
        _rotate(sa_dir / "token", await api.request_token(other, namespace=TEST_NAMESPACE))
        with pytest.raises(Forbidden):
            await kube.get(R.CONFIG_MAPS, cm, namespace=TEST_NAMESPACE)
        _rotate(sa_dir / "token", "not-a-token")
        with pytest.raises(Unauthorized):
            await kube.get(R.CONFIG_MAPS, cm, namespace=TEST_NAMESPACE)
        _rotate(sa_dir / "token", token)
        assert (await kube.get(R.CONFIG_MAPS, cm, namespace=TEST_NAMESPACE))["data"] == {"k": "v"}
        assert kube.token_file is not None and kube.token_file.reads == 4

    # The same token through from_token, the way later tests run the agent and controller.
    async with Kube.from_token(server=cluster.cp.url, token=token, ca_cert=cluster.cp.pki.ca_cert) as kube:
        assert (await kube.get(R.CONFIG_MAPS, cm, namespace=TEST_NAMESPACE))["metadata"]["name"] == cm
    await api.delete(R.CONFIG_MAPS, cm, namespace=TEST_NAMESPACE)
    for name in (sa, other):
        await api.delete(R.SERVICE_ACCOUNTS, name, namespace=TEST_NAMESPACE)
    await api.delete(R.ROLE_BINDINGS, sa, namespace=TEST_NAMESPACE)
    await api.delete(R.ROLES, sa, namespace=TEST_NAMESPACE)
