"""dynsnap-entrypoint as PID 1 of a fresh pid + mount namespace, with small Python workers.

Each sandbox is `unshare --pid --fork --mount-proc --mount -- dynsnap-entrypoint ... -- WORKER`
(root needed), the way a container runtime would start it. The tests assert what a pod would
see: exit codes, probe answers, the control file, the pids handed out, the log on stdout.
Real CRIU 4.2.1 dumps and restores a worker tree here when it is built; the Dynamo-mocker
version (pinned request through the frontend) is tests/integration/test_snapshot_in_place.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cuda_harness import CHECKPOINTED, RUNNING, Stub
from entrypoint_harness import BUILD, Sandbox, free_port, ns_pid, wait_for

from dynsnap.models import protocol

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for unshare --pid and ns_last_pid")


# Run through nsenter inside a sandbox: recreate a worker at a chosen pid the way CRIU restores
# one in place (set the pid counter, fork, the forking parent exits so the new tree is
# reparented to the namespace's init), with its output appended to the same log file.
RESTORE = textwrap.dedent(r'''
    import os, sys
    pid, log_file, worker, ctl = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))
    child = os.fork()
    if child == 0:
        os.setsid()
        out = os.open(log_file, os.O_WRONLY | os.O_APPEND)
        os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.execv(sys.executable, [sys.executable, worker, "serve"])
    print(child, flush=True)
''')


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "env", "message"), [
    ([], {"DYN_SYSTEM_PORT": "9090"}, "no worker command given"),
    (["--bogus", "--", "true"], {"DYN_SYSTEM_PORT": "9090"}, 'unknown option "--bogus"'),
    (["--probe-port", "http", "--", "true"], {"DYN_SYSTEM_PORT": "9090"}, 'not a port number: "http"'),
    (["--probe-port=70000", "true"], {"DYN_SYSTEM_PORT": "9090"}, 'not a port number: "70000"'),
    (["--control-dir"], {"DYN_SYSTEM_PORT": "9090"}, "--control-dir needs a value"),
    (["--control-dir", "relative", "true"], {"DYN_SYSTEM_PORT": "9090"}, "must be an absolute path"),
    (["true"], {}, "set DYN_SYSTEM_PORT or --system-port"),
    (["--probe-port", "9090", "true"], {"DYN_SYSTEM_PORT": "9090"}, "is the worker's system port"),
    (["--thp-preload", "lib.so", "true"], {"DYN_SYSTEM_PORT": "9090"}, "--thp-preload must be an absolute path"),
    (["true"], {"DYN_SYSTEM_PORT": "9090", "DYNSNAP_THP_PRELOAD": "lib.so"},
     '$DYNSNAP_THP_PRELOAD must be an absolute path or "off": "lib.so"'),
    (["--no-seccomp=yes", "true"], {"DYN_SYSTEM_PORT": "9090"}, "--no-seccomp takes no value"),
    (["--log-file", "/" + "a" * 5000, "true"], {"DYN_SYSTEM_PORT": "9090"}, "--log-file: path too long"),
])
def test_bad_arguments_are_a_usage_error(entrypoint_bin: Path, args: list[str], env: dict[str, str],
                                         message: str) -> None:
    base = {k: v for k, v in os.environ.items() if k != "DYN_SYSTEM_PORT"}
    r = subprocess.run([str(entrypoint_bin), *args], env={**base, **env}, capture_output=True, text=True,
                       timeout=10)
    assert r.returncode == 2
    assert message in r.stderr
    assert "usage: dynsnap-entrypoint" in r.stderr


def test_options_after_the_command_are_the_workers(entrypoint_bin: Path, tmp_path: Path) -> None:
    # the first word that is not one of its options starts the worker's command line, "--" or not
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--", str(entrypoint_bin),
                        "--control-dir", str(tmp_path / "c"), "--probe-port", str(free_port()),
                        "--system-port", str(free_port()), "/bin/sh", "-c", 'echo "worker argv: $*"', "sh",
                        "--no-seccomp", "--bogus", "-h", "--", "x"],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    assert "worker argv: --no-seccomp --bogus -h -- x" in r.stdout
    ctl = json.loads((tmp_path / "c" / protocol.ENTRYPOINT_CONTROL_FILE).read_text())
    assert ctl["seccomp"] == "on"  # the worker's --no-seccomp is not the entrypoint's
    assert ctl["worker_command"] == "/bin/sh -c echo \"worker argv: $*\" sh --no-seccomp --bogus -h -- x"


def test_help(entrypoint_bin: Path) -> None:
    r = subprocess.run([str(entrypoint_bin), "--help"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0
    assert "--no-seccomp" in r.stdout
    assert "--thp-preload PATH" in r.stdout and "--no-thp-preload" in r.stdout


def test_binary_is_static(entrypoint_bin: Path) -> None:
    r = subprocess.run(["file", "-L", str(entrypoint_bin)], capture_output=True, text=True, check=True)
    assert "statically linked" in r.stdout


def test_pid_range_is_reserved_before_anything_starts(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    ctl = sb.control_file()
    assert ctl["pid"] == 1
    assert ctl["pid_floor"] == protocol.PID_FLOOR
    assert ctl["pid_reserved"] is True
    assert ctl["worker_pid"] >= protocol.PID_FLOOR
    assert ctl["worker_pid"] == ctl["worker_pgid"] == ctl["worker_sid"]
    # the worker's own view, and its helper's, agree
    pids = [int(p) for p in re.findall(r"started mode=serve pid=(\d+) pgid=\1 sid=\1", sb.out())]
    assert pids == [ctl["worker_pid"]]
    helper = wait_for(lambda: re.search(r"worker\[(\d+)\]: helper running", sb.out()), "the helper")
    assert int(helper.group(1)) > ctl["worker_pid"]
    # a process entering the namespace later lands above the floor too
    later = int(sb.nsenter("sh", "-c", "echo $$").strip())
    assert later >= protocol.PID_FLOOR
    # with the right to write ns_last_pid, reserved by that one write (no children cycled)
    assert "starting and reaping" not in sb.err() and "RESERVATION FAILED" not in sb.err()


def test_probes_mirror_the_worker_while_active_and_answer_for_it_otherwise(
        sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    code, body, headers = sb.get("/health")
    assert (code, json.loads(body)["worker"], headers["x-dynsnap-state"]) == (200, "health", "active")
    assert sb.status("/live") == 200
    sb.set_worker("health", 503)
    assert sb.status("/health") == 503
    sb.set_worker("live", 500)
    code, body, _ = sb.get("/live")
    assert (code, json.loads(body)["worker"]) == (500, "live")
    sb.set_worker("live", 200)
    sb.set_worker("health", 200)

    for state in ("suspending", "suspended", "snapshotted", "restoring"):
        assert sb.request(state)["state"] == state
        code, body, headers = sb.get("/health")
        assert code == 503, state
        assert json.loads(body)["state"] == state
        assert headers["x-dynsnap-state"] == state
        assert sb.status("/live") == 200, state
        # the worker is not asked while it is not active, even if it would say it is broken
        sb.set_worker("live", 500)
        assert sb.status("/live") == 200, state
        sb.set_worker("live", 200)

    assert sb.request("active")["state"] == "active"
    assert sb.status("/health") == 200
    assert sb.status("/nope") == 404
    # the probe answers came from the worker only while active, and the worker logged them
    wait_for(lambda: 'served "GET /health HTTP/1.0" 503' in sb.out(), "the worker's log on stdout")


def test_asleep_routable_the_entrypoint_answers_ready_for_the_worker(sandbox: Callable[..., Sandbox]) -> None:
    """State routable (wake on request): the pod must stay Ready, its endpoint listed, while the worker's
    own /health would wait in a CUDA call; the entrypoint answers 200 itself, never asking the worker."""
    sb = sandbox(["serve"])
    sb.wait_up()
    sb.set_worker("health", 503)  # what the worker would say: not asked while routable
    assert sb.request("routable")["state"] == "routable"
    code, body, headers = sb.get("/health")
    assert (code, json.loads(body)["source"], json.loads(body)["state"], headers["x-dynsnap-state"]) == (
        200, "dynsnap-entrypoint", "routable", "routable")
    assert sb.status("/live") == 200
    assert sb.request("active")["state"] == "active"
    assert sb.status("/health") == 503  # the worker's own answer again


def test_worker_exiting_while_routable_ends_the_container(sandbox: Callable[..., Sandbox]) -> None:
    """Asleep routable the process lives on (tier suspend) and still holds requests: its death is a
    crash, and the container ends with it so that the kubelet restarts it."""
    sb = sandbox(["serve"])
    sb.wait_up()
    worker = sb.worker_host_pid()
    sb.request("routable")
    os.killpg(worker, signal.SIGKILL)
    assert sb.wait() == 128 + signal.SIGKILL


def test_probes_report_an_unreachable_worker_while_active(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"], opts=["--system-port", str(free_port())])  # nothing listens there
    wait_for(lambda: "helper running" in sb.out(), "the worker")
    code, body, _ = sb.get("/live")
    assert code == 503
    assert "connection refused" in body


def test_worker_crash_exits_with_the_same_code(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["crash", "7"])
    assert sb.wait() == 7
    assert "started mode=crash" in sb.out()
    assert sb.control_file()["worker_status"] == 7


def test_missing_worker_command_exits_127(entrypoint_bin: Path, tmp_path: Path) -> None:
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--", str(entrypoint_bin),
                        "--control-dir", str(tmp_path / "c"), "--probe-port", str(free_port()), "--",
                        "/no/such/worker"], env={**os.environ, "DYN_SYSTEM_PORT": str(free_port())},
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 127
    assert 'cannot run "/no/such/worker": No such file or directory' in r.stderr


@pytest.mark.parametrize("term_exit", [0, 3])
def test_sigterm_reaches_the_worker_group_and_the_container_stops_with_its_status(
        sandbox: Callable[..., Sandbox], term_exit: int) -> None:
    sb = sandbox(["serve"], env={"WORKER_TERM_EXIT": str(term_exit)})
    sb.wait_up()
    wait_for(lambda: "helper running" in sb.out(), "the helper")
    os.kill(sb.pid1, signal.SIGTERM)  # what kubelet does to the container's PID 1
    assert sb.wait() == term_exit
    out = sb.out()
    assert "got SIGTERM" in out
    assert "helper got SIGTERM" in out  # the whole process group, not just the leader
    assert "stdin=/dev/null" in out
    assert "passing signal 15 to the worker's process group" in sb.err()


def test_worker_output_goes_to_a_log_file_and_to_stdout(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    log_file = Path(sb.control_file()["log_file"])
    assert log_file == sb.control / protocol.ENTRYPOINT_LOG_FILE
    wait_for(lambda: "helper running" in sb.out(), "the copy on stdout")
    assert "helper running" in log_file.read_text()
    assert sb.out() in log_file.read_text() or log_file.read_text() in sb.out()


def _ignore_int_quit() -> None:
    # As a shell's background job starts: SIGINT and SIGQUIT ignored, inherited across exec.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def test_worker_starts_with_no_blocked_or_ignored_signals(entrypoint_bin: Path, tmp_path: Path) -> None:
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--", str(entrypoint_bin),
                        "--control-dir", str(tmp_path / "c"), "--probe-port", str(free_port()),
                        "--system-port", str(free_port()), "--",
                        "/bin/sh", "-c", "grep -E '^Sig(Blk|Ign)' /proc/self/status"],
                       capture_output=True, text=True, timeout=20, preexec_fn=_ignore_int_quit)
    assert r.returncode == 0
    assert re.search(r"^SigBlk:\s+0+$", r.stdout, re.M), r.stdout
    assert re.search(r"^SigIgn:\s+0+$", r.stdout, re.M), r.stdout


def test_log_file_is_emptied_past_its_cap_once_copied(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["chatty"], opts=["--log-max-bytes", "4096"])
    sb.set_worker("go", 1)
    assert sb.wait() == 0
    out = sb.out()
    assert "line 0-0 " in out
    assert "chatty done" in out
    # a line written between the last read and the truncation may be lost; nearly all arrive
    assert len(re.findall(r"^line \d+-\d+ x+$", out, re.M)) >= 390
    assert (sb.control / protocol.ENTRYPOINT_LOG_FILE).stat().st_size < 4096 + 3000


def test_log_file_keeps_its_size_while_not_active(sandbox: Callable[..., Sandbox]) -> None:
    # CRIU refuses to restore a descriptor whose file changed size since the dump
    sb = sandbox(["chatty"], opts=["--log-max-bytes", "4096"])
    sb.request("suspending")
    sb.set_worker("go", 1)
    wait_for(lambda: sb.control_file()["worker_alive"] is False, "the worker's exit", timeout=20)
    log_text = (sb.control / protocol.ENTRYPOINT_LOG_FILE).read_text()
    assert len(re.findall(r"^line \d+-\d+ x+$", log_text, re.M)) == 400
    wait_for(lambda: "chatty done" in sb.out(), "the copy on stdout")


def _unprivileged(entrypoint_bin: Path, where: str, *opts: str) -> subprocess.CompletedProcess[str]:
    # as an unprivileged user in the namespace, ns_last_pid cannot be written
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--",
                           "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                           str(entrypoint_bin), *opts, "--control-dir", f"{where}/c",
                           "--probe-port", str(free_port()), "--system-port", str(free_port()),
                           "--", "/bin/sh", "-c", "echo worker pid=$$"],
                          capture_output=True, text=True, timeout=20)


def test_unprivileged_entrypoint_reserves_by_cycling_pids(entrypoint_bin: Path) -> None:
    # what a container that is not privileged gets (its /proc/sys is read-only): the counter is
    # walked past the floor by short-lived children, and the worker's pid is above it
    with tempfile.TemporaryDirectory(dir="/tmp") as where:
        os.chmod(where, 0o777)
        r = _unprivileged(entrypoint_bin, where)
        ctl = json.loads((Path(where) / "c" / protocol.ENTRYPOINT_CONTROL_FILE).read_text())
    assert r.returncode == 0, r.stderr
    assert "moved the pid counter to the floor by starting and reaping" in r.stderr
    assert "Operation not permitted" in r.stderr and "RESERVATION FAILED" not in r.stderr
    assert ctl["pid_reserved"] is True
    assert ctl["worker_pid"] >= protocol.PID_FLOOR
    assert f"worker pid={ctl['worker_pid']}" in r.stdout


def test_failed_pid_reservation_is_loud_and_recorded(entrypoint_bin: Path) -> None:
    # ns_last_pid cannot be written and cycling is turned off
    with tempfile.TemporaryDirectory(dir="/tmp") as where:
        os.chmod(where, 0o777)
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--",
                            "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                            str(entrypoint_bin), "--no-pid-cycle", "--control-dir", f"{where}/c",
                            "--probe-port", str(free_port()), "--system-port", str(free_port()),
                            "--", "/bin/sh", "-c", "echo worker pid=$$"],
                           capture_output=True, text=True, timeout=20)
        ctl = json.loads((Path(where) / "c" / protocol.ENTRYPOINT_CONTROL_FILE).read_text())
    assert r.returncode == 0
    assert "WARNING: PID RESERVATION FAILED" in r.stderr
    assert "Operation not permitted" in r.stderr
    assert ctl["pid_reserved"] is False
    assert ctl["worker_pid"] < protocol.PID_FLOOR
    assert f"worker pid={ctl['worker_pid']}" in r.stdout
    assert ctl["seccomp"] == "on"  # unprivileged: installed with no_new_privs


@pytest.mark.parametrize(("opts", "expected"), [
    ([], r"fd=-1 errno=38"),  # ENOSYS: what makes Dynamo's runtime fall back to epoll
    (["--no-seccomp"], r"fd=\d+ errno=0"),
])
def test_io_uring_is_refused_with_enosys_unless_turned_off(sandbox: Callable[..., Sandbox], opts: list[str],
                                                           expected: str) -> None:
    sb = sandbox(["iouring"], opts=opts)
    sb.set_worker("go", 1)
    assert sb.wait() == 0
    assert re.search(f"io_uring_setup {expected}\n", sb.out())
    assert sb.control_file()["seccomp"] == ("off" if opts else "on")


def test_worker_tree_exiting_while_snapshotted_keeps_the_container_up(
        sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    worker = sb.worker_host_pid()
    sb.request("snapshotted")
    os.killpg(worker, signal.SIGKILL)  # what the end of a CRIU dump does to the tree
    ctl = wait_for(lambda: (c := sb.control_file())["worker_alive"] is False and c, "the worker's exit")
    assert ctl["worker_status"] == 128 + signal.SIGKILL
    time.sleep(0.5)
    assert sb.running()
    assert sb.status("/live") == 200
    assert sb.status("/health") == 503
    assert "staying up for the agent" in sb.err()
    # the agent gives up (no restore): back to active with no worker means a fresh container
    sb.request("active")
    assert sb.wait() == protocol.ENTRYPOINT_EXIT_NO_WORKER


def test_sigterm_with_no_worker_stops_cleanly(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    worker = sb.worker_host_pid()
    sb.request("suspending")
    os.killpg(worker, signal.SIGKILL)
    wait_for(lambda: sb.control_file()["worker_alive"] is False, "the worker's exit")
    os.kill(sb.pid1, signal.SIGTERM)
    assert sb.wait() == 0


def test_worker_exiting_while_active_or_suspended_ends_the_container(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    worker = sb.worker_host_pid()
    sb.request("suspended")  # tier 1: the process lives on, so its death is a real crash
    os.killpg(worker, signal.SIGKILL)
    assert sb.wait() == 128 + signal.SIGKILL


def test_a_tree_restored_in_place_is_adopted_and_reaped(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"], env={"WORKER_TERM_EXIT": "9"})
    sb.wait_up()
    before = sb.control_file()
    worker = sb.worker_host_pid()
    sb.request("suspending")
    os.killpg(worker, signal.SIGKILL)
    wait_for(lambda: sb.control_file()["worker_alive"] is False, "the worker's exit")
    sb.request("snapshotted")
    sb.request("restoring")
    restorer = sb.tmp / "restore.py"
    restorer.write_text(RESTORE)
    pid = int(sb.nsenter(sys.executable, str(restorer), str(before["worker_pid"]), before["log_file"],
                         str(sb.script), str(sb.worker_ctl)).strip())
    assert pid == before["worker_pid"]  # recreated at its old pid, as CRIU does
    wait_for(lambda: sb.out().count("helper running") == 2, "the restored worker's log on stdout")
    ctl = sb.request("active")
    assert (ctl["state"], ctl["worker_alive"], ctl["worker_pid"]) == ("active", True, pid)
    sb.wait_up()
    assert json.loads(sb.get("/health")[1])["pid"] == pid
    # the restored leader is the entrypoint's child now: signals reach its group, and its exit
    # status is reaped and becomes the container's
    assert ns_pid(sb.worker_host_pid()) == pid
    os.kill(sb.pid1, signal.SIGTERM)
    assert sb.wait() == 9
    assert sb.out().count("helper got SIGTERM") == 1
    assert sb.out().count("started mode=serve") == 2  # before and after, both on stdout


def test_a_request_left_by_a_previous_container_is_ignored(sandbox: Callable[..., Sandbox],
                                                            tmp_path: Path) -> None:
    # the control directory is an emptyDir: it outlives a container restart
    control = tmp_path / "sandbox0" / "control"
    control.mkdir(parents=True)
    (control / protocol.ENTRYPOINT_REQUEST_FILE).write_text("7 snapshotted\n")
    sb = sandbox(["serve"])
    sb.wait_up()
    time.sleep(0.3)
    ctl = sb.control_file()
    assert (ctl["state"], ctl["request_seq"]) == ("active", 0)
    assert sb.status("/health") == 200


def test_bad_state_requests_are_refused_and_acknowledged(sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"])
    sb.wait_up()
    ctl = sb.request("sleeping")
    assert ctl["state"] == "active"
    assert ctl["request_error"] == 'unknown state "sleeping"'
    ctl = sb.request("suspending")
    assert (ctl["state"], ctl["request_error"]) == ("suspending", None)
    # a stale sequence number is ignored
    (sb.control / protocol.ENTRYPOINT_REQUEST_FILE).write_text("1 active\n")
    time.sleep(0.4)
    assert sb.control_file()["state"] == "suspending"


def _cycle_requests(control: Path, count: int, *, root: Path = Path("/")) -> list[dict[str, Any]]:
    """``count`` requests in a row through the agent's own EntrypointControl, each acknowledged
    (``control`` a path in the file system ``root`` is the root of)."""
    from dynsnap.agent.entrypoint_control import EntrypointControl

    states = [protocol.EntrypointState.SUSPENDING, protocol.EntrypointState.SUSPENDED,
              protocol.EntrypointState.RESTORING, protocol.EntrypointState.ACTIVE]

    async def run() -> list[dict[str, Any]]:
        ctl = EntrypointControl(control, root=root)
        return [await ctl.request(states[i % len(states)], timeout=10.0) for i in range(count)]

    acks = asyncio.run(run())
    for i, ack in enumerate(acks):
        assert (ack["state"], ack["request_seq"], ack["request_error"]) == (states[i % len(states)].value, i + 1,
                                                                            None), ack
    return acks


@pytest.mark.parametrize("fs", ["disk", "tmpfs"])  # an emptyDir on the node's disk, or medium: Memory
def test_a_state_request_wakes_the_entrypoint_through_its_inotify_watch(
        sandbox: Callable[..., Sandbox], tmp_path: Path, fs: str) -> None:
    # issue 12, wake latency: a request is taken when the agent renames it into place, not at the
    # next 100 ms tick; the agent reaches the directory as it does without a mount, through
    # /proc/<entrypoint>/root
    control = tmp_path / "sandbox0" / "control"
    control.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        if fs == "tmpfs":
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(control)], check=True)
            stack.callback(subprocess.run, ["umount", "-l", str(control)], check=True)
        sb = sandbox(["serve"])
        sb.wait_up()
        ctl = sb.control_file()
        assert (ctl["request_wakeup"], ctl["request_noticed"]) == ("inotify", None)
        if fs == "tmpfs":
            assert os.stat(control).st_dev != os.stat(tmp_path).st_dev
        acks = _cycle_requests(control, 20, root=Path(f"/proc/{sb.pid1}/root"))
        noticed = [a["request_noticed"] for a in acks]
        # "inotify": the watch's event is what woke the loop's poll(). The tick can still take one
        # now and then, when the rename lands in the microseconds between a tick's wakeup and the
        # read of the file; without the watch in the poll set every one of them is "tick".
        assert noticed.count("inotify") >= 18, noticed
        assert set(noticed) <= {"inotify", "tick"}, noticed
        assert sb.status("/health") == 200  # the last request, active, is in force
        assert "no inotify watch" not in sb.err()


def test_without_inotify_the_tick_still_serves_requests(sandbox: Callable[..., Sandbox]) -> None:
    # no inotify instance to be had (the limit reached: what a node with many watchers meets)
    sb = sandbox(["serve"], inotify_instances=0)
    sb.wait_up()
    ctl = sb.control_file()
    assert (ctl["request_wakeup"], ctl["request_noticed"]) == ("tick", None)
    acks = _cycle_requests(sb.control, 8)
    assert [a["request_noticed"] for a in acks] == ["tick"] * 8
    assert sb.status("/health") == 200
    err = sb.err()
    assert err.count("no inotify watch") == 1, err  # logged once, at start
    assert f"no inotify watch on {sb.control} (inotify_init1: Too many open files)" in err
    assert "user.max_inotify_instances in a user namespace" in err


def _criu() -> Path:
    """DYNSNAP_CRIU (./run sets it), else the newest patched build hack/lib-criu.sh left."""
    if os.environ.get("DYNSNAP_CRIU"):
        return Path(os.environ["DYNSNAP_CRIU"])
    built = sorted(Path.home().glob(".cache/dynsnap/criu-4.2.1-p*/sbin/criu"), key=lambda p: p.stat().st_mtime)
    return built[-1] if built else Path.home() / ".cache/dynsnap/criu-4.2.1-p*/sbin/criu"


CRIU = _criu()


@pytest.mark.skipif(not CRIU.is_file(), reason=f"CRIU not built at {CRIU} (./run setup builds it)")
def test_criu_dumps_the_worker_tree_and_restores_it_under_the_same_pid1(
        sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"], env={"WORKER_TERM_EXIT": "9"})
    sb.wait_up()
    wait_for(lambda: "helper running" in sb.out(), "the helper")
    before = sb.control_file()
    images = sb.tmp / "images"
    images.mkdir()

    # the agent's order: out of service (acked) first, then the dump of the worker's subtree
    sb.request("suspending")
    dump = subprocess.run(["nsenter", "-t", str(sb.pid1), "-p", "-m", "--", str(CRIU), "dump",
                           "-t", str(before["worker_pid"]), "-D", str(images), "-o", "dump.log", "-v4"],
                          capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, (images / "dump.log").read_text()[-3000:]
    ctl = wait_for(lambda: (c := sb.control_file())["worker_alive"] is False and c, "the dumped tree to exit")
    assert ctl["worker_status"] == 128 + signal.SIGKILL
    sb.request("snapshotted")
    time.sleep(0.3)
    assert sb.running()
    assert (sb.status("/live"), sb.status("/health")) == (200, 503)

    sb.request("restoring")
    restore = subprocess.run(["nsenter", "-t", str(sb.pid1), "-p", "-m", "--", str(CRIU), "restore",
                              "--restore-detached", "-D", str(images), "-o", "restore.log", "-v4"],
                             capture_output=True, text=True, timeout=120)
    assert restore.returncode == 0, (images / "restore.log").read_text()[-3000:]
    ctl = sb.request("active")
    assert (ctl["state"], ctl["worker_alive"]) == ("active", True)
    restored = sb.worker_host_pid()  # a child of PID 1 again, at its old pid
    assert ns_pid(restored) == before["worker_pid"]
    assert str(THP_LIB) in maps_paths(restored)  # the preloaded library is part of the restored tree
    sb.wait_up()
    assert json.loads(sb.get("/health")[1])["pid"] == before["worker_pid"]
    # the restored process (not a new one) keeps logging to the same file, copied to stdout
    assert sb.out().count("started mode=serve") == 1
    wait_for(lambda: sb.out().count('served "GET /health HTTP/1.0" 200') >= 2, "logs after the restore")
    # still io_uring-free after the restore (the filter is part of the dumped state)
    assert not [fd for fd in Path(f"/proc/{restored}/fd").iterdir() if "io_uring" in os.readlink(fd)]
    status = Path(f"/proc/{restored}/status").read_text()
    assert re.search(r"^Seccomp:\s+2$", status, re.M)
    os.kill(sb.pid1, signal.SIGTERM)
    assert sb.wait() == 9
    assert "helper got SIGTERM" in sb.out()


@pytest.mark.skipif(not CRIU.is_file(), reason=f"CRIU not built at {CRIU} (./run setup builds it)")
def test_without_the_filter_the_worker_keeps_an_io_uring_and_criu_cannot_dump_it(
        sandbox: Callable[..., Sandbox]) -> None:
    sb = sandbox(["serve"], opts=["--no-seccomp"])
    sb.wait_up()
    worker = sb.worker_host_pid()
    assert [fd for fd in Path(f"/proc/{worker}/fd").iterdir() if "io_uring" in os.readlink(fd)]
    images = sb.tmp / "images"
    images.mkdir()
    sb.request("suspending")
    dump = subprocess.run(["nsenter", "-t", str(sb.pid1), "-p", "-m", "--", str(CRIU), "dump",
                           "-t", str(sb.control_file()["worker_pid"]), "-D", str(images), "-o", "dump.log"],
                          capture_output=True, text=True, timeout=120)
    assert dump.returncode != 0
    # a failed dump leaves the tree running; the agent puts it back in service
    assert sb.request("active")["worker_alive"] is True
    assert sb.status("/health") == 200


# -- the huge-page library (libdynsnap-thp.so) on the worker ------------------------------------------

THP_LIB = BUILD / "libdynsnap-thp.so"
COPY_MIB = 128  # above the library's 64 MiB threshold, as every real driver copy is


def maps_paths(pid: int) -> set[str]:
    return {f[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if len(f := line.split()) >= 6}


def environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(kv.split("=", 1) for kv in items if "=" in kv)


def vma(pid: int, addr: int) -> dict[str, str]:
    """The smaps entry of the mapping that holds addr: its range, sizes and VmFlags."""
    found: dict[str, str] | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if found is not None:
                break
            if lo <= addr < hi:
                found = {"range": head}
        elif found is not None:
            key, _, value = line.partition(":")
            found[key] = value.strip()
    assert found is not None, f"no mapping of pid {pid} holds {addr:#x}"
    return found


def kib(value: str) -> int:
    return int(value.split()[0])


def thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return re.search(r"\[(\w+)\]", text).group(1)  # type: ignore[union-attr]


def test_the_worker_preloads_the_library_first_and_keeps_its_own_preloads(
        sandbox: Callable[..., Sandbox], stub_lib: Path) -> None:
    # default: the library next to the entrypoint's binary; the container's LD_PRELOAD stays after it
    sb = sandbox(["serve"], env={"LD_PRELOAD": str(stub_lib)})
    sb.wait_up()
    worker = sb.worker_host_pid()
    assert environ(worker)["LD_PRELOAD"] == f"{THP_LIB}:{stub_lib}"
    assert {str(THP_LIB), str(stub_lib)} <= maps_paths(worker)
    assert sb.control_file()["thp_preload"] == str(THP_LIB)
    assert f"thp preload {THP_LIB})" in sb.err()


@pytest.mark.parametrize("off", [["--no-thp-preload"], ["--thp-preload", str(THP_LIB), "--no-thp-preload"],
                                 "DYNSNAP_THP_PRELOAD=off"])
def test_the_preload_can_be_turned_off(sandbox: Callable[..., Sandbox], stub_lib: Path,
                                       off: list[str] | str) -> None:
    env = {"LD_PRELOAD": str(stub_lib)}
    if isinstance(off, str):
        env.update([off.split("=", 1)])
    sb = sandbox(["serve"], opts=off if isinstance(off, list) else [], env=env)
    sb.wait_up()
    worker = sb.worker_host_pid()
    assert environ(worker)["LD_PRELOAD"] == str(stub_lib)
    assert str(THP_LIB) not in maps_paths(worker)
    assert sb.control_file()["thp_preload"] is None
    assert "thp preload off)" in sb.err()


def test_an_explicit_library_is_preloaded_and_a_missing_one_is_loud(sandbox: Callable[..., Sandbox],
                                                                     tmp_path: Path) -> None:
    elsewhere = tmp_path / "lib" / "libdynsnap-thp.so"  # an image that keeps it apart from the binary
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(THP_LIB.read_bytes())
    sb = sandbox(["serve"], env={"DYNSNAP_THP_PRELOAD": str(elsewhere)})
    sb.wait_up()
    assert environ(sb.worker_host_pid())["LD_PRELOAD"] == str(elsewhere)  # none before: just the library
    assert sb.control_file()["thp_preload"] == str(elsewhere)

    missing = tmp_path / "nowhere" / "libdynsnap-thp.so"
    sb = sandbox(["serve"], opts=["--thp-preload", str(missing)])
    sb.wait_up()  # the worker still serves
    assert "LD_PRELOAD" not in environ(sb.worker_host_pid())
    assert sb.control_file()["thp_preload"] is None
    assert f"WARNING: HUGE-PAGE LIBRARY NOT PRELOADED: {missing}: No such file or directory" in sb.err()


@pytest.mark.parametrize("preload", [True, False], ids=["default", "no-thp-preload"])
def test_a_stub_driver_checkpoint_puts_the_host_copy_on_huge_pages_only_with_the_preload(
        sandbox: Callable[..., Sandbox], stub: Stub, stub_lib: Path, preload: bool) -> None:
    # The worker maps the stub driver (as a GPU worker maps libcuda); at a checkpoint the stub maps
    # its host copy inside the worker the way driver 580 does, MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE
    # through libc's mmap, and fills it; at the restore it checks every word and unmaps it.
    sb = sandbox(["serve"], opts=[] if preload else ["--no-thp-preload"],
                 env={"LD_PRELOAD": str(stub_lib), "DYNSNAP_STUB_DIR": str(stub.dir)})
    sb.wait_up()
    worker = sb.worker_host_pid()
    assert (str(THP_LIB) in maps_paths(worker)) is preload
    stub.control(f"copy {worker} {COPY_MIB}")

    save = stub.run("--action", "save", "--pid", str(worker), "--skip-mem")
    assert save.rc == 0, save.err
    assert stub.state(worker) == CHECKPOINTED
    (line,) = [x for x in stub.log() if x.startswith("copy ")]
    m = re.fullmatch(rf"copy pid={worker} op=save addr=0x([0-9a-f]+) bytes=(\d+) result=ok rc=0", line)
    assert m, line
    addr, size = int(m.group(1), 16), int(m.group(2))
    assert size == COPY_MIB << 20
    copy = vma(worker, addr)
    flags = copy["VmFlags"].split()
    # MAP_POPULATE kept its promise either way: the whole copy is resident when the call returns
    assert kib(copy["Rss"]) >= size >> 10, copy
    assert ("hg" in flags) is preload, copy
    if preload:
        lo, hi = (int(x, 16) for x in copy["range"].split("-"))
        assert (lo, hi) == (addr, addr + size), copy  # a mapping of its own (its flags differ from any neighbour's)
        if thp_mode() != "never":
            assert kib(copy["AnonHugePages"]) > 0, copy
    elif thp_mode() != "always":
        assert kib(copy["AnonHugePages"]) == 0, copy
    # the bytes the "device" gave are in the copy, at its start, middle and end
    with open(f"/proc/{worker}/mem", "rb") as mem:
        for word in (0, size // 16, size // 8 - 1):
            mem.seek(addr + 8 * word)
            assert int.from_bytes(mem.read(8), "little") == 0xC0FFEE0000000000 | word

    resume = stub.run("--action", "resume", "--pid", str(worker), "--skip-mem")
    assert resume.rc == 0, resume.err
    assert stub.state(worker) == RUNNING
    copies = [x for x in stub.log() if x.startswith("copy ")]
    assert copies[1:] == [f"copy pid={worker} op=restore addr={addr:#x} bytes={size} result=ok rc=0"]
    with pytest.raises(AssertionError, match="no mapping"):
        vma(worker, addr)
    assert sb.status("/health") == 200
