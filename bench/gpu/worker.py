"""A PyTorch process holding N GiB of GPU memory with a known pattern.

Driven by bench/gpu/ckpt_bench.py over stdin/stdout, one command a line. It
waits on stdin between commands, so it makes no CUDA call while a checkpoint
or restore happens, the way an idle inference worker does.

With ``--ctl DIR`` it reads commands from DIR/cmd and answers in DIR/out
instead (polling, with stdio on files): a process CRIU dumps and restores must
hold no pipe to its driver.

Commands: ``check`` (verify every chunk, then run new GPU work), ``sleep S``
(launch one GPU kernel that spins for about S seconds, without waiting),
``sync`` (wait for it), ``quit``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

CHUNK = 1 << 30  # bytes per tensor: 1 GiB keeps each fill within int32 indexing


def fill(i: int, seed: int, dev: torch.device) -> torch.Tensor:
    n = CHUNK // 4
    key = (seed * 1_000_003 + i * 7919) & 0x7FFFFFFF
    return torch.bitwise_xor(torch.arange(n, dtype=torch.int32, device=dev), key)


def print_reply(msg: str) -> None:
    print(msg, flush=True)


def file_reply(ctl: str):
    def reply(msg: str) -> None:
        tmp = os.path.join(ctl, "out.tmp")
        with open(tmp, "w") as f:
            f.write(msg + "\n")
        os.rename(tmp, os.path.join(ctl, "out"))

    return reply


def file_commands(ctl: str):
    path = os.path.join(ctl, "cmd")
    while True:
        try:
            with open(path) as f:
                line = f.read()
            os.unlink(path)
        except FileNotFoundError:
            time.sleep(0.2)
            continue
        yield line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--ctl", help="command directory (file protocol, for CRIU)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    chunks = [fill(i, a.seed, dev) for i in range(a.gib)]
    torch.cuda.synchronize(dev)
    reply = print_reply
    commands = sys.stdin
    if a.ctl:
        reply = file_reply(a.ctl)
        commands = file_commands(a.ctl)
    reply(f"ready {os.getpid()} {a.gib * CHUNK}")
    for line in commands:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "check":
            t0 = time.monotonic()
            bad = [i for i, c in enumerate(chunks) if not torch.equal(c, fill(i, a.seed, dev))]
            # New work after the wake: a matmul whose result is known.
            m = torch.ones(1024, 1024, device=dev)
            ok_mm = bool(torch.all(m @ m == 1024).item())
            torch.cuda.synchronize(dev)
            status = "ok" if not bad and ok_mm else f"bad chunks={bad} matmul={ok_mm}"
            reply(f"{status} {time.monotonic() - t0:.3f}")
        elif cmd[0] == "sleep":
            # One kernel that spins for ~S seconds (clock ~1.98 GHz under load).
            torch.cuda._sleep(int(float(cmd[1]) * 1.98e9))
            reply("launched")
        elif cmd[0] == "sync":
            torch.cuda.synchronize(dev)
            reply("synced")
        elif cmd[0] == "quit":
            break


if __name__ == "__main__":
    main()
