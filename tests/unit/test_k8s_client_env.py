"""The API client reads the proxy environment once, when it is built (dynsnap.k8s.client): the proxy
HTTPS_PROXY names for the API server, unless NO_PROXY excludes it, goes with every request, and the
aiohttp session no longer looks up the environment and ~/.netrc per request (two thread hops each:
a sixth of the controller's CPU at 10,000 workers, bench/scale)."""

from __future__ import annotations

import pytest

from dynsnap.k8s.client import Kube

SERVER = "https://10.1.2.3:6443"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy",
                "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


async def built() -> tuple[str | None, bool]:
    kube = Kube.from_token(server=SERVER, token="t")
    try:
        rest = kube._api.rest_client
        return rest.proxy, rest.pool_manager.trust_env
    finally:
        await kube.close()


async def test_the_environments_proxy_for_the_api_server_is_taken_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert await built() == ("http://proxy.example:3128", False)


async def test_no_proxy_excludes_the_api_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "10.1.2.3,localhost")
    assert await built() == (None, False)


async def test_without_a_proxy_nothing_is_read_per_request() -> None:
    assert await built() == (None, False)
