"""Where dynsnap-cuda reads free GPU memory: NVML first, a CUDA primary context as the fallback.

On the H200, retaining a primary context in the helper cost about 0.35 s per save and 0.2 s per
resume, and likely slowed the checkpoint itself (docs/BENCHMARKS.md), so with NVML at hand no
context may be retained for the reading. The free-memory refusal is a requirement either way:
it must use NVML's numbers when NVML answers, and still refuse when NVML is missing or fails.

The stub NVML reports `nvmlskew` bytes less free memory than the stub's cuMemGetInfo (the real
two differ as well: on the H200, 143152 MiB by NVML, 142629 MiB by cuMemGetInfo inside the
helper's context); the MiB in a refusal show whose number the CLI used.
"""

from __future__ import annotations

import pytest
from cuda_harness import CHECKPOINTED, LOCKED, RUNNING, Stub

GIB = 1 << 30
UUID0 = "GPU-28fd6b9c-4fb2-cd33-0776-4018cd000d99"
UUID1 = "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
CONTEXT = ("cuDevicePrimaryCtxRetain", "cuMemGetInfo")
# NVML return codes the tests inject.
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_UNKNOWN = 999


def nvml_fns(stub: Stub) -> list[str]:
    return [f for f in stub.fns() if f.startswith("nvml")]


def one_gpu(stub: Stub, free: int, skew: int) -> None:
    stub.set_devices((UUID0, free, 80 * GIB))
    stub.control(f"nvmlskew 0 {skew}")


# ---- NVML present: no context ----


def test_save_and_resume_read_memory_through_nvml_without_a_context(stub: Stub) -> None:
    one_gpu(stub, 10 * GIB, 1 * GIB)
    stub.control(f"mem 21 0 {8 * GIB}")
    r = stub.run("--action", "save", "--pid", "21", "--json")
    assert r.rc == 0, r.err
    (res,) = r.json()
    assert res["bytes"] == 8 * GIB and res["mem_source"] == "nvml"
    assert not [f for f in stub.fns() if f in CONTEXT], stub.log()
    # One init and one shutdown per process; the handle is looked up once, by the UUID as
    # nvidia-smi prints it, and read before and after the checkpoint.
    assert nvml_fns(stub) == ["nvmlInit_v2", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetMemoryInfo",
                              "nvmlDeviceGetMemoryInfo", "nvmlShutdown"]
    assert f"uuid={UUID0} dev=0 rc=0" in "\n".join(stub.log())
    n = len(stub.log())
    r = stub.run("--action", "resume", "--pid", "21", "--json")
    assert r.rc == 0, r.err
    (res,) = r.json()
    assert res["mem_source"] == "nvml" and res["bytes"] == 8 * GIB
    assert not [f for f in stub.fns()[n:] if f in CONTEXT]
    assert stub.state(21) == RUNNING


def test_save_and_resume_report_every_gpus_free_memory_before_and_after(stub: Stub) -> None:
    """The agent records each GPU's free memory around a save and a resume (status ``gpus``) from the
    helper's own ``{"gpus": [...]}`` line, read around the driver calls, instead of running two
    --mem-info helpers of its own (0.19 s each on the H200)."""
    stub.set_devices((UUID0, 10 * GIB, 80 * GIB), (UUID1, 30 * GIB, 80 * GIB))
    stub.control(f"nvmlskew 0 {GIB}")  # NVML's numbers, not the context's: 9 GiB free on GPU 0
    stub.control(f"mem 21 0 {8 * GIB}")
    r = stub.run("--action", "save", "--pid", "21", "--json")
    assert r.rc == 0, r.err
    assert r.gpus() == [
        {"index": 0, "uuid": UUID0, "free_before": 9 * GIB, "free_after": 17 * GIB, "source": "nvml"},
        {"index": 1, "uuid": UUID1, "free_before": 30 * GIB, "free_after": 30 * GIB, "source": "nvml"}]
    assert [rec["pid"] for rec in r.json()] == [21]  # the per-pid records are unchanged
    r = stub.run("--action", "resume", "--pid", "21", "--json")
    assert r.rc == 0, r.err
    assert r.gpus() == [
        {"index": 0, "uuid": UUID0, "free_before": 17 * GIB, "free_after": 9 * GIB, "source": "nvml"},
        {"index": 1, "uuid": UUID1, "free_before": 30 * GIB, "free_after": 30 * GIB, "source": "nvml"}]
    assert not [f for f in stub.fns() if f in CONTEXT] and stub.state(21) == RUNNING


def test_no_gpus_line_without_a_reading(stub: Stub) -> None:
    """No line where nothing was read or nothing changed: without --json, with --skip-mem, for a
    refused resume (nothing was done), and for lock and unlock."""
    one_gpu(stub, 10 * GIB, 0)
    stub.control(f"mem 21 0 {8 * GIB}")
    r = stub.run("--action", "save", "--pid", "21")
    assert r.rc == 0 and r.out == ""
    one_gpu(stub, 4 * GIB, 0)
    r = stub.run("--action", "resume", "--pid", "21", "--json")
    assert r.rc == 3 and r.gpus() is None and r.json()[0]["ok"] is False
    r = stub.run("--action", "resume", "--pid", "21", "--json", "--skip-mem")
    assert r.rc == 0 and r.gpus() is None and stub.state(21) == RUNNING
    for action in ("lock", "unlock"):
        r = stub.run("--action", action, "--pid", "21", "--json")
        assert r.rc == 0 and r.gpus() is None


def test_refusal_uses_nvmls_free_bytes(stub: Stub) -> None:
    one_gpu(stub, 10 * GIB, 3 * GIB)  # NVML: 7 GiB free; cuMemGetInfo would say 10 GiB
    stub.set_state(CHECKPOINTED, 21)
    r = stub.run("--action", "restore", "--pid", "21", "--need-bytes", str(8 * GIB), "--json")
    assert r.rc == 3
    assert "has 7168 MiB free" in r.err and "needs 8192 MiB" in r.err
    rec = r.json()[0]
    assert rec["mem_source"] == "nvml"
    # A refusal is never reported as success in the machine-readable result either.
    assert rec["ok"] is False and "7168 MiB free" in rec["error"] and rec["state_after"] == "checkpointed"
    assert stub.calls() == [] and stub.state(21) == CHECKPOINTED
    assert not [f for f in stub.fns() if f in CONTEXT]
    r = stub.run("--action", "restore", "--pid", "21", "--need-bytes", str(6 * GIB))
    assert r.rc == 0 and stub.state(21) == LOCKED


def test_refusal_after_a_save_through_nvml(stub: Stub) -> None:
    one_gpu(stub, 10 * GIB, 1 * GIB)
    stub.control(f"mem 21 0 {8 * GIB}")
    assert stub.run("--action", "save", "--pid", "21").rc == 0
    one_gpu(stub, 9 * GIB, 2 * GIB)  # another workload took memory meanwhile: NVML says 7 GiB
    r = stub.run("--action", "resume", "--pid", "21")
    assert r.rc == 3 and "has 7168 MiB free" in r.err and "needs 8192 MiB" in r.err
    assert stub.state(21) == CHECKPOINTED


def test_no_reading_no_nvml(stub: Stub) -> None:
    """Calls that sample nothing do not load NVML and say so in the JSON."""
    stub.set_state(CHECKPOINTED, 21)
    assert stub.run("--get-state", "--pid", "21").rc == 0
    r = stub.run("--action", "resume", "--pid", "21", "--json", "--need-bytes", str(GIB), "--skip-mem")
    assert r.rc == 0 and r.json()[0]["mem_source"] is None
    r = stub.run("--action", "lock", "--pid", "22", "--json")
    assert r.rc == 0 and r.json()[0]["mem_source"] is None
    assert nvml_fns(stub) == [] and not [f for f in stub.fns() if f in CONTEXT]


# ---- NVML missing or failing: the primary context ----


@pytest.mark.parametrize("lib", [
    pytest.param("/nonexistent/libnvidia-ml.so.1", id="missing"),
    pytest.param("stub_libcuda", id="lacks-nvml-symbols"),
])
def test_without_nvml_the_context_reads_memory(stub: Stub, lib: str) -> None:
    stub.env["DYNSNAP_LIBNVML"] = stub.env["DYNSNAP_LIBCUDA"] if lib == "stub_libcuda" else lib
    one_gpu(stub, 10 * GIB, 3 * GIB)  # the skew is NVML's: unused here
    stub.control(f"mem 21 0 {8 * GIB}")
    r = stub.run("--action", "save", "--pid", "21", "--json")
    assert r.rc == 0, r.err
    (res,) = r.json()
    assert res["bytes"] == 8 * GIB and res["mem_source"] == "cuda"
    fns = stub.fns()
    assert fns.count("cuDevicePrimaryCtxRetain") == 2 == fns.count("cuDevicePrimaryCtxRelease")
    assert nvml_fns(stub) == []
    one_gpu(stub, 5 * GIB, 3 * GIB)
    r = stub.run("--action", "resume", "--pid", "21", "--json")
    assert r.rc == 3 and "has 5120 MiB free" in r.err and "needs 8192 MiB" in r.err
    assert r.json()[0]["mem_source"] == "cuda"
    assert stub.state(21) == CHECKPOINTED
    one_gpu(stub, 9 * GIB, 3 * GIB)  # enough by cuMemGetInfo, not by NVML's figure
    r = stub.run("--action", "resume", "--pid", "21")
    assert r.rc == 0, r.err
    assert stub.state(21) == RUNNING


@pytest.mark.parametrize("fail,shutdowns", [
    pytest.param(f"fail nvmlInit_v2 * {NVML_ERROR_DRIVER_NOT_LOADED}", 0, id="init"),
    pytest.param(f"fail nvmlDeviceGetHandleByUUID * {NVML_ERROR_NOT_FOUND}", 1, id="handle"),
    pytest.param(f"fail nvmlDeviceGetMemoryInfo * {NVML_ERROR_UNKNOWN}", 1, id="meminfo"),
])
def test_a_failing_nvml_call_falls_back_to_the_context(stub: Stub, fail: str, shutdowns: int) -> None:
    one_gpu(stub, 10 * GIB, 3 * GIB)
    stub.control(fail)
    stub.set_state(CHECKPOINTED, 21)
    r = stub.run("--action", "restore", "--pid", "21", "--need-bytes", str(12 * GIB), "--json")
    assert r.rc == 3 and "has 10240 MiB free" in r.err and "needs 12288 MiB" in r.err
    assert r.json()[0]["mem_source"] == "cuda"
    assert stub.calls() == [] and stub.state(21) == CHECKPOINTED
    assert stub.fns().count("cuDevicePrimaryCtxRetain") == 1
    # nvmlShutdown balances a successful nvmlInit_v2, and only that.
    assert nvml_fns(stub).count("nvmlShutdown") == shutdowns
    r = stub.run("--action", "restore", "--pid", "21", "--need-bytes", str(9 * GIB))
    assert r.rc == 0 and stub.state(21) == LOCKED


def test_fallback_is_per_device(stub: Stub) -> None:
    """NVML failing on one GPU moves only that GPU's reading to a context."""
    stub.set_devices((UUID0, 40 * GIB, 80 * GIB), (UUID1, 2 * GIB, 80 * GIB))
    stub.control(f"nvmlskew 0 {GIB}", f"nvmlskew 1 {GIB}",
                 f"fail nvmlDeviceGetMemoryInfo 1 {NVML_ERROR_UNKNOWN}")
    stub.set_state(CHECKPOINTED, 21)
    r = stub.run("--action", "restore", "--pid", "21", "--need-bytes", str(3 * GIB), "--json")
    assert r.rc == 3 and "GPU 1" in r.err and "has 2048 MiB free" in r.err
    assert r.json()[0]["mem_source"] == "nvml+cuda"
    assert [line for line in stub.log() if line.startswith("cuDevicePrimaryCtxRetain")] == [
        "cuDevicePrimaryCtxRetain dev=1 rc=0"]
    stub.control(f"nvmlskew 0 {39 * GIB}")  # NVML's figure for GPU 0 now refuses
    r = stub.run("--action", "restore", "--pid", "21", "--need-bytes", str(GIB + GIB // 2))
    assert r.rc == 3 and "GPU 0" in r.err and "has 1024 MiB free" in r.err


def test_a_rolled_back_save_reads_and_records_nothing(stub: Stub) -> None:
    """No reading was taken before the checkpoint, so none is taken after, and no bytes are made up."""
    one_gpu(stub, 10 * GIB, 0)
    stub.control("fail cuCheckpointProcessLock 12 2")
    r = stub.run("--action", "save", "--pid", "11,12", "--json")
    assert r.rc == 1 and "rolled back" in r.err
    assert [(x["bytes"], x["mem_source"]) for x in r.json()] == [(None, None), (None, None)]
    assert not stub.records.exists() or not list(stub.records.iterdir())
    assert nvml_fns(stub) == [] and not [f for f in stub.fns() if f in CONTEXT]
