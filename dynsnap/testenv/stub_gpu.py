"""The device side of the stand-in engine (``stub_engine``): the CUDA driver API through ctypes on
``libcuda.so.1``, the memory the engine holds on the device, and the model whose every token is
read from that memory.

Layer: ``dynsnap.testenv``. Standard library only: it runs inside the engine's process under the
Dynamo venv's python. In the local environment the library is the project's stub driver
(tests/native/stub_libcuda), whose calls made while the process is locked or checkpointed block
until it is resumed, as the real driver's do (DESIGN.md section 2); so a suspended engine holds a
request inside a driver call until its wake. The same calls exist in the real driver.

What the engine holds (``Device``): the weights, ``weights_bytes`` allocated on the device, and a
KV pool of ``kv_bytes`` allocated and never written (what a KV cache at a high
gpu-memory-utilization is). Of the weights, only the model's table (``vocab`` 64-bit words, 32 KiB
at the default) is written and read: the rest is held, accounted by the driver and never touched,
so CI moves no GiBs on two cores. ``offload`` is vLLM's sleep level 1: the written weights copied
to host memory, the weights and the pool freed on the device; ``reload`` allocates both again and
copies the weights back.

The model: a prompt's state is a 64-bit hash of its tokens; each token reads the table's word at
``state % vocab`` from device memory (``cuMemcpyDtoH``), picks one of the tokenizer's whole words
from it, mixes both into the state, and synchronizes (``cuCtxSynchronize``): two driver calls per
token. Same table, same
prompt, same answer: an answer after a wake that differs from the one before the sleep means the
weights did not come back as they were.
"""

from __future__ import annotations

import ctypes
import json
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

MASK = (1 << 64) - 1
SPECIAL = 6  # the tiny tokenizer's special tokens (bos, eos, pad, user, assistant, system): never generated
CU_NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
            3: "CUDA_ERROR_NOT_INITIALIZED", 101: "CUDA_ERROR_INVALID_DEVICE", 201: "CUDA_ERROR_INVALID_CONTEXT",
            801: "CUDA_ERROR_NOT_SUPPORTED", 999: "CUDA_ERROR_UNKNOWN"}


class CudaError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS."""

    def __init__(self, call: str, code: int) -> None:
        self.call, self.code = call, code
        super().__init__(f"{call} failed: {CU_NAMES.get(code, 'CUresult')} ({code})")


class Driver:
    """The driver calls the engine makes, on one device, from the thread that called :meth:`open`
    (a context is current per thread: the engine makes every device call from one thread)."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        c = ctypes
        for name, args in {"cuInit": [c.c_uint], "cuDevicePrimaryCtxRetain": [c.c_void_p, c.c_int],
                           "cuCtxSetCurrent": [c.c_void_p], "cuCtxSynchronize": [],
                           "cuMemAlloc_v2": [c.c_void_p, c.c_size_t], "cuMemFree_v2": [c.c_uint64],
                           "cuMemcpyHtoD_v2": [c.c_uint64, c.c_void_p, c.c_size_t],
                           "cuMemcpyDtoH_v2": [c.c_void_p, c.c_uint64, c.c_size_t],
                           "cuMemGetInfo_v2": [c.c_void_p, c.c_void_p]}.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, c.c_int

    def _call(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise CudaError(name, rc)

    def open(self, device: int = 0) -> None:
        ctx = ctypes.c_void_p()
        self._call("cuInit", 0)
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
        self._call("cuCtxSetCurrent", ctx)

    def alloc(self, n: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(ptr), n)
        return ptr.value

    def free(self, ptr: int) -> None:
        self._call("cuMemFree_v2", ptr)

    def htod(self, ptr: int, data: bytes) -> None:
        self._call("cuMemcpyHtoD_v2", ptr, data, len(data))

    def dtoh(self, ptr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self._call("cuMemcpyDtoH_v2", buf, ptr, n)
        return buf.raw

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        free_b, total_b = ctypes.c_size_t(), ctypes.c_size_t()
        self._call("cuMemGetInfo_v2", ctypes.byref(free_b), ctypes.byref(total_b))
        return free_b.value, total_b.value


def _mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit bijection that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK
    return x ^ (x >> 31)


def table(seed: int, vocab: int) -> bytes:
    """The model's weights: ``vocab`` little-endian 64-bit words, seeded."""
    return struct.pack(f"<{vocab}Q", *(_mix((seed << 32) + i) for i in range(vocab)))


def word_tokens(model_path: str, vocab: int) -> list[int]:
    """The ids of the tokenizer's whole words (a leading space, then letters), so that an answer reads
    as words; every id from SPECIAL up when the model directory has no such tokenizer.json."""
    try:
        pieces = json.loads((Path(model_path) / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        pieces = {}
    # "\u0120" is byte-level BPE's space
    words = sorted(i for p, i in pieces.items() if p.startswith("\u0120") and p[1:].isascii() and p[1:].isalpha()
                   and SPECIAL <= i < vocab)
    return words or list(range(SPECIAL, vocab))


def prompt_state(prompt: list[int]) -> int:
    h = 0xCBF29CE484222325  # FNV-1a's offset basis
    for t in prompt:
        h = (h ^ (t & MASK)) * 0x100000001B3 & MASK
    return _mix(h)


@dataclass
class Device:
    """The engine's device memory: its weights and KV pool, resident or offloaded to host memory."""

    driver: Driver
    weights_bytes: int
    kv_bytes: int
    vocab: int
    seed: int
    tokens: list[int]  # the ids it generates (word_tokens)
    weights: int = 0  # device pointers, 0 when not allocated
    kv: int = 0
    host: bytes | None = None  # the written weights while offloaded
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def table_bytes(self) -> int:
        return self.vocab * 8

    @property
    def resident(self) -> bool:
        return self.weights != 0

    def load(self) -> None:
        """The cold start's load: allocate, write the weights, allocate the pool."""
        if self.weights_bytes < self.table_bytes:
            raise ValueError(f"weights of {self.weights_bytes} bytes cannot hold the model's {self.table_bytes}")
        with self.lock:
            self._allocate(table(self.seed, self.vocab))

    def _allocate(self, weights: bytes) -> None:
        w = self.driver.alloc(self.weights_bytes)
        try:
            self.driver.htod(w, weights)
            kv = self.driver.alloc(self.kv_bytes) if self.kv_bytes else 0
        except BaseException:
            self.driver.free(w)
            raise
        self.weights, self.kv = w, kv

    def offload(self) -> None:
        """Sleep level 1: the weights to host memory, then the weights and the pool freed."""
        with self.lock:
            if not self.resident:
                return
            self.host = self.driver.dtoh(self.weights, self.table_bytes)
            self.driver.free(self.weights)
            self.weights = 0
            if self.kv:
                self.driver.free(self.kv)
                self.kv = 0

    def reload(self) -> None:
        """Wake: allocate again and copy the weights back (on failure nothing stays allocated and
        the host copy is kept, so a later wake can try again)."""
        with self.lock:
            if self.resident:
                return
            assert self.host is not None
            self._allocate(self.host)
            self.host = None

    def step(self, state: int) -> tuple[int, int]:
        """One token from ``state``: (token, next state); two driver calls."""
        with self.lock:
            if not self.resident:
                raise RuntimeError("the weights are not on the device (the engine sleeps)")
            idx = state % self.vocab
            (word,) = struct.unpack("<Q", self.driver.dtoh(self.weights + idx * 8, 8))
            self.driver.synchronize()
        tok = self.tokens[(word ^ state) % len(self.tokens)]
        return tok, _mix(state ^ word ^ tok)
