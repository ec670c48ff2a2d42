#!/bin/bash
# The cost of starting a program in a worker's namespaces, the old way (nsenter into every namespace, the mount
# namespace too) beside dynsnap-nsexec as CRIU gets it (issue 38): /bin/true into a sandbox (an unshare of pid,
# mount, net, uts, ipc), 50 runs each, interleaved. As root, after make -C native: bench/nsexec/launch.sh
set -e
NSX="${NSX:-$(cd "$(dirname "$0")/../.." && pwd)/native/build/dynsnap-nsexec}"
unshare --pid --fork --kill-child --mount-proc --mount --net --uts --ipc -- sleep 1000 &
U=$!; sleep 0.5; P=$(cat /proc/$U/task/$U/children)
python3 - "$P" "$NSX" <<'PY'
import os, subprocess, sys, time, statistics
pid, nsx = int(sys.argv[1]), sys.argv[2]
def run(argv, fds=()):
    t = time.perf_counter(); subprocess.run(argv, pass_fds=fds, check=True); return time.perf_counter() - t
old, new = [], []
for _ in range(50):
    old.append(run(["nsenter", "-t", str(pid), "-p", "-m", "-n", "-i", "-u", "-C", "--", "/bin/true"]))
    fd = os.pidfd_open(pid)
    new.append(run([nsx, "--target-pidfd", str(fd), "--ns", "pid,net,ipc,uts,cgroup", "--private-mounts",
                    "--join-cgroups", "--outlive", "--", "/bin/true"], (fd,)))
    os.close(fd)
for name, xs in (("nsenter -p -m -n -i -u -C", old), ("dynsnap-nsexec (private mounts, cgroups joined)", new)):
    xs = sorted(xs)
    print(f"{name}: median {statistics.median(xs)*1000:.2f} ms, p90 {xs[44]*1000:.2f} ms, max {xs[-1]*1000:.2f} ms (50 runs)")
PY
kill $U
