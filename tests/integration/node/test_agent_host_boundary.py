"""What the privileged agent starts never runs anything of a pod's, mounts nothing a pod sees, and enters only
the namespaces a runtime made (issue 38), on the real node (kubelet, containerd, runc; dynsnap installed by
``helm install``: realnodeenv.py), attacked the way a pod's author would.

- **Nothing of the pod's is loaded or run.** The worker's container holds what a loader or CRIU would read
  by path: ``/etc/ld.so.preload`` naming a library that records every load it gets (the pid, euid, cgroup
  and executable of the process it lands in), an ``/etc/nsswitch.conf`` naming that library as an NSS
  module (``libnss_recorder.so.2``), the same library in the agent's CRIU plugin directory at the agent's
  path, and a CRIU configuration naming an action script. A capture and a wake of each tier, each proven by
  pinned requests: no process outside the pod loaded the library, the action script never ran, the node's
  tools are byte for byte what they were. Before issue 38 CRIU started in the worker's mount namespace and
  its loader loaded the library as root (tests/native/test_nsexec.py shows the same attack with nsenter).
- **Nothing the agent or CRIU mounts is visible in the pod.** A process of the worker's container outside
  its tree (a root shell of the pod, no capabilities) watches its mount table every 2 ms through a whole
  snapshot wake: no line appears, none is left on the node. Before issue 38 CRIU's restore mounted its cgroup
  yard in the worker's control directory, where the pod saw (and could hold) the node's cgroup hierarchies.
  The same process killing CRIU mid-restore leaves nothing mounted either, and the agent, finding the
  restore cut off, kills what it left and restores the same worker again.
- **Only the runtime's namespaces.** A worker whose image wraps its command in ``unshare --user`` (its
  entrypoint PID 1 of a pid namespace in a user namespace of its own; the pod asks for no seccomp profile,
  which the node's default would refuse the unshare with) is refused by name
  (``Accepted=False ForeignNamespace``), asked to sleep it is never touched, and it serves.
- **A pod shape that cannot be captured is said and served.** A worker pod with ``shareProcessNamespace:
  true`` (the pause container is PID 1 of its pid namespace) is refused by name (``SharedProcessNamespace``)
  and let serve: its gate opened, a Warning Event saying why, Ready, answering requests pinned to it. Before,
  it was ``Accepted=Unknown WorkerNotRunning`` for good and never Ready.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from controllerenv import cond, events_for, gate_of, get_ws
from faultsenv import error_is
from realnodecycle import back_after_refusal, cycle, override, pinned, same_pod, set_tier, wait_ws
from realnodeenv import WORKER_COMPONENT, Env, chart_pod, deployed, worker_main
from realnodefacts import container_pid, container_procs, kubelet_facts
from trustenv import plant_criu_config

from dynsnap.k8s.client import Obj
from dynsnap.models import resources as R
from dynsnap.runtime import caps
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

RECORDS = "/tmp/dynsnap-loads"  # where the recorder writes, in whatever file system it was loaded into
RECORDER = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static void put(const char *path, const char *line, int n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0666);
    if (fd >= 0) { if (write(fd, line, (size_t)n) < 0) {} close(fd); }
}
__attribute__((constructor)) static void recorded(void) {
    char exe[256] = "?", cg[256] = "?", line[700];
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (k > 0) exe[k] = 0;
    int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) { k = read(fd, cg, sizeof cg - 1); if (k > 0) cg[k] = 0; close(fd); }
    for (char *p = cg; *p; p++) if (*p == '\n') *p = ' ';
    int n = snprintf(line, sizeof line, "%d %d %s | %s\n", (int)getpid(), (int)geteuid(), exe, cg);
    put(RECORDS, line, n);
}
"""
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib")
NSS_DATABASES = ("passwd", "group", "hosts", "services", "protocols", "networks")

WATCHER = r"""
import json, os, signal, sys, time
out, stop, kill = sys.argv[1], sys.argv[2], sys.argv[3] == "kill"
base = open("/proc/self/mountinfo").read().splitlines()
new, killed = [], []
looks = 0
first_kill = None
deadline = time.monotonic() + 600
while time.monotonic() < deadline and not os.path.exists(stop):
    for line in open("/proc/self/mountinfo").read().splitlines():
        if line not in base and line not in new:
            new.append(line)
    # kill: every process named criu in the pod's pid namespace (CRIU runs there, as root: a root process of
    # the pod may signal it), for one second from the first seen, then let the agent's retry be
    if kill and (first_kill is None or time.monotonic() - first_kill < 1.0):
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                comm = open(f"/proc/{p}/comm").read().strip()
            except OSError:
                continue
            if comm == "criu":
                try:
                    os.kill(int(p), signal.SIGKILL)
                    killed.append(int(p))
                    first_kill = first_kill or time.monotonic()
                except OSError:
                    pass
    looks += 1
    time.sleep(0.002)
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump({"new": new, "looks": looks, "killed": killed,
               "last": open("/proc/self/mountinfo").read().splitlines() == base}, f)
os.replace(tmp, out)
"""


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("recorder")
    src = work / "recorder.c"
    src.write_text(RECORDER)
    lib = work / "librecorder.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", f'-DRECORDS="{RECORDS}"', "-o", str(lib), str(src)], check=True)
    return lib


def _tree_hash(root: Path) -> dict[str, str]:
    """The node's tools (the agent's CRIU, plugin, dynsnap-cuda) by content; its images directory beside them
    is the agent's to write."""
    out = {}
    for sub in ("bin", "lib"):
        for p in sorted((root / sub).rglob("*")):
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    assert out, f"no tools under {root}"
    return out


def _plant(ep: int, lib: Path, plugin_dir: Path) -> None:
    """Everything a loader or CRIU would read by path, written in the container as its image could hold it."""
    root = Path(f"/proc/{ep}/root")
    data = lib.read_bytes()
    targets = [root / "tmp" / "librecorder.so", *(root / d / "libnss_recorder.so.2" for d in LIB_DIRS
                                                  if (root / d).is_dir()),
               root / str(plugin_dir).lstrip("/") / "recorder_plugin.so"]
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_bytes(data)
        t.chmod(0o755)
    (root / "etc" / "ld.so.preload").write_text("/tmp/librecorder.so\n")
    nss = root / "etc" / "nsswitch.conf"
    lines = nss.read_text().splitlines() if nss.exists() else []
    have = {ln.split(":")[0] for ln in lines if ":" in ln}
    lines = [f"{ln} recorder" if ln.split(":")[0] in NSS_DATABASES else ln for ln in lines]
    lines += [f"{db}: files recorder" for db in NSS_DATABASES if db not in have]
    nss.write_text("\n".join(lines) + "\n")
    (root / RECORDS.lstrip("/")).unlink(missing_ok=True)


def _unplant(ep: int) -> None:
    root = Path(f"/proc/{ep}/root")
    (root / "etc" / "ld.so.preload").unlink(missing_ok=True)


def _loads(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("tier", ["suspend", "snapshot"])
async def test_nothing_of_the_pods_is_loaded_or_run_by_what_the_agent_starts(env: Env, recorder: Path,
                                                                              tier: str) -> None:
    body = chart_node.example_body(env, name=f"hb-{tier}", worker_replicas=2, policy={"dynsnap.io/tier": tier})
    async with deployed(env, body) as g:
        w = g.workers(WORKER_COMPONENT)[0]
        first = await kubelet_facts(env.api, w)
        ep = container_procs(w.uid, first.container_id).entrypoint
        (agent,) = await env.chart_pods("agent")
        agent_root = Path(f"/proc/{container_pid(agent, 'agent')}/root")
        tools_before = _tree_hash(env.paths.tools)
        host_preload = Path("/etc/ld.so.preload").read_bytes() if Path("/etc/ld.so.preload").exists() else None
        _plant(ep, recorder, env.paths.tools / "lib" / "criu")
        ran = plant_criu_config(ep)
        pod_key = w.uid.replace("-", "_")
        try:
            await cycle(env, w, tier, lambda _: _nothing())
            await pinned(env, w, prompt="after a wake beside a planted preload")
            in_pod = _loads(Path(f"/proc/{ep}/root") / RECORDS.lstrip("/"))
            outside = [r for r in in_pod if w.uid not in r and pod_key not in r]
            print(f"\n[{tier}] loads recorded in the container: {len(in_pod)}, by processes outside the pod: "
                  f"{len(outside)}")
            assert outside == [], f"a process outside the pod loaded the pod's library: {outside[:5]}"
            assert _loads(agent_root / RECORDS.lstrip("/")) == [], "loaded into something in the agent's files"
            assert _loads(Path(RECORDS)) == [], "loaded into something on the node"
            assert not ran.exists(), f"CRIU ran the pod's action script: {ran.read_text()}"
            assert _tree_hash(env.paths.tools) == tools_before, "the node's tools changed"
            now = Path("/etc/ld.so.preload").read_bytes() if Path("/etc/ld.so.preload").exists() else None
            assert now == host_preload
            await same_pod(env, w, first)
        finally:
            _unplant(ep)


async def _nothing() -> None:
    return None


def _start_watcher(ep: int, out: str, stop: str, *, kill: bool = False) -> subprocess.Popen[bytes]:
    """A root shell of the pod with no capabilities (the container's user, as a pod's own process is), in
    every namespace of the worker's container, outside the worker's tree: it runs the container's python."""
    script = Path(f"/proc/{ep}/root/tmp/dynsnap-watch-mounts.py")
    script.write_text(WATCHER)
    return subprocess.Popen(["nsenter", "-t", str(ep), "-m", "-p", "-n", "-i", "-u", "-C", "--",
                             "setpriv", "--bounding-set=-all", "--inh-caps=-all", "--",
                             "/usr/bin/python3", "/tmp/dynsnap-watch-mounts.py", out, stop,
                             "kill" if kill else "watch"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.parametrize("pod", ["watches", "kills-criu"])
async def test_a_wake_mounts_nothing_the_pod_sees_and_leaves_nothing_mounted(env: Env, pod: str) -> None:
    """``watches``: the pod's process looks through a whole wake. ``kills-criu``: it also SIGKILLs CRIU the
    moment it appears (mid-restore): nothing is left mounted, and the agent kills what the cut-off restore
    left (tasks holding the capture's pids, stopped in CRIU's restorer) and restores again: the same worker
    wakes, proven by pinned requests (before issue 38 every later restore was refused PidsInUse)."""
    kill = pod == "kills-criu"
    body = chart_node.example_body(env, name=f"hb-mounts-{pod}", worker_replicas=2,
                                   policy={"dynsnap.io/tier": "snapshot"})
    async with deployed(env, body) as g:
        w = g.workers(WORKER_COMPONENT)[0]
        first = await kubelet_facts(env.api, w)
        ep = container_procs(w.uid, first.container_id).entrypoint
        node_before = Path("/proc/self/mountinfo").read_text().splitlines()
        root = Path(f"/proc/{ep}/root")
        out, stop = "/tmp/dynsnap-watch.json", "/tmp/dynsnap-watch.stop"
        (root / out.lstrip("/")).unlink(missing_ok=True)
        (root / stop.lstrip("/")).unlink(missing_ok=True)
        watcher: subprocess.Popen[bytes] | None = None

        async def watch_from_now(_: Obj) -> None:
            nonlocal watcher
            watcher = _start_watcher(ep, out, stop, kill=kill)
            async def looking() -> bool:
                return _looking(watcher)
            await wait_for("the pod's watcher looking", looking, timeout=30, interval=0.2)
        try:
            woken = await cycle(env, w, "snapshot", watch_from_now)
        finally:
            (root / stop.lstrip("/")).write_text("")
            if watcher is not None:
                _, err = watcher.communicate(timeout=30)
                assert watcher.returncode == 0, err.decode()
        seen = json.loads((root / out.lstrip("/")).read_text())
        wake = woken["status"]["lastWake"]
        print(f"\n[mounts, {pod}] the pod looked at its mount table {seen['looks']} times through the wake; "
              f"killed {seen['killed']}; the wake's steps {[st['name'] for st in wake['steps']]}, its error "
              f"{(wake.get('error') or {}).get('message', '')[:300]}")
        if kill:
            assert seen["killed"], "the pod saw no CRIU to kill"
            err = wake.get("error") or {}
            assert err.get("reason") == "CriuRestoreFailed" and err.get("step") == "restore", wake
            assert "(killed): criu restore was killed (signal 9)" in err.get("message", ""), err
            assert [st["name"] for st in wake["steps"]].count("restore") >= 2, wake["steps"]
        assert seen["looks"] > 10
        assert seen["new"] == [], f"mounts the pod saw during the wake: {seen['new'][:5]}"
        assert seen["last"], "the pod's mount table is not what it was"
        node_after = Path("/proc/self/mountinfo").read_text().splitlines()
        leaked = [ln for ln in node_after if ln not in node_before and ("cgyard" in ln or "criu" in ln)]
        assert leaked == [], leaked
        await pinned(env, w, prompt="after a watched wake")


def _looking(p: subprocess.Popen[bytes] | None) -> bool:
    if p is None:
        return False
    if p.poll() is not None:
        raise AssertionError(f"the watcher exited {p.returncode}: {p.stderr.read().decode() if p.stderr else ''}")
    kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    return bool(kids) and any("dynsnap-watch-mounts" in Path(f"/proc/{k}/cmdline").read_text() for k in kids)


@pytest.fixture
async def foreign(env: Env) -> AsyncIterator[Obj]:
    """A graph whose worker wraps its command in ``unshare --user --map-root-user --pid --fork``: its
    entrypoint is PID 1 of a pid namespace in a user namespace it made."""
    body = chart_node.example_body(env, name="hb-userns", worker_replicas=1, policy={"dynsnap.io/tier": "snapshot"})
    main = worker_main(body)
    main["command"] = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--",
                       *main["command"]]
    # The node's default seccomp profile (kubelet's seccompDefault, as a cluster sets it) refuses the unshare;
    # a pod author asks for none, which a namespace below Pod Security's baseline level lets them do.
    main.setdefault("securityContext", {})["seccompProfile"] = {"type": "Unconfined"}
    async with deployed(env, body, ready=False) as g:
        yield {"graph": g}


async def _serves_refused(env: Env, w: NodePod, reason: str, says: str) -> Obj:
    """Refused by name, let serve by the controller (gate True, a Warning saying why), Ready, answering."""
    def refused(ws: Obj | None) -> bool:
        c = cond(ws, "Accepted")
        return bool(c and c["status"] == "False" and c["reason"] == reason and says in c.get("message", ""))
    ws = await wait_ws(env, w, f"refused {reason}", refused, timeout=180)
    pod = await env.cluster.wait_ready(w.namespace, w.name, timeout=180)
    assert gate_of(pod) == "True", pod["status"]
    async def said() -> list[str]:
        notes = [e.get("note", "") for e in await events_for(env.api, w.namespace, w.name)
                 if e.get("reason") == reason and e.get("type") == "Warning"]
        return [n for n in notes if n.startswith("serving uncaptured: the agent does not accept the pod")]
    await wait_for(f"a Warning {reason} on {w.name} saying it serves uncaptured", said, timeout=60, interval=0.5)
    await pinned(env, w, prompt=f"refused {reason}, serving")
    return ws


async def test_a_worker_in_a_user_namespace_of_its_own_is_refused_and_serves(env: Env, foreign: Obj) -> None:
    g = foreign["graph"]
    w = g.workers(WORKER_COMPONENT)[0]
    first_ws = await _serves_refused(env, w, "ForeignNamespace", "not the node's")
    print(f"\n[userns] {cond(first_ws, 'Accepted')}")
    # Asked to sleep (dynsnap suspend), it is never touched: no capture begun, the same container, serving.
    first = await kubelet_facts(env.api, w)
    await override(env, w, "suspended")
    await asyncio.sleep(10)  # the controller's and the agent's looks at the changed pod, each within a second or two
    ws = await get_ws(env.api, w)
    st = (ws or {}).get("status") or {}
    assert "lastCapture" not in st and st.get("state") != "Suspended", st
    assert (cond(ws, "Accepted") or {}).get("reason") == "ForeignNamespace"
    await pinned(env, w, prompt="refused, still serving")
    await same_pod(env, w, first)
    await override(env, w, None)


async def test_a_shared_process_namespace_pod_is_refused_by_name_and_serves(env: Env) -> None:
    body = chart_node.example_body(env, name="hb-sharedpid", worker_replicas=1, policy={"dynsnap.io/tier": "suspend"})
    worker = next(c for c in body["spec"]["components"] if c["name"] == WORKER_COMPONENT)
    worker["podTemplate"]["spec"]["shareProcessNamespace"] = True
    async with deployed(env, body, ready=False) as g:
        w = g.workers(WORKER_COMPONENT)[0]
        await _serves_refused(env, w, "SharedProcessNamespace", "shareProcessNamespace: true")
        first = await kubelet_facts(env.api, w)
        assert first.restart_count == 0
        live = await env.api.get(R.PODS, w.name, namespace=w.namespace)
        assert live["spec"].get("shareProcessNamespace") is True
        assert os.path.exists(f"/proc/{container_pid(live, 'main')}")


async def test_a_worker_holding_a_capability_the_agent_lacks_is_refused_a_snapshot_and_sleeps_by_suspend(
        env: Env) -> None:
    """The chart's agent is not privileged: it holds the capabilities docs/install.md lists, and CRIU, its
    child, can give a restored task back only those. A worker container that adds one beyond them
    (``WAKE_ALARM``) is refused a snapshot before anything changes (``CapabilitiesBeyondAgent`` at the quiesce
    step, naming the capability and the process; a refusal for good, so the controller puts it back into
    serving at once), while tier suspend, which restores no credentials, captures and wakes it in place.
    Before, a privileged agent's CRIU restored whatever the worker held."""
    body = chart_node.example_body(env, name="hb-caps", worker_replicas=2, policy={"dynsnap.io/tier": "snapshot"})
    main = worker_main(body)
    sc = main.setdefault("securityContext", {})
    sc.setdefault("capabilities", {}).setdefault("add", []).append("WAKE_ALARM")
    async with deployed(env, body) as g:
        w = g.workers(WORKER_COMPONENT)[0]
        first = await kubelet_facts(env.api, w)
        ep = container_procs(w.uid, first.container_id).entrypoint
        assert "WAKE_ALARM" in caps.names(caps.union(caps.sets(ep) or {})), "the worker holds CAP_WAKE_ALARM"
        agent = await chart_pod(env, "agent")
        agent_caps = caps.sets(container_pid(agent, "agent")) or {}
        assert "WAKE_ALARM" not in caps.names(agent_caps["CapBnd"]), agent_caps
        await override(env, w, "suspended")
        ws = await wait_ws(env, w, "CapabilitiesBeyondAgent", error_is("CapabilitiesBeyondAgent", step="quiesce"),
                           timeout=120)
        err = ws["status"]["lastError"]
        assert "WAKE_ALARM" in err["message"] and "capabilities the agent's container does not hold" in err["message"]
        cap = ws["status"]["lastCapture"]
        assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce"], cap
        await wait_ws(env, w, "back in serving, verified", back_after_refusal("CapabilitiesBeyondAgent"), timeout=120)
        await pinned(env, w, prompt="refused a snapshot, serving")
        await override(env, w, None)
        await set_tier(env, w, "suspend")

        async def nothing(_: Obj) -> None:
            return None
        woken = await cycle(env, w, "suspend", nothing)
        assert woken["status"]["lastWake"]["ok"] is True
        await same_pod(env, w, first)
