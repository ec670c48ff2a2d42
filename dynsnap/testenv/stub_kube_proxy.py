"""stub_kube_proxy: stands in for kube-proxy on the real node, for the one Service its pods need,
``default/kubernetes`` (the API server): a CNI plugin, chained after the bridge plugin, that puts a
DNAT rule for the Service's cluster IP and port into each pod's own network namespace.

Layer: ``dynsnap.testenv`` (test harness only). Run by containerd's CNI as a program (stdlib only,
``python -I``); ``install`` puts it into a node's CNI bin directory and ``plugin_config`` is its
entry in the node's conflist (node_config.py).

Why a stand-in: kubelet gives every container ``KUBERNETES_SERVICE_HOST``/``_PORT`` (the Service's
cluster IP, 10.96.0.1:443 here) and in-cluster clients (dynsnap's controller and agent, Dynamo's
discovery) connect there; in a cluster kube-proxy rewrites that address to the API server's. The real
kube-proxy would write the host's own iptables or nftables rules on a machine other sessions share,
and a pod spec that named the API server's address itself would not be the pod a user runs. Here
the rewrite happens where the pod's packets start, in its own network namespace, which the pod's
own teardown removes: a socket in the pod still sees the Service's address as its peer (conntrack
rewrites the packets, not the socket), as under kube-proxy.

CNI (spec 1.0): ADD adds the rules (once) and passes the previous plugin's result on; DEL, CHECK
and the rest have nothing to undo (the rules live and die with the namespace). Every command is
bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PLUGIN = "dynsnap-stub-kube-proxy"
VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0"]
_TIMEOUT = 10.0


def plugin_config(*, cluster_ip: str, port: int, endpoint: str, iptables: str, nsenter: str) -> dict[str, Any]:
    """The conflist entry: the ``kubernetes`` Service at ``cluster_ip:port`` served by ``endpoint``
    (``ip:port``, the API server on the run's bridge)."""
    return {"type": PLUGIN, "iptables": iptables, "nsenter": nsenter,
            "services": [{"name": "default/kubernetes", "clusterIP": cluster_ip, "port": port,
                          "endpoint": endpoint}]}


def install(bin_dir: Path, *, python: str = sys.executable) -> Path:
    """This plugin in ``bin_dir`` (a node's CNI bin directory) under the name its config's ``type`` says."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / PLUGIN
    path.write_text(f'#!/bin/sh\nexec {python} -I {Path(__file__).resolve()} "$@"\n')
    path.chmod(0o755)
    return path


def _rule(svc: dict[str, Any]) -> list[str]:
    return ["-t", "nat", "OUTPUT", "-d", f"{svc['clusterIP']}/32", "-p", "tcp", "-m", "tcp",
            "--dport", str(int(svc["port"])), "-j", "DNAT", "--to-destination", str(svc["endpoint"])]


def _iptables(conf: dict[str, Any], netns: str, op: str, rule: list[str]) -> subprocess.CompletedProcess[str]:
    table, chain, rest = rule[:2], rule[2], rule[3:]
    argv = [conf["nsenter"], f"--net={netns}", "--", conf["iptables"], "-w", "5", *table, op, chain, *rest]
    return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT, check=False)


def add(conf: dict[str, Any], netns: str) -> None:
    if not netns:
        raise RuntimeError("CNI_NETNS is empty: no pod network namespace to add the Service rules to")
    for svc in conf.get("services") or []:
        rule = _rule(svc)
        if _iptables(conf, netns, "-C", rule).returncode == 0:
            continue  # added before (ADD repeated)
        res = _iptables(conf, netns, "-A", rule)
        if res.returncode != 0:
            raise RuntimeError(f"iptables in {netns} for {svc['name']}: {res.stderr.strip()[-400:]}")


def _error(version: str, msg: str) -> int:
    # 999: a plugin's own failure (codes below 100 are the spec's).
    print(json.dumps({"cniVersion": version, "code": 999, "msg": msg}))
    return 1


def main() -> int:
    command = os.environ.get("CNI_COMMAND", "")
    if command == "VERSION":
        print(json.dumps({"cniVersion": VERSIONS[-1], "supportedVersions": VERSIONS}))
        return 0
    raw = sys.stdin.read()
    try:
        conf = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        return _error(VERSIONS[-1], f"{PLUGIN}: its config is not JSON: {e}")
    version = str(conf.get("cniVersion") or VERSIONS[-1])
    if command != "ADD":
        return 0  # DEL, CHECK, GC, STATUS: the rules go with the network namespace
    try:
        add(conf, os.environ.get("CNI_NETNS", ""))
    except (RuntimeError, OSError, subprocess.TimeoutExpired, KeyError, TypeError, ValueError) as e:
        return _error(version, f"{PLUGIN}: {e}")
    # A chained plugin returns the result it was given (the bridge plugin's interfaces and IPs).
    print(json.dumps({"cniVersion": version, **(conf.get("prevResult") or {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
