"""Command line (top layer):

    dynsnap demo                         local control plane + Dynamo: a full suspend -> wake -> verify cycle
    dynsnap crd                          print dynsnap's CRDs, generated from the models
    dynsnap agent [options]              the node agent (one per node)
    dynsnap agent exec ... capture|wake  one capture or wake of one worker here, without Kubernetes

Bad arguments exit 2 with the reason; nothing is touched.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from pydantic import ValidationError

from dynsnap.agent.settings import AgentSettings
from dynsnap.models.protocol import Tier
from dynsnap.models.workersnapshot import UID_PATTERN

_BOOL = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("agent settings (also DYNSNAP_AGENT_<NAME>)")
    for name, f in AgentSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        # SUPPRESS: a flag given before `exec` is not overwritten by the subcommand's unset default.
        if name == "cuda_env":
            g.add_argument(flag, action="append", metavar="KEY=VALUE", help=f.description, default=argparse.SUPPRESS)
        else:
            g.add_argument(flag, dest=name, metavar=name.upper(), help=f"{f.description} (default: {f.default})",
                           default=argparse.SUPPRESS)


def _settings(args: argparse.Namespace) -> AgentSettings:
    overrides: dict[str, Any] = {n: getattr(args, n, None) for n in AgentSettings.model_fields if n != "cuda_env"}
    for n, v in list(overrides.items()):
        if v is not None and AgentSettings.model_fields[n].annotation is bool:
            if v.lower() not in _BOOL:
                raise ValueError(f"--{n.replace('_', '-')}: {v!r} is not a boolean")
            overrides[n] = _BOOL[v.lower()]
    env_items = getattr(args, "cuda_env", None) or []
    if env_items:
        pairs = {}
        for item in env_items:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--cuda-env {item!r}: expected KEY=VALUE")
            pairs[key] = value
        overrides["cuda_env"] = pairs
    return AgentSettings.from_env(overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynsnap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="local control plane + Dynamo: serve, pin, summarise, tear down")
    sub.add_parser("crd", help="print dynsnap's CRDs (YAML), generated from the pydantic models")
    agent = sub.add_parser("agent", help="the node agent; `agent exec` runs one capture or wake here")
    agent.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    _add_settings_flags(agent)
    asub = agent.add_subparsers(dest="agent_command")
    ex = asub.add_parser("exec", help="capture or wake one worker on this machine, no Kubernetes")
    ex.add_argument("action", choices=["capture", "wake"])
    ex.add_argument("--pod-uid", required=True, help="the pod UID its processes carry in their cgroup")
    ex.add_argument("--entrypoint-pid", type=int, help="find the worker by its entrypoint's host pid instead of by "
                    "the pod UID in /proc's cgroups (a machine without kubelet's cgroup layout)")
    ex.add_argument("--namespace", default="default", help="names the image directory (default: default)")
    ex.add_argument("--pod", default="worker", help="names the image directory (default: worker)")
    ex.add_argument("--tier", required=True, choices=[t.value for t in Tier])
    ex.add_argument("--quiesced", action="store_true",
                    help="confirm the worker was taken out of serving (a capture refuses without it)")
    ex.add_argument("--metrics-url", help="also refuse a capture while this endpoint shows requests in flight")
    _add_settings_flags(ex)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.command == "demo":
        from dynsnap.demo import run_demo

        rc: int = run_demo()
        return rc
    if args.command == "crd":
        import yaml

        from dynsnap.models.crd import workersnapshot_crd

        sys.stdout.write(yaml.safe_dump(workersnapshot_crd(), sort_keys=False))
        return 0
    if args.command == "agent":
        try:
            settings = _settings(args)
        except (ValueError, ValidationError) as e:
            parser.error(str(e))
        if args.agent_command == "exec":
            return _exec(parser, args, settings)
        return asyncio.run(_agent(args, settings))
    return 2


def _exec(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: AgentSettings) -> int:
    import re

    from dynsnap.agent.exec import execute, subject_for

    if not re.match(UID_PATTERN, args.pod_uid):
        parser.error(f"--pod-uid {args.pod_uid!r} is not a pod UID")
    subject = subject_for(args.pod_uid, namespace=args.namespace, pod=args.pod, entrypoint=args.entrypoint_pid)
    outcome = asyncio.run(execute(settings, subject, action=args.action, tier=Tier(args.tier), quiesced=args.quiesced,
                                  metrics_url=args.metrics_url, out=sys.stdout))
    return 0 if outcome.ok else 1


async def _agent(args: argparse.Namespace, settings: AgentSettings) -> int:
    from dynsnap.agent.main import install_signal_handlers, run_agent
    from dynsnap.k8s.client import Kube
    from dynsnap.models import protocol as P
    from dynsnap.telemetry.tracing import setup_tracing, shutdown_tracing

    setup_tracing("dynsnap-agent", otlp_endpoint=settings.otlp_endpoint or None, trace_file=settings.trace_file)
    kube = (await Kube.from_kubeconfig(args.kubeconfig, field_manager=P.AGENT_FIELD_MANAGER) if args.kubeconfig
            else Kube.in_cluster(field_manager=P.AGENT_FIELD_MANAGER))
    stop = asyncio.Event()
    install_signal_handlers(stop)
    try:
        await run_agent(kube, settings, stop=stop)
    finally:
        await kube.close()
        shutdown_tracing()  # exports the spans still batched
    return 0


if __name__ == "__main__":
    sys.exit(main())
