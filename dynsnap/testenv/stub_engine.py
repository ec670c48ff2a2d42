"""stub_engine: stands in for a GPU inference engine such as vLLM, served as a Dynamo 1.6.1 worker, in
the local environment where no engine package runs (CPU only, the project's stub CUDA driver).

Layer: ``dynsnap.testenv``; runs as its own process under Dynamo's python (``python3 -m
dynsnap.testenv.stub_engine`` in the worker image, this checkout's package mounted by a hostPath on
``PYTHONPATH``), imports only the standard library, ``stub_gpu`` and Dynamo. ``real_graph.Engine``
deploys it in a DGD on the real node.

What makes it a GPU engine here, unlike the mocker: its request path makes driver calls through
``libcuda.so.1`` (stub_gpu: two per token), so a process the driver holds locked or checkpointed
holds its requests until it is resumed; and it holds device memory the driver accounts for
(``--gib`` of weights, ``--kv-gib`` of KV pool). It registers as Dynamo's own backends do through the
Python API (bench/e2e/engine.py does the same with torch): ``register_model`` (``ModelInput.Tokens``:
the frontend tokenizes with ``--model-path``'s tokenizer) and ``serve_endpoint`` on
``<DYN_NAMESPACE>.backend.generate`` (``<DYN_NAMESPACE>.prefill.generate`` for ``--mode prefill``),
where the mocker serves. Its answers are deterministic (the same prompt, the same text; a
disaggregated pair answers what an aggregated worker does).

Engine routes, on the worker's system port as Dynamo's vLLM worker registers them
(``runtime.register_engine_route``), each ``POST /engine/<route>`` with a JSON object body, answered
200 with ``{"status": "ok" | "error", "message": ...}`` (vLLM handler's shape and messages):

- ``control/sleep`` ``{"level": 1}`` (default 1; vLLM's level 1, the only one): unregister the endpoint
  instance (the frontend stops routing to it), hold new requests, drain the in-flight ones
  (``--drain-timeout``), copy the weights to host memory and free them and the KV pool on the device.
  ``Engine slept (level=1)``; asleep already: ``Engine already sleeping``. A failure rolls back
  (requests admitted, the instance registered again) and answers ``error``.
- ``control/wake_up`` ``{}``: allocate again, copy the weights back, admit requests, register the
  instance again (the same instance id). ``Engine woke``; awake: ``Engine already awake``.
- ``stub/state`` (ours, not vLLM's): ``{"status": "ok", "asleep", "registered", "inflight",
  "resident"}``.

A request that reaches it while it sleeps waits for the wake (``--paused-wait``, then an error), as a
paused vLLM engine holds new requests. Faults, so tests can cause them for real: ``--no-routes``
(no engine route at all: the system port answers 404), and per route (``sleep`` or ``wake_up``,
repeatable) ``--fail-route`` (answers ``error``, changes nothing), ``--hang-route`` (never answers,
changes nothing), ``--stall-route`` (does its work up to the device step, then never answers: a sleep
leaves the instance unregistered, a wake leaves it unregistered with the memory allocated);
``--fault-file`` adds the same as lines ``fail|hang|stall sleep|wake_up``, read at every route call.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from dynsnap.testenv.stub_gpu import Device, Driver, prompt_state, word_tokens

log = logging.getLogger("stub-engine")
GIB = 1 << 30
ROUTES = ("sleep", "wake_up")
FAULTS = ("fail", "hang", "stall")
Answer = dict[str, Any]


def ok(message: str) -> Answer:
    return {"status": "ok", "message": message}


def error(message: str) -> Answer:
    return {"status": "error", "message": message}


def read_faults(flags: set[tuple[str, str]], fault_file: str | None) -> set[tuple[str, str]]:
    """The faults in force: the flags' and the fault file's lines (``fault route``)."""
    out = set(flags)
    if fault_file and os.path.exists(fault_file):
        for n, line in enumerate(Path(fault_file).read_text().splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) != 2 or words[0] not in FAULTS or words[1] not in ROUTES:
                raise ValueError(f"fault file {fault_file} line {n}: {line!r} is not "
                                 f"'{'|'.join(FAULTS)} {'|'.join(ROUTES)}'")
            out.add((words[0], words[1]))
    return out


class Engine:
    """The engine's serving state: admission, in-flight requests, sleep and wake."""

    def __init__(self, args: argparse.Namespace, device: Device, pool: concurrent.futures.Executor) -> None:
        self.args, self.device, self.pool = args, device, pool
        self.endpoint: Any = None
        self.serving = asyncio.Event()  # clear while asleep: new requests wait
        self.serving.set()
        self.idle = asyncio.Event()  # set when nothing is in flight
        self.idle.set()
        self.inflight = 0
        self.asleep = False
        self.registered = True
        self.route_lock = asyncio.Lock()
        self.flags = {(f, r) for f in FAULTS for r in getattr(args, f"{f}_route") or []}

    async def on_device(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Every device call from the one thread whose context is current."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- requests ----

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        if not self.serving.is_set():
            try:
                await asyncio.wait_for(self.serving.wait(), self.args.paused_wait)
            except TimeoutError:
                raise RuntimeError(f"the engine sleeps and was not woken within {self.args.paused_wait:g} s") from None
        self.inflight += 1
        self.idle.clear()
        try:
            async for chunk in self._tokens(request):
                yield chunk
        finally:
            self.inflight -= 1
            if not self.inflight:
                self.idle.set()

    async def _tokens(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Token by token, each from the device; a decode worker starts from its prefill peer's token."""
        prompt = [int(t) for t in request.get("token_ids") or []]
        n = 1 if self.args.mode == "prefill" else int((request.get("stop_conditions") or {}).get("max_tokens")
                                                       or self.args.max_tokens)
        first, state = self._from_prefill(request)
        if first is None:
            state = prompt_state(prompt)
        for i in range(1, n + 1):
            if first is not None:
                tok, first = first, None
            else:
                tok, state = await self.on_device(self.device.step, state)
            chunk: dict[str, Any] = {"token_ids": [tok]}
            if i == n:
                chunk["finish_reason"] = "length"
                chunk["completion_usage"] = {"prompt_tokens": len(prompt), "completion_tokens": n,
                                             "total_tokens": len(prompt) + n}
                if self.args.mode == "prefill":
                    chunk["disaggregated_params"] = {"stub_engine": {"first_token": tok, "state": str(state)}}
            yield chunk

    def _from_prefill(self, request: dict[str, Any]) -> tuple[int | None, int]:
        """A decode worker continues from its prefill peer's first token and state."""
        if self.args.mode != "decode":
            return None, 0
        params = ((request.get("prefill_result") or {}).get("disaggregated_params") or {}).get("stub_engine")
        if not isinstance(params, dict):
            log.info("decode: no prefill result, starting from the prompt")
            return None, 0
        log.info("decode: continuing from the prefill's first token %s", params["first_token"])
        return int(params["first_token"]), int(params["state"])

    # ---- engine routes ----

    async def _faults(self, route: str, body: Any) -> Answer | set[str]:
        """The checks every route makes first: its body, then the injected faults in force."""
        if body is not None and not isinstance(body, dict):
            return error("request body must be a JSON object")
        try:
            faults = {f for f, r in read_faults(self.flags, self.args.fault_file) if r == route}
        except ValueError as e:
            return error(str(e))
        if "fail" in faults:
            return error(f"injected fault: control/{route} fails (stub engine: fail {route})")
        if "hang" in faults:
            log.warning("control/%s: injected hang, never answering", route)
            await asyncio.Event().wait()
        return faults

    async def sleep(self, body: Any) -> Answer:
        faults = await self._faults("sleep", body)
        if isinstance(faults, dict):
            return faults
        level = (body or {}).get("level", 1)
        if level != 1 or isinstance(level, bool):
            return error(f"sleep level {level!r} is not supported by this engine (level 1 only)")
        async with self.route_lock:
            if self.asleep:
                return ok("Engine already sleeping")
            unregistered = False
            try:
                if self.registered:
                    await self.endpoint.unregister_endpoint_instance()
                    self.registered, unregistered = False, True
                self.serving.clear()
                try:
                    await asyncio.wait_for(self.idle.wait(), self.args.drain_timeout)
                except TimeoutError:
                    raise RuntimeError(f"{self.inflight} in-flight requests did not drain within "
                                       f"{self.args.drain_timeout:g} s") from None
                if "stall" in faults:
                    log.warning("control/sleep: injected stall after the drain, never answering")
                    await asyncio.Event().wait()
                await self.on_device(self.device.offload)
                self.asleep = True
                log.info("slept: weights offloaded, %d bytes freed on the device", self.device.weights_bytes
                         + self.device.kv_bytes)
                return ok(f"Engine slept (level={level})")
            except Exception as e:
                log.error("sleep failed: %s", e)
                self.serving.set()
                if unregistered:
                    try:
                        await self.endpoint.register_endpoint_instance()
                        self.registered = True
                    except Exception as reg:
                        log.error("register again after the failed sleep: %s", reg)
                return error(f"sleep failed: {e}")

    async def wake_up(self, body: Any) -> Answer:
        faults = await self._faults("wake_up", body)
        if isinstance(faults, dict):
            return faults
        async with self.route_lock:
            if not self.asleep and self.registered:
                return ok("Engine already awake")
            try:
                if self.asleep:
                    await self.on_device(self.device.reload)
                    if "stall" in faults:
                        log.warning("control/wake_up: injected stall after the reload, never answering")
                        await asyncio.Event().wait()
                    self.asleep = False
                    self.serving.set()
                if not self.registered:
                    await self.endpoint.register_endpoint_instance()
                    self.registered = True
                log.info("woke: weights back on the device, instance registered")
                return ok("Engine woke")
            except Exception as e:
                log.error("wake_up failed: %s", e)
                return error(f"wake_up failed: {e}")

    async def state(self, body: Any) -> Answer:
        return {"status": "ok", "asleep": self.asleep, "registered": self.registered, "inflight": self.inflight,
                "resident": self.device.resident}


def endpoint_path(args: argparse.Namespace) -> str:
    if args.endpoint:
        return str(args.endpoint)
    ns = os.environ.get("DYN_NAMESPACE", "dynamo")
    return f"{ns}.{'prefill' if args.mode == 'prefill' else 'backend'}.generate"


def write_id(path: str, info: dict[str, Any]) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


async def serve(args: argparse.Namespace, device: Device, pool: concurrent.futures.Executor) -> None:
    # Imported by name: this runs under the Dynamo venv's python; the dev venv's tools (mypy,
    # import-linter) that read this module have no Dynamo.
    llm = importlib.import_module("dynamo.llm")
    rt = importlib.import_module("dynamo.runtime")
    loop = asyncio.get_running_loop()
    runtime = rt.DistributedRuntime(loop, args.discovery_backend, "tcp")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    engine = Engine(args, device, pool)
    engine.endpoint = endpoint = runtime.endpoint(endpoint_path(args))
    if not args.no_routes:
        runtime.register_engine_route("control/sleep", engine.sleep)
        runtime.register_engine_route("control/wake_up", engine.wake_up)
        runtime.register_engine_route("stub/state", engine.state)
    W = llm.WorkerType
    needs: list[list[Any]] | None
    if args.mode == "prefill":
        kind, worker, needs = llm.ModelType.Prefill, W.Prefill, [[W.Decode]]
    else:
        kind = llm.ModelType.Chat | llm.ModelType.Completions
        worker, needs = (W.Decode, [[W.Prefill]]) if args.mode == "decode" else (W.Aggregated, None)
    await llm.register_model(llm.ModelInput.Tokens, kind, endpoint, args.model_path, args.model_name,
                             worker_type=worker, needs=needs)
    instance = endpoint.connection_id()
    if args.id_file:
        write_id(args.id_file, {"instance_id": instance, "pid": os.getpid(), "mode": args.mode,
                                "weights_bytes": device.weights_bytes, "kv_bytes": device.kv_bytes})
    log.info("registered %s (%s) as instance %d on %s; engine routes: %s", args.model_name, args.mode, instance,
             endpoint_path(args), "none" if args.no_routes else "control/sleep, control/wake_up")
    await endpoint.serve_endpoint(engine.generate)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stub_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=os.environ.get("DYNSNAP_MODEL_DIR", ""),
                   help="model directory with the tokenizer (default $DYNSNAP_MODEL_DIR)")
    p.add_argument("--model-name", default="tiny")
    p.add_argument("--mode", choices=["agg", "prefill", "decode"], default="agg")
    p.add_argument("--endpoint", help="namespace.component.endpoint (default: where the mocker serves)")
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "kubernetes"))
    p.add_argument("--libcuda", default=os.environ.get("DYNSNAP_LIBCUDA") or "libcuda.so.1",
                   help="the CUDA driver library (default $DYNSNAP_LIBCUDA, else libcuda.so.1)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--gib", type=float, default=1.0, help="weights held on the device, GiB (default 1)")
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV pool, allocated and never written, GiB (default 2)")
    p.add_argument("--vocab", type=int, default=4096, help="the tokenizer's vocabulary size (default 4096)")
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8, help="when the request names none")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="sleep: wait for in-flight requests (s)")
    p.add_argument("--paused-wait", type=float, default=60.0, help="a request to a sleeping engine waits (s)")
    p.add_argument("--no-routes", action="store_true", help="register no engine route (a worker without them)")
    for f in FAULTS:
        p.add_argument(f"--{f}-route", action="append", choices=ROUTES, metavar="ROUTE",
                       help=f"inject '{f}' into control/ROUTE (sleep or wake_up; repeatable)")
    p.add_argument("--fault-file", help="more faults, lines 'fail|hang|stall sleep|wake_up', read at each route call")
    p.add_argument("--id-file", help="write {instance_id, pid, ...} here (JSON) once registered")
    args = p.parse_args(argv)
    if not args.model_path:
        p.error("--model-path (or $DYNSNAP_MODEL_DIR) is required: the frontend tokenizes with it")
    if args.gib <= 0 or args.kv_gib < 0 or args.vocab <= 6 or args.drain_timeout <= 0 or args.paused_wait <= 0:
        p.error("--gib, --drain-timeout and --paused-wait must be > 0, --kv-gib >= 0, --vocab > 6")
    try:
        read_faults(set(), args.fault_file)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")
    driver = pool.submit(Driver, args.libcuda).result()
    pool.submit(driver.open, args.device).result()
    device = Device(driver, weights_bytes=int(args.gib * GIB), kv_bytes=int(args.kv_gib * GIB), vocab=args.vocab,
                    seed=args.seed, tokens=word_tokens(args.model_path, args.vocab))
    pool.submit(device.load).result()
    log.info("on device %d: %d bytes of weights, %d bytes of KV pool (free now: %d of %d)", args.device,
             device.weights_bytes, device.kv_bytes, *pool.submit(driver.mem_info).result())
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:  # Dynamo's backends run on uvloop; the runtime takes any asyncio loop
        asyncio.run(serve(args, device, pool))
    else:
        uvloop.run(serve(args, device, pool))
    return 0


if __name__ == "__main__":
    sys.exit(main())
