"""CRIU's network lock, cleared where a dump left it: ``--network-lock nftables`` makes a table ``inet
CRIU-<run id>`` in the worker's network namespace whose rules drop the packets of the connections it dumps.
A dump that finishes keeps it until the restore unlocks (the connections must not be reset while the tree
sleeps); a dump that fails unlocks it itself; a dump cut off (CRIU killed by the pod, by its bound, by the
OOM killer) leaves it, and the worker's locked connections are then blackholed for good: seen here, a dump
killed 0.3 s in left its table, and the worker's own loopback connection stalled.

Layer: ``dynsnap.agent``. The agent's ``nft`` runs in the worker's network namespace alone, through
dynsnap-nsexec (nsexec.py): never its mount namespace. Called only where no dump of the worker completed:
after a dump that did not finish, and before a dump starts over from one that was cut off.
"""

from __future__ import annotations

import json
import logging
from typing import Final

from dynsnap.agent.nsexec import NSEXEC, ForeignNamespace, Target, TargetChanged, run_in
from dynsnap.runtime.command import CommandError, find_tool

log = logging.getLogger(__name__)

TABLE_PREFIX: Final = "CRIU"  # CRIU's own: "inet CRIU-<run id>" (criu/netfilter.c)
TIMEOUT: Final = 10.0
OUTPUT_BOUND: Final = 1 << 20  # nft's JSON of one namespace's tables: a pod's own could be large


def criu_tables(listing: str) -> list[str]:
    """The names of CRIU's tables (family inet, named CRIU or CRIU-...) in ``nft -j list tables`` output;
    ValueError when it is no such output."""
    doc = json.loads(listing[:OUTPUT_BOUND])
    out = []
    for item in doc.get("nftables", []) if isinstance(doc, dict) else []:
        table = item.get("table") if isinstance(item, dict) else None
        if not isinstance(table, dict) or table.get("family") != "inet":
            continue
        name = table.get("name")
        if isinstance(name, str) and (name == TABLE_PREFIX or name.startswith(TABLE_PREFIX + "-")) \
                and name.replace("-", "").isalnum():
            out.append(name)
    return out


async def clear(target: Target, *, nsexec: str = NSEXEC) -> list[str]:
    """Delete CRIU's tables from the network namespace of ``target`` (the worker's PID 1); the names deleted.
    Best effort: what cannot be listed or deleted is logged and left (the caller's failure stands)."""
    try:
        nft = find_tool("nft")
    except FileNotFoundError:
        log.warning("no nft on the agent's PATH: CRIU's network lock, if a cut-off dump left one, stays")
        return []
    try:
        res = await run_in(target, [nft, "-j", "list", "tables"], timeout=TIMEOUT, namespaces=("net",),
                           nsexec=nsexec)
        names = criu_tables(res.stdout) if res.returncode == 0 else []
        if res.returncode != 0:
            log.warning("nft list tables in the worker's network namespace: %s", res.stderr.strip()[-300:])
        deleted = []
        for name in names:
            res = await run_in(target, [nft, "delete", "table", "inet", name], timeout=TIMEOUT, namespaces=("net",),
                               nsexec=nsexec)
            if res.returncode == 0:
                deleted.append(name)
            else:
                log.warning("nft delete table inet %s: %s", name, res.stderr.strip()[-300:])
        if deleted:
            log.warning("removed CRIU's network lock left by a dump that did not finish: %s", deleted)
        return deleted
    except (CommandError, ForeignNamespace, TargetChanged, OSError, ValueError) as e:
        log.warning("CRIU's network lock in the worker's network namespace: %s", e)
        return []
