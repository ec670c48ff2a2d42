"""What the agent's integration tests share beyond dynsnap/testenv/dynsnap_parts.py: waiting on a
WorkerSnapshot's status, reading a process's TCP connections.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.dynsnap_parts import (  # noqa: F401 (re-exported for the tests)
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    PodOnNode,
    StubDriver,
    build_stub_driver,
    install_dynsnap,
    set_desired,
    token_kubeconfig,
    ws_body,
)


def condition(ws: Obj, ctype: str) -> Obj | None:
    return next((c for c in (ws.get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


async def wait_ws(api: Kube, pod: PodOnNode, what: str, check: Callable[[Obj], bool], *, timeout: float = 90,
                  agents: list[AgentProc] | None = None) -> Obj:
    async def probe() -> Obj | None:
        with contextlib.suppress(NotFound):
            ws = await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
            return ws if check(ws) else None
        return None
    try:
        ws: Obj = await wait_for(f"WorkerSnapshot {pod.name}: {what}", probe, timeout=timeout, interval=0.2)
    except TimeoutError:
        with contextlib.suppress(NotFound):
            last = await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
            print("LAST STATUS:", yaml.safe_dump(last.get("status")))
        for a in agents or []:
            print(f"--- {a.node} agent log ---\n{a.tail(80)}")
        raise
    return ws


def state_is(state: str, *, suspended: bool | None = None) -> Callable[[Obj], bool]:
    def check(ws: Obj) -> bool:
        st = ws.get("status") or {}
        if st.get("state") != state:
            return False
        if suspended is None:
            return True
        cond = condition(ws, "Suspended")
        return cond is not None and cond["status"] == ("True" if suspended else "False")
    return check


def _hex_addr(ip: str, port: int) -> str:
    return "".join(f"{int(b):02X}" for b in reversed(ip.split("."))) + f":{port:04X}"


def tcp_established(pid: int, *, remote: tuple[str, int] | None = None) -> set[tuple[str, str]]:
    """ESTABLISHED TCP connections in ``pid``'s network namespace (local, remote as /proc's hex
    addr:port), only those to ``remote`` (ip, port) when given."""
    want = _hex_addr(*remote) if remote else None
    out = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[3] == "01" and (want is None or parts[2] == want):
            out.add((parts[1], parts[2]))
    return out


async def eventually(what: str, check: Callable[[], Awaitable[Any]], timeout: float = 60) -> Any:
    return await wait_for(what, check, timeout=timeout)
