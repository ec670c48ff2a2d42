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
ARGS = "native/entrypoint/args.c"
WORKER = "native/entrypoint/worker.c"
JSON = "native/entrypoint/json.c"
EP_H = "native/entrypoint/entrypoint.h"
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
ROUTABLE_EXIT = E + "test_worker_exiting_while_routable_ends_the_container"
ROUTABLE_READY = E + "test_asleep_routable_the_entrypoint_answers_ready_for_the_worker"
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
AFTER_COMMAND = E + "test_options_after_the_command_are_the_workers"
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
B = "tests/native/test_entrypoint_bounds.py::"
STRICT_JSON = B + "test_the_control_file_is_strict_json_whatever_bytes_its_fields_carry"
STALLERS = B + "test_slow_probe_clients_delay_neither_state_requests_nor_other_probes"
CONN_BOUND = B + "test_probe_connections_are_bounded_and_a_prober_still_gets_one"
PEER_FLOOD = B + "test_one_peers_flood_holds_its_share_and_kubelet_is_answered"

MUTATIONS = (
    mutation(
        "no-pid-cycling", "no pid cycling when `ns_last_pid` cannot be written", WORKER,
        "\tif (cycle && pid_max > DYNSNAP_PID_FLOOR && cycle_pids()) {",
        "\tif (0 && cycle && pid_max > DYNSNAP_PID_FLOOR && cycle_pids()) {",
        tests=[CYCLING]),
    mutation(
        "cycle-stops-below-floor", "pid cycling stops one short of the floor", WORKER,
        "\t\tif (c >= DYNSNAP_PID_FLOOR - 1)\n\t\t\treturn true;",
        "\t\tif (c >= DYNSNAP_PID_FLOOR - 3)\n\t\t\treturn true;",
        tests=[CYCLING]),
    mutation(
        "no-ns-last-pid-write", "no `ns_last_pid` write", WORKER,
        "if (fd >= 0 && write(fd, val, (size_t)n) == n) {",
        "if (fd >= 0 && n > 0) {",
        tests=[PID_RANGE, RESERVATION_LOUD]),
    mutation(
        "health-proxied-in-every-state", "`/health` proxies in every state", PROBE,
        "\tif (ep->state != ST_ACTIVE) {\n\t\t/* Asleep routable",
        "\tif (ep->state != ST_ACTIVE && c->path[1] == 'l') {\n\t\t/* Asleep routable",
        # Only a test with a live worker outside `active` can see it: where the tree is gone
        # (snapshotted, the CRIU test) the proxied /health is 503 "unreachable" anyway.
        tests=[PROBES]),
    mutation(
        "live-proxied-in-every-state", "`/live` asks the worker in every state", PROBE,
        "\tif (ep->state != ST_ACTIVE) {\n\t\t/* Asleep routable",
        "\tif (ep->state != ST_ACTIVE && c->path[1] != 'l') {\n\t\t/* Asleep routable",
        tests=[PROBES]),
    mutation(
        "no-seccomp-filter", "no seccomp filter", WORKER,
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
        "kill(-ep->worker_pid, sig);",
        "kill(ep->worker_pid, sig);",
        tests=[SIGTERM]),
    mutation(
        "exit-with-worker-in-any-state", "exit with the worker whatever the state", MAIN,
        "if (l->stopping || ep->state == ST_ACTIVE || ep->state == ST_SUSPENDED || ep->state == ST_ROUTABLE) {",
        "if (l->stopping || 1) {",
        tests=[SNAPSHOTTED_EXIT, NO_WORKER_SIGTERM, RESTORED, CRIU]),
    mutation(
        "ignore-exit-while-suspended", "ignore a tree exit while `suspended`", MAIN,
        "if (l->stopping || ep->state == ST_ACTIVE || ep->state == ST_SUSPENDED || ep->state == ST_ROUTABLE) {",
        "if (l->stopping || ep->state == ST_ACTIVE || ep->state == ST_ROUTABLE) {",
        tests=[SUSPENDED_EXIT]),
    mutation(
        "ignore-exit-while-routable", "ignore a tree exit while `routable`", MAIN,
        "if (l->stopping || ep->state == ST_ACTIVE || ep->state == ST_SUSPENDED || ep->state == ST_ROUTABLE) {",
        "if (l->stopping || ep->state == ST_ACTIVE || ep->state == ST_SUSPENDED) {",
        tests=[ROUTABLE_EXIT]),
    mutation(
        "routable-not-ready", "`/health` answers 503 while `routable` (the pod leaves serving)", PROBE,
        "ready = live || ep->state == ST_ROUTABLE;",
        "ready = live;",
        tests=[ROUTABLE_READY]),
    mutation(
        "restored-tree-not-adopted", "restored tree not adopted (not seen as our child)", MAIN,
        "if (!ep->worker_alive && is_our_child(ep->worker_pid)) {",
        "if (0 && !ep->worker_alive && is_our_child(ep->worker_pid)) {",
        tests=[RESTORED, CRIU]),
    mutation(
        "exit-0-not-worker-status", "exit 0 instead of the worker's status", MAIN,
        "return ep->worker_status;",
        "return 0;",
        tests=[CRASH, SIGTERM + "[3]"]),
    mutation(
        "log-not-copied", "log not copied to stdout", WORKER,
        "w = write(1, buf + off, (size_t)(n - off));",
        "w = n - off;",
        tests=[SIGTERM, LOG_STDOUT, LOG_KEEPS, RESTORED]),
    mutation(
        "log-truncated-in-any-state", "log truncated in any state", WORKER,
        "ep->state == ST_ACTIVE && truncate(ep->log_path, 0) == 0)",
        "truncate(ep->log_path, 0) == 0)",
        tests=[LOG_KEEPS]),
    mutation(
        "stdin-inherited", "stdin inherited, not `/dev/null`", WORKER,
        "if (nul < 0 || dup2(nul, 0) < 0 || dup2(logfd, 1) < 0",
        "if (nul < 0 || dup2(logfd, 1) < 0",
        tests=[SIGTERM]),
    mutation(
        "inherited-ignored-signals-kept",
        "dispositions the entrypoint inherited as ignored (SIGINT, SIGQUIT) left ignored for the worker "
        "(only SIGPIPE reset, the code before the fix)", WORKER,
        "\tfor (int s = 1; s < NSIG; s++)\n\t\tif (s != SIGKILL && s != SIGSTOP)\n\t\t\tsignal(s, SIG_DFL);\n",
        "\tsignal(SIGPIPE, SIG_DFL);\n",
        tests=[SIGNALS]),
    mutation(
        "requests-not-acknowledged", "state requests not acknowledged", MAIN,
        "\tif (seq > 0)\n\t\tep->request_seq = seq;\n",
        "\t(void)seq;\n",
        tests=[PROBES, BAD_REQUESTS]),
    mutation(
        "request-watch-not-polled", "the request watch set up but left out of the poll set (woken by the tick only)",
        MAIN,
        "{ .fd = l->ifd, .events = POLLIN } };",
        "{ .fd = -1, .events = POLLIN } };",
        tests=[INOTIFY]),
    mutation(
        "no-tick-without-watch", "requests read only after a watch event (nothing served without inotify)", MAIN,
        "\tr = control_read_request(ep, &seq, want, sizeof(want), err, sizeof(err));",
        "\tr = by_watch ? control_read_request(ep, &seq, want, sizeof(want), err, sizeof(err)) : 0;",
        tests=[NO_INOTIFY]),
    mutation(
        "usage-exit-1", "usage errors exit 1", ARGS,
        "#define EXIT_USAGE 2",
        "#define EXIT_USAGE 1",
        tests=[BAD_ARGS]),
    mutation(
        "sigpipe-ignored", "SIGPIPE left ignored in the worker", WORKER,
        "if (s != SIGKILL && s != SIGSTOP)",
        "if (s != SIGKILL && s != SIGSTOP && s != SIGPIPE)",
        tests=[SIGNALS]),
    mutation(
        "signal-mask-not-cleared", "signal mask not cleared in the worker", WORKER,
        "\tsigemptyset(&all);\n\tsigprocmask(SIG_SETMASK, &all, NULL);\n",
        "\tsigemptyset(&all);\n",
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
        "ld-preload-replaced", "the worker's LD_PRELOAD replaced by the library instead of prepended to", WORKER,
        'if (asprintf(&v, "%s:%s", ep->thp_preload, old) < 0)',
        'if (asprintf(&v, "%s", ep->thp_preload) < 0)',
        # the worker no longer maps the stub driver: no GPU process, and the copy's signal kills it
        tests=[PRELOAD_FIRST, HOST_COPY]),
    mutation(
        "thp-preload-not-default", "the library next to the binary not looked for (no preload by default)", ARGS,
        'n = readlink("/proc/self/exe", self, sizeof(self) - 1);',
        "n = -1;",
        tests=[PRELOAD_FIRST, HOST_COPY + "[default]"]),
    mutation(
        "no-thp-preload-ignored", "`--no-thp-preload` ignored", ARGS,
        "case OPT_NO_THP: a->thp_off = true; break;",
        "case OPT_NO_THP: a->thp_off = false; break;",
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
    mutation(
        "options-after-the-command-taken", "options after the worker's command taken as the entrypoint's "
        "(getopt_long permuting argv)", ARGS,
        'getopt_long(argc, argv, "+:h", options, NULL)',
        'getopt_long(argc, argv, ":h", options, NULL)',
        tests=[AFTER_COMMAND]),
    mutation(
        "probe-read-blocks", "a probe connection read to its end or its deadline before the loop goes on "
        "(the code before the fix: one connection after another, a second each)", PROBE,
        "\t\t} else if (errno == EAGAIN) {\n\t\t\treturn; /* the rest later, before the deadline */",
        "\t\t} else if (errno == EAGAIN) {\n\t\t\tstruct pollfd p = { .fd = c->fd, .events = POLLIN };\n"
        "\t\t\tif (poll(&p, 1, (int)(c->deadline - mono_ms())) > 0)\n\t\t\t\tcontinue;\n"
        "\t\t\tconn_close(c);\n\t\t\treturn;",
        tests=[STALLERS]),
    mutation(
        "probe-request-deadline-dropped", "a probe connection may take forever to send its request", PROBE,
        "c->deadline = mono_ms() + REQUEST_TIMEOUT_MS;",
        "c->deadline = LLONG_MAX;",
        tests=[STALLERS]),
    mutation(
        "probe-connection-bound-raised", "probe connections held at once: 1024 instead of 16", EP_H,
        "#define PROBE_MAX_CONNS 16 ",
        "#define PROBE_MAX_CONNS 1024 ",
        tests=[CONN_BOUND]),
    mutation(
        "probe-no-room-made", "at the bound, no waiting connection makes room: a new one waits for a slot", PROBE,
        "\t\tif (ps.c[i].phase == REQUEST && (oldest < 0",
        "\t\tif (0 && ps.c[i].phase == REQUEST && (oldest < 0",
        tests=[CONN_BOUND]),
    mutation(
        "probe-no-peer-share", "one peer address may hold every probe connection (issue 39)", PROBE,
        "\tif (peer_slots(key, &own) < PROBE_PEER_SHARE)",
        "\tif (peer_slots(key, &own) < PROBE_MAX_CONNS + 1)",
        tests=[PEER_FLOOD]),
    mutation(
        "probe-backlog-small", "the probe port's listen backlog is 16 again (issue 39)", PROBE,
        "#define PROBE_BACKLOG 128 ",
        "#define PROBE_BACKLOG 16 ",
        tests=[PEER_FLOOD]),
    mutation(
        "json-quote-raw", "`\"` copied into a JSON string unescaped", JSON,
        "} else if (s[0] == '\"' || s[0] == '\\\\') {",
        "} else if (s[0] == '\\\\') {",
        tests=[STRICT_JSON]),
    mutation(
        "json-control-bytes-raw", "control bytes copied into a JSON string unescaped", JSON,
        "} else if (s[0] < 0x20) {",
        "} else if (0 && s[0] < 0x20) {",
        tests=[STRICT_JSON]),
    mutation(
        "json-ill-formed-utf8-raw", "ill-formed UTF-8 copied into a JSON string as it is", JSON,
        "\tif (!ok) {\n\t\tjb_raw(b, ",
        "\tif (0 && !ok) {\n\t\tjb_raw(b, ",
        tests=[STRICT_JSON]),
    mutation(
        "json-field-not-cut", "a string field not cut at FIELD_MAX", JSON,
        "\t\tif (used + n > limit)\n\t\t\tbreak;",
        "\t\tif (0 && used + n > limit)\n\t\t\tbreak;",
        # the field then runs on to the end of the entrypoint's own copy of the command line, past the bound
        tests=[STRICT_JSON]),
    mutation(
        "json-cut-past-limit", "the character across FIELD_MAX kept", JSON,
        "\t\tif (used + n > limit)\n\t\t\tbreak;",
        "\t\tif (used >= limit)\n\t\t\tbreak;",
        tests=[STRICT_JSON]),
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
