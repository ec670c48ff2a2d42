"""A Dynamo worker whose engine is a small PyTorch model of our own: the GPU process that
bench/e2e/wake_e2e.py puts to sleep and wakes, and whose answer through the Dynamo frontend ends
the wake's clock.

No engine package: the weights are plain torch tensors on ``--device`` (an embedding of the
tokenizer's vocabulary and a stack of square linear layers, ``--gib`` GiB in all), and every token
it streams is computed there: the state goes through every layer (all the weights are read once
per token) and the next token is the greedy argmax of the embedding against it. Same weights and
same prompt give the same answer, so an answer after a wake that differs from the one before the
sleep means the device memory did not come back as it was.

It registers the way Dynamo's own backends do through the Python API (``register_model`` with
``ModelInput.Tokens``: the frontend applies the chat template and tokenizes with the model
directory's tokenizer, here the local environment's tiny model at ``$DYNSNAP_MODEL_DIR``, and
detokenizes what we stream), serves ``dynamo.backend.generate`` and writes its instance id (the
decimal the frontend's ``x-dynamo-worker-instance-id`` header pins to) to ``--id-file``.

``--write-weights FILE`` only makes the weights (seeded) and saves them; a worker started with
``--weights FILE`` loads them from local disk onto the device, as a real engine's cold start does.

``--kv-gib`` adds a KV pool: that much allocated on the device and never written, as a KV cache at a
high gpu-memory-utilization is. Two engine routes on the worker's system port, registered as Dynamo's
vLLM worker registers them (``runtime.register_engine_route``) and behaving as vLLM's sleep level 1
(``--no-routes``: none), answered ``{"status": "ok" | "error", "message": ...}``:
``POST /engine/control/sleep`` unregisters the endpoint instance, waits for the request on the device,
copies the weights to pinned host memory, frees them and the pool on the device (and returns the
allocator's cache to the driver); ``POST /engine/control/wake_up`` allocates again, copies the
weights back, registers the instance again. A request that arrives while it sleeps waits for the wake.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("e2e-engine")
GIB = 1 << 30
SPECIAL = 6  # the tiny tokenizer's special tokens (bos, eos, pad, user, assistant, system): never generated


def dtype_for(device: str) -> torch.dtype:
    # bf16 on the GPU (what a served model holds); fp32 on the CPU, where bf16 GEMV is emulated and slow.
    return torch.float32 if device == "cpu" else torch.bfloat16


def layer_count(gib: float, hidden: int, vocab: int, dtype: torch.dtype) -> int:
    elt = torch.tensor([], dtype=dtype).element_size()
    return max(1, int((gib * GIB - vocab * hidden * elt) // (hidden * hidden * elt)))


def make_weights(gib: float, hidden: int, vocab: int, device: str, seed: int) -> dict[str, Any]:
    dtype = dtype_for(device)
    g = torch.Generator(device=device).manual_seed(seed)
    emb = torch.randn(vocab, hidden, generator=g, device=device, dtype=dtype)
    # std 1/sqrt(hidden) keeps the state's scale through tanh, layer after layer
    scale = hidden ** -0.5
    layers = [torch.randn(hidden, hidden, generator=g, device=device, dtype=dtype) * scale
              for _ in range(layer_count(gib, hidden, vocab, dtype))]
    return {"emb": emb, "layers": layers, "seed": seed}


class TinyLM:
    """The model: ``emb`` [vocab, hidden] and ``layers`` [hidden, hidden] each, all on one device,
    and a KV pool of ``kv_bytes`` beside them that nothing writes."""

    def __init__(self, weights: dict[str, Any], device: str, kv_bytes: int = 0) -> None:
        self.device = torch.device(device)
        # copy=True: on the CPU too the weights end in the process's own memory, not in the file's
        # mapped pages (a mmap'd load would otherwise stay a view of the page cache)
        self.emb: torch.Tensor = weights["emb"].to(self.device, copy=True)
        self.layers: list[torch.Tensor] = [w.to(self.device, copy=True) for w in weights["layers"]]
        self.bytes = sum(t.numel() * t.element_size() for t in [self.emb, *self.layers])
        self.kv_bytes = kv_bytes
        self.kv: torch.Tensor | None = self._pool()
        self.host: list[torch.Tensor] | None = None  # the weights while asleep

    def _pool(self) -> torch.Tensor | None:
        # torch.empty: allocated, never written (what a KV cache at high utilization is)
        return torch.empty(self.kv_bytes, dtype=torch.uint8, device=self.device) if self.kv_bytes else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def offload(self) -> None:
        """vLLM's sleep level 1: weights to pinned host memory, weights and pool freed on the device."""
        pin = self.device.type == "cuda"  # pinned memory needs the CUDA runtime
        host = []
        for t in [self.emb, *self.layers]:
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            h.copy_(t, non_blocking=pin)
            host.append(h)
        self._sync()
        self.host = host
        self.emb, self.layers, self.kv = torch.empty(0), [], None
        if pin:
            torch.cuda.empty_cache()  # back to the driver: freed on the GPU, not only in torch's cache

    def reload(self) -> None:
        """Wake: allocate again, copy the weights back."""
        assert self.host is not None, "not asleep"
        on = [h.to(self.device, non_blocking=True) for h in self.host]
        self._sync()
        self.emb, self.layers = on[0], on[1:]
        self.kv = self._pool()
        self.host = None

    @torch.inference_mode()
    def generate(self, prompt: list[int], n: int) -> list[int]:
        """``n`` tokens, greedily; the whole loop runs on the device, one sync per token."""
        vocab = self.emb.shape[0]
        ids = torch.tensor([t % vocab for t in prompt] or [0], device=self.device)
        h = self.emb[ids].mean(0)
        out: list[int] = []
        for _ in range(n):
            for w in self.layers:
                h = torch.tanh(w @ h)
            logits = (self.emb @ h).float()
            logits[:SPECIAL] = float("-inf")
            tok = int(logits.argmax().item())  # the per-token sync: the answer waits for the device
            out.append(tok)
            h = h + self.emb[tok]
        return out


def load(args: argparse.Namespace) -> tuple[TinyLM, float]:
    """The model on the device, and how long that took (the cold start's weights part)."""
    t0 = time.monotonic()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.weights:
        # From local disk onto the device: mmap, then one copy per tensor (the page cache's
        # state is the caller's: wake_e2e.py may drop it first).
        weights = torch.load(args.weights, map_location="cpu", mmap=True, weights_only=True)
    else:
        weights = make_weights(args.gib, args.hidden, args.vocab, args.device, args.seed)
    model = TinyLM(weights, args.device, kv_bytes=int(args.kv_gib * GIB))
    del weights
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    loaded = time.monotonic() - t0
    log.info("model on %s: %d layers, %.2f GiB, KV pool %.2f GiB, loaded in %.2f s", model.device,
             len(model.layers), model.bytes / GIB, model.kv_bytes / GIB, loaded)
    return model, loaded


def write_id(path: str, info: dict[str, Any]) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


class Routes:
    """control/sleep and control/wake_up (vLLM's level 1, its answers' shape and messages)."""

    def __init__(self, model: TinyLM, lock: asyncio.Lock, awake: asyncio.Event) -> None:
        self.model, self.lock, self.awake = model, lock, awake
        self.endpoint: Any = None
        self.asleep = False
        self.registered = True
        self.route_lock = asyncio.Lock()

    async def sleep(self, body: Any) -> dict[str, Any]:
        if body is not None and not isinstance(body, dict):
            return {"status": "error", "message": "request body must be a JSON object"}
        level = (body or {}).get("level", 1)
        if level != 1 or isinstance(level, bool):
            return {"status": "error", "message": f"sleep level {level!r} is not supported (level 1 only)"}
        async with self.route_lock:
            if self.asleep:
                return {"status": "ok", "message": "Engine already sleeping"}
            t0 = time.monotonic()
            await self.endpoint.unregister_endpoint_instance()
            self.registered = False
            self.awake.clear()
            try:
                async with self.lock:  # the request on the device finishes first
                    await asyncio.to_thread(self.model.offload)
            except Exception as e:
                log.exception("sleep failed")
                self.awake.set()
                await self.endpoint.register_endpoint_instance()
                self.registered = True
                return {"status": "error", "message": f"sleep failed: {e}"}
            self.asleep = True
            log.info("slept (level 1) in %.3f s: %.2f GiB of weights to pinned host memory, %.2f GiB pool freed",
                     time.monotonic() - t0, self.model.bytes / GIB, self.model.kv_bytes / GIB)
            return {"status": "ok", "message": f"Engine slept (level={level})"}

    async def wake_up(self, body: Any) -> dict[str, Any]:
        if body is not None and not isinstance(body, dict):
            return {"status": "error", "message": "request body must be a JSON object"}
        async with self.route_lock:
            if not self.asleep and self.registered:
                return {"status": "ok", "message": "Engine already awake"}
            t0 = time.monotonic()
            try:
                if self.asleep:
                    await asyncio.to_thread(self.model.reload)
                    self.asleep = False
                    self.awake.set()
                await self.endpoint.register_endpoint_instance()  # again after a wake that failed here
                self.registered = True
            except Exception as e:
                log.exception("wake_up failed")
                return {"status": "error", "message": f"wake_up failed: {e}"}
            log.info("woke in %.3f s", time.monotonic() - t0)
            return {"status": "ok", "message": "Engine woke"}


async def serve(args: argparse.Namespace, model: TinyLM, loaded: float) -> None:
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    t0 = time.monotonic()
    lock = asyncio.Lock()  # one request on the device at a time: the state is per request, the device is not
    awake = asyncio.Event()  # cleared while asleep: a request waits for the wake
    awake.set()

    async def generate(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        prompt = list(request.get("token_ids") or [])
        n = int((request.get("stop_conditions") or {}).get("max_tokens") or args.max_tokens)
        tokens: list[int] | None = None
        while tokens is None:
            await awake.wait()
            async with lock:
                if not awake.is_set():  # a sleep took the device first: wait for the wake again
                    continue
                t = time.monotonic()
                tokens = await asyncio.to_thread(model.generate, prompt, n)
                log.info("%d tokens on %s in %.3f s", n, model.device, time.monotonic() - t)
        for i, tok in enumerate(tokens):
            chunk: dict[str, Any] = {"token_ids": [tok], "index": 0}
            if i == len(tokens) - 1:
                chunk["finish_reason"] = "length"
                chunk["completion_usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                                             "total_tokens": len(prompt) + len(tokens)}
            yield chunk

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, args.discovery_backend, "tcp")
    endpoint = runtime.endpoint(args.endpoint)
    if not args.no_routes:
        routes = Routes(model, lock, awake)
        routes.endpoint = endpoint
        runtime.register_engine_route("control/sleep", routes.sleep)
        runtime.register_engine_route("control/wake_up", routes.wake_up)
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, args.model_path,
                         args.model_name, worker_type=WorkerType.Aggregated)
    instance = endpoint.connection_id()
    if args.id_file:
        write_id(args.id_file, {"instance_id": instance, "pid": os.getpid(), "loaded_s": loaded,
                                "layers": len(model.layers), "bytes": model.bytes, "kv_bytes": model.kv_bytes,
                                "device": str(model.device)})
    log.info("registered %s as instance %d (%.2f s after the model was on the device)", args.model_name, instance,
             time.monotonic() - t0)
    await endpoint.serve_endpoint(generate)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="weights in GiB (default 1)")
    p.add_argument("--kv-gib", type=float, default=0.0,
                   help="a KV pool beside the weights, allocated and never written, GiB (default 0: none)")
    p.add_argument("--no-routes", action="store_true", help="register no engine route (control/sleep, wake_up)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--hidden", type=int, default=4096, help="width of each square layer (default 4096)")
    p.add_argument("--vocab", type=int, default=4096, help="the tokenizer's vocabulary size (default 4096)")
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--weights", help="load the weights from this file (written by --write-weights)")
    p.add_argument("--write-weights", metavar="FILE", help="make the weights, save them to FILE, exit")
    p.add_argument("--model-path", default=os.environ.get("DYNSNAP_MODEL_DIR", ""),
                   help="model directory with the tokenizer (default $DYNSNAP_MODEL_DIR)")
    p.add_argument("--model-name", default="tiny")
    p.add_argument("--endpoint", default="dynamo.backend.generate")
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "file"))
    p.add_argument("--max-tokens", type=int, default=8, help="when the request names none")
    p.add_argument("--id-file", help="write {instance_id, ...} here (JSON) once registered")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.write_weights:
        w = make_weights(args.gib, args.hidden, args.vocab, args.device, args.seed)
        cpu = {"emb": w["emb"].cpu(), "layers": [t.cpu() for t in w["layers"]], "seed": args.seed}
        tmp = f"{args.write_weights}.tmp"
        torch.save(cpu, tmp)
        os.replace(tmp, args.write_weights)
        return 0
    if not args.model_path:
        p.error("--model-path (or $DYNSNAP_MODEL_DIR) is required: the frontend tokenizes with it")
    model, loaded = load(args)
    try:
        import uvloop
    except ImportError:  # Dynamo's own backends run on uvloop; the runtime takes any asyncio loop
        asyncio.run(serve(args, model, loaded))
    else:
        uvloop.run(serve(args, model, loaded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
