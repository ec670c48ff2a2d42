"""What the agent-refusal tests (node/test_agent_refusals.py, node/test_agent_ranks.py and others) need
beyond agentenv.py: WorkerSnapshot bodies the API accepts but the agent must refuse, a library named
like NCCL's for a worker's two GPU processes to map, what a worker looks like from the node (what a
process maps, the stub driver's calls), its own Dynamo metrics, the agent's scrapes of them as the
node's TCP table shows them, and a long streamed chat request pinned to one worker.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import worker_ids_from
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.dynsnap_parts import AgentProc, StubDriver

# The NCCL settings under which the CUDA driver restored two checkpointed ranks (DESIGN.md section 2),
# spelled out here rather than imported from the agent, so the test checks the agent's list.
NCCL_SAFE = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}
# The driver calls that change a process's checkpoint state: none may happen on a refused capture.
STATE_CHANGING_CALLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                        "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")


def build_fake_nccl(out: Path) -> Path:
    """fake_nccl: an empty shared library named ``libnccl.so.2``. It stands in for NCCL's library (not
    installable here, and nothing of it would run without a GPU): the agent tells a process uses NCCL
    only by the library it maps, so a file of that name, preloaded, is what a rank looks like."""
    out.mkdir(parents=True, exist_ok=True)
    src = out / "fake_nccl.c"
    src.write_text("/* fake_nccl: stands in for NCCL's libnccl.so.2 (only its mapped name matters). */\n"
                   "int dynsnap_fake_nccl;\n")
    lib = out / "libnccl.so.2"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(lib), str(src)], check=True)
    return lib


def hostile_ws(*, name: str, namespace: str, node: str, pod_name: str, pod_uid: str, tier: str = "snapshot",
               desired: str = "Active") -> Obj:
    """A WorkerSnapshot as anyone with create rights could write it: no owner reference (an owner in
    another namespace, or one that is not the pod, would have the garbage collector delete it)."""
    return {"apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
            "metadata": {"name": name, "namespace": namespace, "labels": {P.LABEL_NODE: node}},
            "spec": {"podName": pod_name, "podUID": pod_uid, "container": P.DEFAULT_CONTAINER, "tier": tier,
                     "desiredState": desired}}


def condition(ws: Obj, ctype: str) -> Obj:
    cond: Obj | None = next((c for c in (ws.get("status") or {}).get("conditions") or [] if c["type"] == ctype),
                            None)
    assert cond is not None, f"no {ctype} condition in {ws.get('status')}"
    return cond


async def wait_ws_at(api: Kube, namespace: str, name: str, what: str, check: Callable[[Obj], bool], *,
                     timeout: float = 90, agents: list[AgentProc] | None = None) -> Obj:
    """The WorkerSnapshot namespace/name once ``check`` holds; on timeout its last status and the agents'
    log tails are printed."""
    async def probe() -> Obj | None:
        with contextlib.suppress(NotFound):
            ws = await api.get(R.WORKER_SNAPSHOTS, name, namespace=namespace)
            return ws if check(ws) else None
        return None
    try:
        ws: Obj = await wait_for(f"WorkerSnapshot {namespace}/{name}: {what}", probe, timeout=timeout, interval=0.2)
    except TimeoutError:
        with contextlib.suppress(NotFound):
            last = await api.get(R.WORKER_SNAPSHOTS, name, namespace=namespace)
            print("LAST STATUS:", json.dumps(last.get("status"), indent=1))
        for a in agents or []:
            print(f"--- {a.node} agent log ---\n{a.tail(80)}")
        raise
    return ws


def observed(generation: int) -> Callable[[Obj], bool]:
    """The agent has written status for this generation of the spec (or a later one)."""
    def check(ws: Obj) -> bool:
        return int((ws.get("status") or {}).get("observedGeneration") or 0) >= generation
    return check


def last_error_is(reason: str, *, containing: str = "") -> Callable[[Obj], bool]:
    def check(ws: Obj) -> bool:
        err = (ws.get("status") or {}).get("lastError") or {}
        return err.get("reason") == reason and containing in str(err.get("message", ""))
    return check


def refused_or_capturing(reason: str, *, containing: str = "") -> Callable[[Obj], bool]:
    """Refused for ``reason``, or past the point where it should have been: a capture under way or
    done. The test asserts which, so an agent that does not refuse fails at once, with its status."""
    refused = last_error_is(reason, containing=containing)

    def check(ws: Obj) -> bool:
        return refused(ws) or (ws.get("status") or {}).get("state") in (P.ObservedState.CAPTURING.value,
                                                                         P.ObservedState.SUSPENDED.value)
    return check


def _status(pid: int) -> dict[str, str]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def maps(pid: int) -> set[str]:
    """Base names of the files a process maps."""
    with contextlib.suppress(OSError):
        return {os.path.basename(line.split()[-1]) for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if len(line.split()) >= 6}
    return set()


def state_changes_since(driver: StubDriver, mark: int) -> list[str]:
    """The stub driver's state-changing calls logged after the first ``mark`` lines."""
    return [c for c in driver.calls()[mark:] if c.split(" ", 1)[0] in STATE_CHANGING_CALLS]


async def worker_metrics(pod: D.HasIP, *, port: int = P.DYNAMO_SYSTEM_PORT) -> str:
    async with httpx.AsyncClient(timeout=5.0) as http:
        r = await http.get(f"http://{pod.ip}:{port}/metrics")
        r.raise_for_status()
        return r.text


def metric_names(text: str) -> list[str]:
    """The metric families a Prometheus text page declares (its ``# TYPE`` lines)."""
    return sorted({line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")})


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _hex_addr(ip: str, port: int) -> str:
    return "".join(f"{int(b):02X}" for b in reversed(ip.split("."))) + f":{port:04X}"


def connections_to(ip: str, port: int, *, netns_of: int | str = "self") -> set[str]:
    """Local ends of the TCP sockets to ip:port, in any state, of the network namespace of process
    ``netns_of`` (default this one's: the node's, where the sandboxes' agents run; the real node's agent
    pod has its own). The agent opens one connection per scrape and closes it first, so each scrape
    leaves a socket there (TIME_WAIT, 60 s; not reused for connections off loopback)."""
    want = _hex_addr(ip, port)
    out = set()
    for line in Path(f"/proc/{netns_of}/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[2] == want:
            out.add(parts[1])
    return out


@dataclass
class StreamedChat:
    """One streamed chat completion, pinned to a worker through the frontend."""

    status: int = 0
    chunks: int = 0
    text: str = ""
    worker_ids: set[int] = field(default_factory=set)
    finish_reason: str | None = None
    done: bool = False  # the stream ended with [DONE]


async def stream_chat(fe: D.FrontendClient, *, worker_id: int, max_tokens: int, started: asyncio.Event,
                      timeout: float = 300) -> StreamedChat:
    """Send a streamed chat request pinned to ``worker_id``; ``started`` is set at its first content
    chunk (the worker is generating it). Returns when the stream ends, bounded by ``timeout``."""
    body = {"model": D.MODEL_NAME, "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": max_tokens, "stream": True, "nvext": {"extra_fields": ["worker_id"]}}
    headers = {P.HEADER_WORKER_INSTANCE_ID: str(worker_id)}
    out = StreamedChat()
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http, \
            http.stream("POST", f"{fe.base}/v1/chat/completions", json=body, headers=headers) as r:
        out.status = r.status_code
        async for line in r.aiter_lines():
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream pinned to {worker_id} still running after {timeout:.0f}s")
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                out.done = True
                break
            chunk = json.loads(data)
            wid, _ = worker_ids_from(chunk)
            if wid is not None:
                out.worker_ids.add(int(wid))
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    out.chunks += 1
                    out.text += piece
                    started.set()
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    return out
