"""Mutation check of dynsnap-entrypoint (docs/ENTRYPOINT.md, "Mutation check"): each row of the
doc's table, as an exact replacement in native/entrypoint/*.c, the shared header or the huge-page
library it preloads (native/thp/dynsnap-thp.c), built with `make -C native entrypoint thp` into a
private build directory, then the tests that must go red.
Not collected by pytest (no test_ prefix). From the repository root, as root (the tests unshare
pid namespaces), with the dev venv's python:

    V=$(ls -td ~/.cache/dynsnap/venv-dev-*/ | head -1)
    $V/bin/python tests/native/mutate_entrypoint.py [--list] [--all-failures] [INDEX|ID ...]

The CRIU rows need CRIU 4.2.1 at ~/.cache/dynsnap/criu-4.2.1-p* (`./run setup`); without it those
tests skip and a mutant that only they catch is reported, not passed. tests/mutation/runner.py
says how a run goes and what each outcome means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mutation.runner import Edit, Suite, main, mutation

MAIN = "native/entrypoint/main.c"
PROBE = "native/entrypoint/probe.c"
SECCOMP = "native/entrypoint/seccomp.c"
HEADER = "native/include/dynsnap_protocol.h"
THP = "native/thp/dynsnap-thp.c"

E = "tests/native/test_entrypoint.py::"
PID_RANGE = E + "test_pid_range_is_reserved_before_anything_starts"
RESERVATION_LOUD = E + "test_failed_pid_reservation_is_loud_and_recorded"
PROBES = E + "test_probes_mirror_the_worker_while_active_and_answer_for_it_otherwise"
SNAPSHOTTED_EXIT = E + "test_worker_tree_exiting_while_snapshotted_keeps_the_container_up"
NO_WORKER_SIGTERM = E + "test_sigterm_with_no_worker_stops_cleanly"
SUSPENDED_EXIT = E + "test_worker_exiting_while_active_or_suspended_ends_the_container"
RESTORED = E + "test_a_tree_restored_in_place_is_adopted_and_reaped"
CRIU = E + "test_criu_dumps_the_worker_tree_and_restores_it_under_the_same_pid1"
IO_URING = E + "test_io_uring_is_refused_with_enosys_unless_turned_off"
SIGTERM = E + "test_sigterm_reaches_the_worker_group_and_the_container_stops_with_its_status"
CRASH = E + "test_worker_crash_exits_with_the_same_code"
LOG_STDOUT = E + "test_worker_output_goes_to_a_log_file_and_to_stdout"
LOG_KEEPS = E + "test_log_file_keeps_its_size_while_not_active"
SIGNALS = E + "test_worker_starts_with_no_blocked_or_ignored_signals"
BAD_REQUESTS = E + "test_bad_state_requests_are_refused_and_acknowledged"
BAD_ARGS = E + "test_bad_arguments_are_a_usage_error"
LEFT_REQUEST = E + "test_a_request_left_by_a_previous_container_is_ignored"
PROTOCOL = "tests/unit/test_protocol_native.py"
PRELOAD_FIRST = E + "test_the_worker_preloads_the_library_first_and_keeps_its_own_preloads"
PRELOAD_OFF = E + "test_the_preload_can_be_turned_off"
HOST_COPY = E + "test_a_stub_driver_checkpoint_puts_the_host_copy_on_huge_pages_only_with_the_preload"
T = "tests/native/test_thp.py::"
THP_LARGE = T + "test_a_large_private_populate_mapping_lands_on_huge_pages_fully_resident"
THP_OTHERS = T + "test_other_mappings_are_left_exactly_as_asked"
THP_FALLBACK = T + "test_a_refused_madvise_falls_back_to_the_callers_own_populate_mapping"
THP_GLIBC = T + "test_the_library_loads_with_any_glibc"

CYCLING = E + "test_unprivileged_entrypoint_reserves_by_cycling_pids"
INOTIFY = E + "test_a_state_request_wakes_the_entrypoint_through_its_inotify_watch"
NO_INOTIFY = E + "test_without_inotify_the_tick_still_serves_requests"

MUTATIONS = (
    mutation(
        "no-pid-cycling", "no pid cycling when `ns_last_pid` cannot be written", MAIN,
        "\tif (cycle && pid_max > DYNSNAP_PID_FLOOR && cycle_pids()) {",
        "\tif (0 && cycle && pid_max > DYNSNAP_PID_FLOOR && cycle_pids()) {",
        tests=[CYCLING]),
    mutation(
        "cycle-stops-below-floor", "pid cycling stops one short of the floor", MAIN,
        "\t\tif (c >= DYNSNAP_PID_FLOOR - 1)\n\t\t\treturn true;",
        "\t\tif (c >= DYNSNAP_PID_FLOOR - 3)\n\t\t\treturn true;",
        tests=[CYCLING]),
    mutation(
        "no-ns-last-pid-write", "no `ns_last_pid` write", MAIN,
        "if (fd >= 0 && write(fd, val, (size_t)n) == n) {",
        "if (fd >= 0 && n > 0) {",
        tests=[PID_RANGE, RESERVATION_LOUD]),
    mutation(
        "health-proxied-in-every-state", "`/health` proxies in every state", PROBE,
        "\tif (ep->state != ST_ACTIVE) {\n\t\tbool live",
        "\tif (ep->state != ST_ACTIVE && path[1] == 'l') {\n\t\tbool live",
        # Only a test with a live worker outside `active` can see it: where the tree is gone
        # (snapshotted, the CRIU test) the proxied /health is 503 "unreachable" anyway.
        tests=[PROBES]),
    mutation(
        "live-proxied-in-every-state", "`/live` asks the worker in every state", PROBE,
        "\tif (ep->state != ST_ACTIVE) {\n\t\tbool live",
        "\tif (ep->state != ST_ACTIVE && path[1] != 'l') {\n\t\tbool live",
        tests=[PROBES]),
    mutation(
        "no-seccomp-filter", "no seccomp filter", MAIN,
        "if (ep->seccomp && (rc = seccomp_block_io_uring()) != 0) {",
        "if (0 && ep->seccomp && (rc = seccomp_block_io_uring()) != 0) {",
        tests=[IO_URING, CRIU]),
    mutation(
        "filter-foreign-arch", "filter checks a foreign arch", SECCOMP,
        "#define NATIVE_ARCH AUDIT_ARCH_X86_64\n#define COMPAT_ARCH AUDIT_ARCH_I386\n",
        "#define NATIVE_ARCH AUDIT_ARCH_AARCH64\n#define COMPAT_ARCH AUDIT_ARCH_ARM\n",
        tests=[IO_URING]),
    mutation(
        "eperm-not-enosys", "EPERM instead of ENOSYS", SECCOMP,
        "SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)",
        "SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)",
        tests=[IO_URING]),
    mutation(
        "signal-leader-only", "signal to the leader only, not the group", MAIN,
        "kill(-ep.worker_pid, sig);",
        "kill(ep.worker_pid, sig);",
        tests=[SIGTERM]),
    mutation(
        "exit-with-worker-in-any-state", "exit with the worker whatever the state", MAIN,
        "if (stopping || ep.state == ST_ACTIVE || ep.state == ST_SUSPENDED) {",
        "if (stopping || 1) {",
        tests=[SNAPSHOTTED_EXIT, NO_WORKER_SIGTERM, RESTORED, CRIU]),
    mutation(
        "ignore-exit-while-suspended", "ignore a tree exit while `suspended`", MAIN,
        "if (stopping || ep.state == ST_ACTIVE || ep.state == ST_SUSPENDED) {",
        "if (stopping || ep.state == ST_ACTIVE) {",
        tests=[SUSPENDED_EXIT]),
    mutation(
        "restored-tree-not-adopted", "restored tree not adopted (not seen as our child)", MAIN,
        "if (!ep.worker_alive && is_our_child(ep.worker_pid)) {",
        "if (0 && !ep.worker_alive && is_our_child(ep.worker_pid)) {",
        tests=[RESTORED, CRIU]),
    mutation(
        "exit-0-not-worker-status", "exit 0 instead of the worker's status", MAIN,
        "return ep.worker_status;",
        "return 0;",
        tests=[CRASH, SIGTERM + "[3]"]),
    mutation(
        "log-not-copied", "log not copied to stdout", MAIN,
        "w = write(1, buf + off, (size_t)(n - off));",
        "w = n - off;",
        tests=[SIGTERM, LOG_STDOUT, LOG_KEEPS, RESTORED]),
    mutation(
        "log-truncated-in-any-state", "log truncated in any state", MAIN,
        "ep->state == ST_ACTIVE && truncate(ep->log_path, 0) == 0)",
        "truncate(ep->log_path, 0) == 0)",
        tests=[LOG_KEEPS]),
    mutation(
        "stdin-inherited", "stdin inherited, not `/dev/null`", MAIN,
        "if (nul < 0 || dup2(nul, 0) < 0 || dup2(logfd, 1) < 0",
        "if (nul < 0 || dup2(logfd, 1) < 0",
        tests=[SIGTERM]),
    mutation(
        "inherited-ignored-signals-kept",
        "dispositions the entrypoint inherited as ignored (SIGINT, SIGQUIT) left ignored for the worker "
        "(only SIGPIPE reset, the code before the fix)", MAIN,
        "\t\tfor (int s = 1; s < NSIG; s++)\n\t\t\tif (s != SIGKILL && s != SIGSTOP)\n\t\t\t\tsignal(s, SIG_DFL);\n",
        "\t\tsignal(SIGPIPE, SIG_DFL);\n",
        tests=[SIGNALS]),
    mutation(
        "requests-not-acknowledged", "state requests not acknowledged", MAIN,
        "\t\t\tif (seq > 0)\n\t\t\t\tep.request_seq = seq;\n",
        "\t\t\t(void)seq;\n",
        tests=[PROBES, BAD_REQUESTS]),
    mutation(
        "request-watch-not-polled", "the request watch set up but left out of the poll set (woken by the tick only)",
        MAIN,
        "{ .fd = ifd, .events = POLLIN } };",
        "{ .fd = -1, .events = POLLIN } };",
        tests=[INOTIFY]),
    mutation(
        "no-tick-without-watch", "requests read only after a watch event (nothing served without inotify)", MAIN,
        "\t\tr = control_read_request(&ep, &seq, want, sizeof(want), err, sizeof(err));",
        "\t\tr = by_watch ? control_read_request(&ep, &seq, want, sizeof(want), err, sizeof(err)) : 0;",
        tests=[NO_INOTIFY]),
    mutation(
        "usage-exit-1", "usage errors exit 1", MAIN,
        "#define EXIT_USAGE 2",
        "#define EXIT_USAGE 1",
        tests=[BAD_ARGS]),
    mutation(
        "sigpipe-ignored", "SIGPIPE left ignored in the worker", MAIN,
        "if (s != SIGKILL && s != SIGSTOP)",
        "if (s != SIGKILL && s != SIGSTOP && s != SIGPIPE)",
        tests=[SIGNALS]),
    mutation(
        "signal-mask-not-cleared", "signal mask not cleared in the worker", MAIN,
        "\t\tsigemptyset(&all);\n\t\tsigprocmask(SIG_SETMASK, &all, NULL);\n",
        "\t\tsigemptyset(&all);\n",
        tests=[SIGTERM]),
    mutation(
        "stale-request-kept", "stale `state-request` not removed at start", MAIN,
        "if (unlink(req) == 0)",
        "if (0 && unlink(req) == 0)",
        tests=[LEFT_REQUEST]),
    mutation(
        "header-floor-12000", "header floor 10000 → 12000", HEADER,
        "#define DYNSNAP_PID_FLOOR 10000\n",
        "#define DYNSNAP_PID_FLOOR 12000\n",
        tests=[PROTOCOL, PID_RANGE]),
    mutation(
        "header-sixth-state", "a sixth state added to the header only", HEADER,
        '#define DYNSNAP_STATE_RESTORING "restoring"\n',
        '#define DYNSNAP_STATE_RESTORING "restoring"\n#define DYNSNAP_STATE_DRAINING "draining"\n',
        tests=[PROTOCOL]),
    mutation(
        "ld-preload-replaced", "the worker's LD_PRELOAD replaced by the library instead of prepended to", MAIN,
        'if (asprintf(&v, "%s:%s", ep->thp_preload, old) < 0)',
        'if (asprintf(&v, "%s", ep->thp_preload) < 0)',
        # the worker no longer maps the stub driver: no GPU process, and the copy's signal kills it
        tests=[PRELOAD_FIRST, HOST_COPY]),
    mutation(
        "thp-preload-not-default", "the library next to the binary not looked for (no preload by default)", MAIN,
        'n = readlink("/proc/self/exe", self, sizeof(self) - 1);',
        "n = -1;",
        tests=[PRELOAD_FIRST, HOST_COPY + "[default]"]),
    mutation(
        "no-thp-preload-ignored", "`--no-thp-preload` ignored", MAIN,
        "\t\t\tthp_off = true;\n",
        "\t\t\tthp_off = false;\n",
        tests=[PRELOAD_OFF, HOST_COPY + "[no-thp-preload]"]),
    mutation(
        "thp-sparse-mappings-taken", "library: mappings without MAP_POPULATE marked too", THP,
        "(flags & MAP_ANONYMOUS) && (flags & MAP_POPULATE) &&",
        "(flags & MAP_ANONYMOUS) &&",
        tests=[THP_OTHERS + "[no-populate]"]),
    mutation(
        "thp-shared-taken", "library: shared anonymous mappings taken over", THP,
        "return (flags & MAP_TYPE) == MAP_PRIVATE && (flags & MAP_ANONYMOUS)",
        "return (flags & MAP_ANONYMOUS)",
        tests=[THP_OTHERS + "[shared]"]),
    mutation(
        "thp-threshold-ignored", "library: the size threshold ignored", THP,
        "(prot & PROT_WRITE) && len >= min_len;",
        "(prot & PROT_WRITE) && len > 0;",
        tests=[THP_OTHERS + "[below-threshold]"]),
    mutation(
        "thp-no-prefault", "library: MAP_POPULATE dropped and no MADV_POPULATE_WRITE after the mark", THP,
        "madvise(p, len, MADV_HUGEPAGE) == 0 && madvise(p, len, MADV_POPULATE_WRITE) == 0",
        "madvise(p, len, MADV_HUGEPAGE) == 0",
        # only where nothing writes the mapping at once: the stub driver, like the real one, fills
        # its copy right away, which faults it all in anyway
        tests=[THP_LARGE]),
    mutation(
        "thp-no-fallback", "library: a failed mark or prefault keeps the unpopulated mapping", THP,
        "q = sys_mmap(p, len, prot, (flags & ~MAP_FIXED_NOREPLACE) | MAP_FIXED, fd, off);",
        "q = p;",
        tests=[THP_FALLBACK]),
    mutation(
        "thp-errno-clobbered", "library: errno of the failed madvise left to the caller after the fallback", THP,
        "\terrno = saved;\n\treturn q;\n",
        "\treturn q;\n",
        tests=[THP_FALLBACK]),
    mutation(
        "thp-next-mmap-by-dlsym", "library: the next mmap found with dlsym (GLIBC_2.34), not the system call", THP,
        "\t\t\tmin_len = (size_t)v;\n\t}\n",
        "\t\t\tmin_len = (size_t)v;\n\t}\n\tif (!dlsym(RTLD_NEXT, \"mmap\"))\n\t\tmin_len = 0;\n",
        more=[Edit(THP, "#include <errno.h>\n", "#include <dlfcn.h>\n#include <errno.h>\n")],
        tests=[THP_GLIBC]),
)

SUITE = Suite(
    name="dynsnap-entrypoint",
    doc="docs/ENTRYPOINT.md",
    mutations=MUTATIONS,
    build=("make", "-s", "-C", "native", "BUILD={build}", "entrypoint", "thp"),
    # from the restored source
    rebuild=("make", "-s", "-C", "native", "BUILD={root}/native/build", "entrypoint", "thp"),
    env={"DYNSNAP_NATIVE_BIN": "{build}"},  # the tests run the private build's binary
    pytest_args=("--timeout", "180"),
    timeout=1200,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
