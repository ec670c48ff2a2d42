"""Cold start of the bench worker's GPU state: a fresh process loads GIB GiB from local disk onto
the GPU, the way a worker that was not captured would load its weights again. The comparison the
agent's wake is measured against (docs/BENCHMARKS.md).

    python3 bench/gpu/cold_start.py --gib N --file PATH --write   write the bytes (the same pattern
                                                                   bench/gpu/worker.py holds)
    python3 bench/gpu/cold_start.py --gib N --file PATH           load them; print JSON timings

Timings (seconds, from this process's start): import torch, CUDA context, read from disk into host
memory, copy to the GPU; plus a check that the bytes on the GPU are the pattern.
"""

from __future__ import annotations

import argparse
import json
import os
import time

T_START = time.monotonic()

CHUNK = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, required=True)
    ap.add_argument("--file", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    import torch

    t_import = time.monotonic()

    def fill(i: int, dev: str) -> torch.Tensor:  # bench/gpu/worker.py's pattern
        key = (a.seed * 1_000_003 + i * 7919) & 0x7FFFFFFF
        return torch.bitwise_xor(torch.arange(CHUNK // 4, dtype=torch.int32, device=dev), key)

    if a.write:
        with open(a.file, "wb") as f:
            for i in range(a.gib):
                f.write(fill(i, "cpu").numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        return
    dev = torch.device("cuda:0")
    torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    t_ctx = time.monotonic()
    host = torch.from_file(a.file, shared=False, size=a.gib * CHUNK // 4, dtype=torch.int32)
    t_read = time.monotonic()
    gpu = host.to(dev)
    torch.cuda.synchronize(dev)
    t_copy = time.monotonic()
    ok = all(torch.equal(gpu[i * (CHUNK // 4):(i + 1) * (CHUNK // 4)], fill(i, "cuda:0")) for i in range(a.gib))
    print(json.dumps({"gib": a.gib, "import_s": round(t_import - T_START, 3), "cuda_ctx_s": round(t_ctx - t_import, 3),
                      "read_s": round(t_read - t_ctx, 3), "h2d_s": round(t_copy - t_read, 3),
                      "total_s": round(t_copy - T_START, 3), "pattern_ok": ok}))


if __name__ == "__main__":
    main()
