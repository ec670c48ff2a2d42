"""Command line (top layer):

    dynsnap demo                         local control plane + Dynamo: a full suspend -> wake -> verify cycle
    dynsnap crd                          print dynsnap's CRDs, generated from the models
    dynsnap docs NAME [--write|--check]  a docs/ page generated from the code (operations, configuration)
    dynsnap controller [options]         the controller (one active replica, elected by a Lease)
    dynsnap agent [options]              the node agent (one per node)
    dynsnap agent exec ... capture|wake  one capture or wake of one worker here, without Kubernetes
    dynsnap status [-n NS | -A] [--watch] the workers dynsnap manages: state, idle for, last capture/wake, proof
    dynsnap status --timeline POD [-o F] a PNG timeline of the worker's last capture and wake (needs dynsnap[plots])
    dynsnap suspend|wake POD [-n NS]     the manual override on one worker pod, followed until done or failed
    dynsnap wake --all [-n NS | -A]      every worker awake (what `helm uninstall` runs first)

Bad arguments exit 2 with the reason; nothing is touched.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
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


def _add_controller_flags(p: argparse.ArgumentParser) -> None:
    from dynsnap.controller.settings import ControllerSettings

    g = p.add_argument_group("controller settings (also DYNSNAP_CONTROLLER_<NAME>)")
    for name, f in ControllerSettings.model_fields.items():
        g.add_argument("--" + name.replace("_", "-"), dest=name, metavar=name.upper(),
                       help=f"{f.description} (default: {f.default})", default=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynsnap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="local control plane + Dynamo: serve, pin, summarise, tear down")
    demo.add_argument("--timeline-out", type=Path, default=Path("dynsnap-demo-timeline.png"), metavar="PNG",
                      help="where the PNG timeline of every capture and wake goes (default: %(default)s; "
                      "needs dynsnap[plots])")
    docs = sub.add_parser("docs", help="a docs/ page generated from the code, on stdout")
    docs.add_argument("name", choices=["operations", "configuration"])
    how = docs.add_mutually_exclusive_group()
    how.add_argument("--write", action="store_true", help="write it into the checkout's docs/ instead")
    how.add_argument("--check", action="store_true", help="exit 1 when the checkout's docs/ file differs")
    sub.add_parser("crd", help="print dynsnap's CRDs (YAML), generated from the pydantic models")
    ctl = sub.add_parser("controller", help="the controller: decides which workers sleep, wakes and verifies them")
    ctl.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    _add_controller_flags(ctl)
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
    ex.add_argument("--system-url", help="the worker's Dynamo system port (http://HOST:PORT): tier engine calls its "
                    "engine routes there")
    _add_settings_flags(ex)
    _add_user_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # -v is for dynsnap's own decisions: httpcore's dozen DEBUG lines per HTTP request (and asyncio's) would
    # bury them, and so would httpx's INFO line per request: an agent scrapes each worker every second and,
    # while a worker sleeps routable, each frontend's /metrics 20 times a second (about 8 MB of log an hour,
    # enough for kubelet to rotate the agent's log under a `kubectl logs` that wanted its last lines).
    # dynsnap logs its own HTTP failures; httpx keeps only its warnings.
    logging.getLogger("asyncio").setLevel(logging.INFO)
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.command == "demo":
        from dynsnap.demo import run_demo

        rc: int = run_demo(timeline_out=args.timeline_out)
        return rc
    if args.command == "docs":
        return _docs(args)
    if args.command == "crd":
        import yaml

        from dynsnap.models.crd import workersnapshot_crd

        sys.stdout.write(yaml.safe_dump(workersnapshot_crd(), sort_keys=False))
        return 0
    if args.command == "controller":
        from dynsnap.controller.settings import ControllerSettings

        try:
            csettings = ControllerSettings.from_env(
                {n: getattr(args, n, None) for n in ControllerSettings.model_fields})
        except (ValueError, ValidationError) as e:
            parser.error(str(e))
        return asyncio.run(_controller(args, csettings))
    if args.command == "agent":
        try:
            settings = _settings(args)
        except (ValueError, ValidationError) as e:
            parser.error(str(e))
        if args.agent_command == "exec":
            return _exec(parser, args, settings)
        return asyncio.run(_agent(args, settings))
    if args.command == "status":
        if args.timeline is None and args.output not in (None, "table", "json"):
            parser.error(f"argument -o/--output: invalid choice: {args.output!r} (choose from 'table', 'json'; "
                         "a file name only with --timeline)")
        if args.timeline is not None and (args.watch or args.all_namespaces):
            parser.error("--timeline POD draws one worker: not with --watch or -A")
    if args.command in ("status", "suspend", "wake"):
        return asyncio.run(_user_command(args))
    return 2


def _docs(args: argparse.Namespace) -> int:
    from dynsnap import docs

    text = docs.GENERATORS[args.name]()
    path = docs.path_of(args.name)
    if args.check:
        same = path.is_file() and path.read_text() == text
        sys.stderr.write(f"{path}: {'up to date' if same else 'differs from the code: dynsnap docs ' + args.name}"
                         f"{'' if same else ' --write'}\n")
        return 0 if same else 1
    if args.write:
        path.write_text(text)
        sys.stderr.write(f"wrote {path}\n")
        return 0
    sys.stdout.write(text)
    return 0


def _exec(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: AgentSettings) -> int:
    import re

    from dynsnap.agent.exec import execute, subject_for

    if not re.match(UID_PATTERN, args.pod_uid):
        parser.error(f"--pod-uid {args.pod_uid!r} is not a pod UID")
    subject = subject_for(args.pod_uid, namespace=args.namespace, pod=args.pod, entrypoint=args.entrypoint_pid,
                          system_url=args.system_url)
    outcome = asyncio.run(execute(settings, subject, action=args.action, tier=Tier(args.tier), quiesced=args.quiesced,
                                  metrics_url=args.metrics_url, out=sys.stdout))
    return 0 if outcome.ok else 1


async def _controller(args: argparse.Namespace, settings: Any) -> int:
    from dynsnap.agent.main import install_signal_handlers
    from dynsnap.controller.main import run_controller
    from dynsnap.k8s.client import Kube
    from dynsnap.models import protocol as P

    kube = (await Kube.from_kubeconfig(args.kubeconfig, field_manager=P.FIELD_MANAGER) if args.kubeconfig
            else Kube.in_cluster(field_manager=P.FIELD_MANAGER))
    from dynsnap.runtime.leader import LeadershipLost
    from dynsnap.telemetry.tracing import setup_tracing, shutdown_tracing

    setup_tracing("dynsnap-controller", otlp_endpoint=settings.otlp_endpoint or None,
                  trace_file=Path(settings.trace_file) if settings.trace_file else None)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    try:
        await run_controller(kube, settings, stop=stop)
    except LeadershipLost as e:
        # Exit non-zero: the Deployment restarts this replica as a fresh candidate (nothing it
        # held in memory is trusted after another replica may have acted).
        logging.getLogger("dynsnap.controller").error("%s; exiting", e)
        return 1
    finally:
        shutdown_tracing()
        await kube.close()
    return 0


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


def _add_user_commands(sub: Any) -> None:
    """`dynsnap status`, `dynsnap suspend POD`, `dynsnap wake POD` (dynsnap/controller/follow.py)."""
    kubeconfig = "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, then in-cluster)"
    st = sub.add_parser("status", help="the workers dynsnap manages: DGD, component, state, tier, idle for, "
                        "last capture, last wake, verified by")
    st.add_argument("--kubeconfig", help=kubeconfig)
    where = st.add_mutually_exclusive_group()
    where.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, else default)")
    where.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    st.add_argument("-w", "--watch", action="store_true", help="keep watching; print each row again when it changes")
    st.add_argument("-o", "--output", metavar="table|json|FILE",
                    help="table (default) or json (with --watch: one JSON object per change and line); with "
                    "--timeline: the PNG file (default: POD-timeline.png)")
    st.add_argument("--timeline", metavar="POD", help="write a PNG timeline of POD's last quiesce, capture, wake "
                    "and verification, each step with its duration (needs matplotlib: pip install 'dynsnap[plots]')")
    for action, what in (("suspend", "put one worker to sleep"), ("wake", "wake one worker and prove it")):
        p = sub.add_parser(action, help=f"{what}: set the override on its WorkerSnapshot and follow it")
        p.add_argument("pod", metavar="POD", help="the worker pod", nargs="?" if action == "wake" else None)
        if action == "wake":
            p.add_argument("--all", action="store_true", help="every worker dynsnap manages in the namespace, "
                           "each followed until awake; what the Helm chart's uninstall hook runs")
            p.add_argument("-A", "--all-namespaces", action="store_true", help="with --all: in every namespace")
        p.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, else default)")
        p.add_argument("--kubeconfig", help=kubeconfig)
        p.add_argument("--timeout", type=float, default=300.0,
                       help="give up following after this many seconds, exit 3 (default: 300)")
        p.add_argument("--no-follow", action="store_true", help="set the override and exit")


async def _user_command(args: argparse.Namespace) -> int:
    from dynsnap.controller import follow
    from dynsnap.k8s.errors import K8sError

    def fail(code: int, msg: str) -> int:
        sys.stderr.write(f"dynsnap {args.command}: {msg}\n")
        return code

    if getattr(args, "timeout", 1.0) <= 0:
        return fail(follow.USAGE, f"--timeout {args.timeout}: must be more than 0 seconds")
    every = args.command == "wake" and args.all
    if args.command == "wake" and (every == (args.pod is not None) or (args.all_namespaces and not every)
                                   or (args.all_namespaces and args.namespace)):
        return fail(follow.USAGE, "give either POD or --all (with -n NAMESPACE or -A)")
    timeline = getattr(args, "timeline", None)
    if timeline is not None:
        from dynsnap.controller.timeline import PlotsUnavailable, check_plots

        try:
            check_plots()  # before anything is asked of the cluster
        except PlotsUnavailable as e:
            return fail(follow.USAGE, str(e))
    try:
        kube, default_ns = await follow.connect(args.kubeconfig)
    except follow.UsageError as e:
        return fail(follow.USAGE, str(e))
    try:
        if args.command == "status" and timeline is not None:
            return await follow.timeline(kube, namespace=args.namespace or default_ns, pod=timeline,
                                         path=Path(args.output or f"{timeline}-timeline.png"), out=sys.stdout)
        if args.command == "status":
            ns = None if args.all_namespaces else (args.namespace or default_ns)
            return await follow.status(kube, namespace=ns, watch=args.watch, output=args.output or "table",
                                       out=sys.stdout, err=sys.stderr)
        if every:
            return await follow.wake_all(kube, namespace=None if args.all_namespaces else args.namespace or default_ns,
                                         timeout=args.timeout, follow=not args.no_follow, out=sys.stdout)
        return await follow.request(kube, action=args.command, namespace=args.namespace or default_ns,
                                    pod=args.pod, timeout=args.timeout, follow=not args.no_follow, out=sys.stdout)
    except follow.UsageError as e:
        return fail(follow.USAGE, str(e))
    except K8sError as e:
        return fail(follow.FAILED, follow.explain(e))
    finally:
        await kube.close()


if __name__ == "__main__":
    sys.exit(main())
