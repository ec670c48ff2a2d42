"""Where a real node's start goes (dynsnap/testenv/chart_node.py ``start``, which every real-node suite
and the demo pay once): the control plane, the node itself (containerd, kubelet Ready), each local
image's import into containerd, ``helm install`` until the chart's pods are Ready; then its stop.

From the repository root, as root, with the environment of `./run env` (its own bridge and /16):

    $DYNSNAP_VENV/bin/python bench/real_node/node_start.py [--rounds N]

Prints one line per part and round, then the median of each part over the rounds. Every wait is the
harness's own, bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # the repository's dynsnap, run as a script

from dynsnap.testenv import chart_node  # noqa: E402
from dynsnap.testenv.cluster import LocalCluster  # noqa: E402
from dynsnap.testenv.netns import SandboxNetwork  # noqa: E402
from dynsnap.testenv.node import RealNode  # noqa: E402

BRIDGE, CIDR = "dsntime0", "10.215.0.0/16"
T = TypeVar("T")


class Clock:
    """Each timed call's seconds under its part's name, for the current round."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = defaultdict(list)
        self.spans: list[tuple[str, tuple[float, float]]] = []  # this round's (part, (start, end))

    def wrap(self, name: Callable[..., str], fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        async def timed(*args: Any, **kwargs: Any) -> T:
            t0 = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                part = name(*args, **kwargs)
                self.parts[part].append(time.monotonic() - t0)
                self.spans.append((part, (t0, time.monotonic())))
                print(f"  {part}: {time.monotonic() - t0:.2f} s", flush=True)
        return timed


async def one_round(clock: Clock) -> None:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-node-start-"))
    cluster = LocalCluster(work / "cluster", net=SandboxNetwork(bridge=BRIDGE, cidr=CIDR), fake_nodes=False)
    t0 = time.monotonic()
    await cluster.start()
    clock.parts["control plane"].append(time.monotonic() - t0)
    try:
        clock.spans.clear()
        t_start = time.monotonic()
        env = await chart_node.start(cluster, work, gpus=2)
        clock.parts["chart_node.start in all (node, imports, helm install)"].append(time.monotonic() - t_start)
        # The local images are imported side by side: the wall time from the first one's start to the last
        # one's end (the pause image, imported by the node before kubelet starts, is not among them).
        local = [span for part, span in clock.spans if part.startswith("import dynsnap-")]
        clock.parts["the local images' imports, side by side (wall)"].append(
            max(end for _, end in local) - min(begin for begin, _ in local))
        t0 = time.monotonic()
        problems = await chart_node.stop(env)
        clock.parts["stop (graphs, helm uninstall, node)"].append(time.monotonic() - t0)
        assert not problems, problems
    finally:
        await cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    rounds = ap.parse_args().rounds
    clock = Clock()
    RealNode.start = clock.wrap(lambda self: "node (containerd, pause image, kubelet Ready)",  # type: ignore[method-assign,assignment]
                                RealNode.start)
    RealNode.import_image = clock.wrap(  # type: ignore[method-assign,assignment]
        lambda self, layout, *a, **k: f"import {Path(layout).name}", RealNode.import_image)
    chart_node._install = clock.wrap(lambda *a, **k: "helm install, chart pods Ready",  # type: ignore[assignment]
                                     chart_node._install)
    for r in range(rounds):
        print(f"round {r + 1}", flush=True)
        asyncio.run(one_round(clock))
    print("median over rounds:")
    for part, secs in clock.parts.items():
        print(f"  {statistics.median(secs):7.2f} s  {part}  ({', '.join(f'{s:.2f}' for s in secs)})")


if __name__ == "__main__":
    main()
