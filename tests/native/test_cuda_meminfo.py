"""``dynsnap-cuda --mem-info``: free memory of every visible GPU, one JSON line each, read as save and
resume read it (NVML first, the primary context as fallback). The agent records it before and after
a capture or wake (WorkerSnapshot status ``gpus``)."""

from __future__ import annotations

from cuda_harness import Stub

A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def test_every_visible_gpu_through_nvml(stub: Stub) -> None:
    stub.set_devices((A, 50 << 30, 80 << 30), (B, 70 << 30, 80 << 30))
    r = stub.run("--mem-info")
    assert r.rc == 0, r.err
    assert r.json() == [{"index": 0, "uuid": A, "free": 50 << 30, "source": "nvml"},
                        {"index": 1, "uuid": B, "free": 70 << 30, "source": "nvml"}]
    assert not any(fn.startswith("cuCheckpoint") for fn in stub.fns())  # reads only, touches no process


def test_falls_back_to_the_context_without_nvml(stub: Stub) -> None:
    stub.set_devices((A, 50 << 30, 80 << 30))
    stub.env["DYNSNAP_LIBNVML"] = "/nonexistent/libnvidia-ml.so.1"
    r = stub.run("--mem-info")
    assert r.rc == 0 and r.json()[0]["source"] == "cuda" and r.json()[0]["free"] == 50 << 30


def test_takes_no_pid_and_no_other_action(stub: Stub) -> None:
    for args in (["--mem-info", "--pid", "1"], ["--mem-info", "--get-state", "--pid", "1"]):
        r = stub.run(*args)
        assert r.rc == 2 and r.out == "" and stub.fns() == []
