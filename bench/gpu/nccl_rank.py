"""One rank of a two-rank PyTorch NCCL group holding a known pattern, driven by commands in files.

The workload of bench/gpu/two_gpu.py and tests/gpu/test_two_gpus_gpu.py (issue 11): a tensor-parallel
pair as an inference worker runs it, one process per GPU, joined by one NCCL communicator. Between
commands a rank waits on its command file and makes no CUDA call, the way an idle worker does, so a
checkpoint finds it idle. Commands come as DIR/cmd and answers go to DIR/out (both written whole,
by rename): a process CRIU dumps and restores must hold no pipe to its driver.

    python3 bench/gpu/nccl_rank.py rank --rank R --world 2 --port P --mib M --ctl DIR [--device D]
    python3 bench/gpu/nccl_rank.py launch --world 2 --port P --mib M0,M1 --ctl DIR
        (the root of a tree: starts the ranks as its children with DIR/0, DIR/1 and waits; it
         makes no CUDA call itself, so CRIU dumps the pair with one ``criu dump -t``)

Commands (one a file; the answer is one line):
    ar N            N all-reduces of a 4 MiB float tensor, each checked exactly: "ok SECONDS"
    ar_start MIB N  enqueue N all-reduces of an MIB tensor and return at once (a collective in
                    flight: it spins on the GPU until every rank has entered it): "launched"
    ar_wait         wait for them and check the sum exactly: "ok SECONDS"
    bw SIZE:ITERS,...   all-reduce bandwidth, CUDA events around ITERS calls after 3 warm-ups;
                    every rank must get the same list: one JSON list
    check           every pattern chunk compared, then a new 1024^2 matmul: "ok SECONDS"
    where           JSON: pid, the device index this process uses and the UUID PyTorch reports
    quit

NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 must be set: a
rank without them refuses to start (NVLink multicast can take the host's GPUs out of service).
``--dry`` replaces every GPU operation by a no-op that answers like the real one, for checking the
driver's logic where there is no GPU; it proves nothing about the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

CHUNK_MIB = 256
MUST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def reply_to(ctl: str) -> Callable[[str], None]:
    def reply(msg: str) -> None:
        tmp = os.path.join(ctl, "out.tmp")
        with open(tmp, "w") as f:
            f.write(msg + "\n")
        os.rename(tmp, os.path.join(ctl, "out"))

    return reply


def commands(ctl: str) -> Iterator[str]:
    path = os.path.join(ctl, "cmd")
    while True:
        try:
            with open(path) as f:
                line = f.read()
            os.unlink(path)
        except FileNotFoundError:
            time.sleep(0.02)
            continue
        yield line


class Gpu:
    """The rank's GPU side: pattern, collectives, checks."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world = a.rank, a.world
        self.dev = torch.device(f"cuda:{a.device if a.device is not None else a.rank}")
        torch.cuda.set_device(self.dev)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                                world_size=a.world, device_id=self.dev)
        self.seed = 77 + a.rank
        self.chunks = [self.fill(i) for i in range(max(1, a.mib // CHUNK_MIB))]
        self.pending: tuple[Any, int, float] | None = None
        self.ar(1)  # the communicator's connections are made on first use: make them now
        torch.cuda.synchronize(self.dev)

    def fill(self, i: int) -> Any:
        key = (self.seed * 1_000_003 + i * 7919) & 0x7FFFFFFF
        t = self.torch.arange(CHUNK_MIB << 18, dtype=self.torch.int32, device=self.dev)
        return self.torch.bitwise_xor(t, key)

    def ar(self, n: int) -> str:
        torch = self.torch
        t0 = time.monotonic()
        base = torch.arange(1 << 20, dtype=torch.float32, device=self.dev)
        total = self.world * (self.world + 1) // 2  # ranks contribute 1x, 2x, ...
        bad = []
        for k in range(n):
            x = base * (self.rank + 1) + k
            self.dist.all_reduce(x)
            if not torch.equal(x, base * total + k * self.world):
                bad.append(k)
        torch.cuda.synchronize(self.dev)
        return f"ok {time.monotonic() - t0:.3f}" if not bad else f"bad allreduce iterations={bad[:10]}"

    def ar_start(self, mib: int, n: int) -> str:
        x = self.torch.full((mib << 18,), float(self.rank + 1), dtype=self.torch.float32, device=self.dev)
        for _ in range(n):
            self.dist.all_reduce(x)
        self.pending = (x, n, time.monotonic())
        return "launched"

    def ar_wait(self) -> str:
        if self.pending is None:
            return "bad nothing pending"
        x, n, t0 = self.pending
        self.pending = None
        self.torch.cuda.synchronize(self.dev)
        # ranks start at 1, 2, ...: the first sum is S = world(world+1)/2, each next one multiplies by world
        want = self.world * (self.world + 1) / 2 * self.world ** (n - 1)
        ok = bool(self.torch.all(x == want).item())
        return f"ok {time.monotonic() - t0:.3f}" if ok else f"bad sum {x[0].item()} != {want}"

    def bw(self, spec: str) -> str:
        torch = self.torch
        rows = []
        for item in spec.split(","):
            size, iters = (int(v) for v in item.split(":"))
            x = torch.zeros(size // 4, dtype=torch.float32, device=self.dev)
            for _ in range(3):
                self.dist.all_reduce(x)
            torch.cuda.synchronize(self.dev)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                self.dist.all_reduce(x)
            e1.record()
            torch.cuda.synchronize(self.dev)
            s = e0.elapsed_time(e1) / 1e3 / iters
            algbw = size / s / 1e9
            # nccl-tests' bus bandwidth of an all-reduce: algbw * 2(n-1)/n
            rows.append({"bytes": size, "iters": iters, "s_per_op": s, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * 2 * (self.world - 1) / self.world})
            del x
        return json.dumps(rows)

    def check(self) -> str:
        torch = self.torch
        t0 = time.monotonic()
        bad = [i for i, c in enumerate(self.chunks) if not torch.equal(c, self.fill(i))]
        m = torch.ones(1024, 1024, device=self.dev)
        ok_mm = bool(torch.all(m @ m == 1024).item())
        torch.cuda.synchronize(self.dev)
        return f"ok {time.monotonic() - t0:.3f}" if not bad and ok_mm else f"bad chunks={bad} matmul={ok_mm}"

    def where(self) -> str:
        p = self.torch.cuda.get_device_properties(self.dev)
        return json.dumps({"pid": os.getpid(), "device": self.dev.index, "torch_uuid": str(getattr(p, "uuid", "?")),
                           "name": p.name})


class DryGpu(Gpu):
    """--dry: no GPU, no torch; answers as a healthy rank would (the driver's logic only)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.rank, self.world, self.pending_n = a.rank, a.world, 0

    def ar(self, n: int) -> str:
        return "ok 0.001"

    def ar_start(self, mib: int, n: int) -> str:
        self.pending_n = n
        return "launched"

    def ar_wait(self) -> str:
        return "ok 0.001"

    def bw(self, spec: str) -> str:
        return json.dumps([{"bytes": int(i.split(":")[0]), "iters": int(i.split(":")[1]), "s_per_op": 1e-3,
                            "algbw_GBps": 1.0, "busbw_GBps": 1.0} for i in spec.split(",")])

    def check(self) -> str:
        return "ok 0.001"

    def where(self) -> str:
        return json.dumps({"pid": os.getpid(), "device": self.rank, "torch_uuid": "dry", "name": "dry"})


def rank_main(a: argparse.Namespace) -> None:
    wrong = {k: os.environ.get(k) for k, v in MUST.items() if os.environ.get(k) != v}
    if wrong:
        sys.exit(f"refusing to start: NVLink multicast must be off, and {wrong} say otherwise")
    os.makedirs(a.ctl, exist_ok=True)
    reply = reply_to(a.ctl)
    try:
        gpu = DryGpu(a) if a.dry else Gpu(a)
    except Exception as e:  # the driver waits for a first answer: give it the cause
        reply(f"failed {type(e).__name__}: {e}")
        raise
    reply(f"ready {os.getpid()} {a.mib}")
    for line in commands(a.ctl):
        cmd = line.split()
        if not cmd:
            continue
        try:
            if cmd[0] == "ar":
                out = gpu.ar(int(cmd[1]))
            elif cmd[0] == "ar_start":
                out = gpu.ar_start(int(cmd[1]), int(cmd[2]))
            elif cmd[0] == "ar_wait":
                out = gpu.ar_wait()
            elif cmd[0] == "bw":
                out = gpu.bw(cmd[1])
            elif cmd[0] == "check":
                out = gpu.check()
            elif cmd[0] == "where":
                out = gpu.where()
            elif cmd[0] == "quit":
                reply("bye")
                break
            else:
                out = f"bad unknown command {cmd[0]}"
        except Exception as e:
            out = f"bad {type(e).__name__}: {e}"
        reply(out)


def launch_main(a: argparse.Namespace) -> None:
    sizes = [int(x) for x in str(a.mib).split(",")]
    sizes += [sizes[-1]] * (a.world - len(sizes))
    procs = []
    for r in range(a.world):
        argv = [sys.executable, os.path.abspath(__file__), "rank", "--rank", str(r), "--world", str(a.world),
                "--port", str(a.port), "--mib", str(sizes[r]), "--ctl", os.path.join(a.ctl, str(r))]
        if a.dry:
            argv.append("--dry")
        procs.append(subprocess.Popen(argv))
    for p in procs:
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("rank")
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--device", type=int)
    r.add_argument("--mib", type=int, required=True)
    lp = sub.add_parser("launch")
    lp.add_argument("--mib", required=True, help="MiB per rank, comma list (the last repeats)")
    for p in (r, lp):
        p.add_argument("--world", type=int, default=2)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--ctl", required=True)
        p.add_argument("--dry", action="store_true")
    a = ap.parse_args()
    (rank_main if a.what == "rank" else launch_main)(a)


if __name__ == "__main__":
    main()
