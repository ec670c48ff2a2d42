/*
 * fake_slow_criu: stands in for a CRIU that takes long on a big worker (a 16 GiB worker dumped in
 * 23.8 s and restored in 17.7 s on the H200, docs/BENCHMARKS.md), so that a test can kill the agent
 * while a dump or a restore is in flight, or delete the worker's pod while its dump's exit is held.
 *
 * It is a library the test links into a copy of the real CRIU (patchelf --add-needed, its directory
 * on the copy's RUNPATH): the agent starts that copy exactly as it starts CRIU (dynsnap-nsexec, in a
 * mount namespace of CRIU's own, a copy of the agent's: dynsnap/agent/criu.py). The CRIU is the real
 * one; only the moment its main() starts, or the moment its process exits, is held back.
 *
 * Its files live in the directory $DYNSNAP_FAKE_SLOW_CRIU names, a path in CRIU's own mount
 * namespace (for the tests' agent, a process of the node's: a node path).
 * No such variable or directory: this CRIU is the real one, untouched.
 *
 *   <op>.mode   for op dump or restore: "before" (wait until released, then run CRIU's main) or
 *               "after" (run CRIU, then, at its exit, wait until released: the dump or restore is
 *               complete but the agent has not learnt it); absent: not held
 *   release     created by the test: stop holding back
 *   log         one line per event: "start <pid> <mode> <args>" (a /proc/self/fd/N argument
 *               written as the path the descriptor names), "exec <pid>", "exited <pid> <rc>",
 *               "done <pid>"; <pid> as CRIU's own pid namespace numbers it
 *
 * It writes nothing on stdout or stderr: after the agent dies, nobody reads them. Holding back is
 * bounded (1200 x 0.1 s) so a forgotten release cannot wedge a test run. Only CRIU's own process
 * is held at its exit, never a child it forked.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static char dir[512];
static pid_t main_pid;

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void logf_(const char *fmt, ...)
{
	char path[600], line[8192];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if (n > (int)sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	snprintf(path, sizeof(path), "%s/log", dir);
	int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return;
	if (write(fd, line, n) < 0) { /* nothing to tell anyone */ }
	close(fd);
}

static int exists(const char *name)
{
	char path[600];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	return access(path, F_OK) == 0;
}

static void held(void)
{
	struct timespec tick = {0, 100 * 1000 * 1000};
	for (int i = 0; i < 1200 && !exists("release"); i++)
		nanosleep(&tick, NULL);
}

static void mode_of(const char *op, char *out, size_t len)
{
	char path[600];
	snprintf(out, len, "none");
	snprintf(path, sizeof(path), "%s/%s.mode", dir, op);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return;
	ssize_t n = read(fd, out, len - 1);
	close(fd);
	if (n <= 0) {
		snprintf(out, len, "none");
		return;
	}
	out[n] = 0;
	out[strcspn(out, " \t\r\n")] = 0;
}

static void at_exit(int status, void *arg)
{
	(void)arg;
	if (getpid() != main_pid)
		return;
	logf_("exited %d %d", (int)main_pid, status);
	held();
	logf_("done %d", (int)main_pid);
}

__attribute__((constructor)) static void fake_slow_criu(int argc, char **argv)
{
	const char *d = getenv("DYNSNAP_FAKE_SLOW_CRIU");
	if (!d || !*d || strlen(d) >= sizeof(dir) || argc < 2)
		return;
	snprintf(dir, sizeof(dir), "%s", d);
	if (access(dir, W_OK) != 0)
		return;
	main_pid = getpid();
	char mode[32], args[6144] = "";
	size_t at = 0;
	mode_of(argv[1], mode, sizeof(mode));
	for (int i = 1; i < argc && at < sizeof(args) - 1; i++) {
		char target[1024];
		const char *a = argv[i];
		if (strncmp(a, "/proc/self/fd/", 14) == 0 && strchr(a + 14, '/') == NULL) {
			ssize_t n = readlink(a, target, sizeof(target) - 1);
			if (n > 0) {
				target[n] = 0;
				a = target;
			}
		}
		int n = snprintf(args + at, sizeof(args) - at, "%s%s", i > 1 ? " " : "", a);
		if (n < 0)
			break;
		at += (size_t)n;
	}
	logf_("start %d %s %s", (int)main_pid, mode, args);
	if (strcmp(mode, "before") == 0) {
		held();
		logf_("exec %d", (int)main_pid);
	} else if (strcmp(mode, "after") == 0) {
		on_exit(at_exit, NULL);
	}
}
