/*
 * The worker: the pid range reserved for it, its start (session, signals, stdio, seccomp filter,
 * LD_PRELOAD, exec), whether a pid is our child, its exit status, and the copy of its log to our
 * stdout. Calls seccomp.c and common.c; main.c passes the state in.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "entrypoint.h"

/* LD_PRELOAD for the worker: the huge-page library first, then what the worker was given (the
 * container's own preloads stay, in their order). NULL: leave LD_PRELOAD as it is. */
static char *worker_preload(const struct ep *ep)
{
	const char *old = getenv("LD_PRELOAD");
	char *v;

	if (!ep->thp_preload[0])
		return NULL;
	if (!old || !*old)
		return strdup(ep->thp_preload);
	if (asprintf(&v, "%s:%s", ep->thp_preload, old) < 0)
		return NULL;
	return v;
}

static long read_long(const char *path)
{
	char buf[32];
	long v = -1;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t n = read(fd, buf, sizeof(buf) - 1);
		if (n > 0) {
			buf[n] = '\0';
			v = strtol(buf, NULL, 10);
		}
		close(fd);
	}
	return v;
}

/*
 * The other way to the floor, for a container that may not write ns_last_pid (containerd and
 * CRI-O mount /proc/sys read-only in a container that is not privileged, CAP_CHECKPOINT_RESTORE
 * or not): the kernel hands out a namespace's pids in increasing order, so starting and reaping
 * about PID_FLOOR children that exit at once leaves the next pid above the floor. vfork: the
 * child only _exits, and this takes a fraction of a second. Bounded by count.
 */
static bool cycle_pids(void)
{
	for (int i = 0; i < DYNSNAP_PID_FLOOR + 64; i++) {
		pid_t c = vfork();
		if (c < 0)
			return false;
		if (c == 0)
			_exit(0);
		while (waitpid(c, NULL, 0) < 0 && errno == EINTR)
			;
		if (c >= DYNSNAP_PID_FLOOR - 1)
			return true;
	}
	return false;
}

/*
 * Moves the namespace's pid counter to the floor so that the worker tree's
 * pids start there. Not fatal when it fails: the agent checks the worker's
 * pids against the same floor and refuses to capture, by name. Loud, because
 * a silently missing reservation shows up much later as a CRIU restore that
 * fails with EEXIST now and then.
 */
bool reserve_pids(bool cycle)
{
	const char *path = "/proc/sys/kernel/ns_last_pid";
	long last = read_long(path), pid_max = read_long("/proc/sys/kernel/pid_max");
	char val[32];
	int fd, n, e;

	if (last >= DYNSNAP_PID_FLOOR - 1)
		return true; /* the next pid is above the floor already */
	n = snprintf(val, sizeof(val), "%d", DYNSNAP_PID_FLOOR - 1);
	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd >= 0 && write(fd, val, (size_t)n) == n) {
		close(fd);
		if (read_long(path) >= DYNSNAP_PID_FLOOR - 1)
			return true;
		e = 0;
	} else {
		e = errno;
		if (fd >= 0)
			close(fd);
	}
	if (cycle && pid_max > DYNSNAP_PID_FLOOR && cycle_pids()) {
		ep_log("note: cannot write %s (%s; a container runtime mounts /proc/sys read-only unless the "
		       "container is privileged): moved the pid counter to the floor by starting and reaping "
		       "short-lived children instead", path, e ? strerror(e) : "the value did not stick");
		return true;
	}
	ep_log("WARNING: PID RESERVATION FAILED: cannot write %d to %s: %s. The worker gets low pids "
	       "and the dynsnap agent will refuse to snapshot it. This needs root (or "
	       "CAP_CHECKPOINT_RESTORE) in the container and /proc mounted read-write%s.",
	       DYNSNAP_PID_FLOOR - 1, path, e ? strerror(e) : "the value did not stick",
	       pid_max > 0 && pid_max <= DYNSNAP_PID_FLOOR ? ", and kernel.pid_max above the floor" : "");
	return false;
}

/* Container-style status: exit code, or 128 + signal. */
int wstatus_code(int ws)
{
	if (WIFEXITED(ws))
		return WEXITSTATUS(ws);
	if (WIFSIGNALED(ws))
		return 128 + WTERMSIG(ws);
	return 1;
}

/* Whether pid is alive and our child (a restored tree's root is reparented to us). */
bool is_our_child(pid_t pid)
{
	char path[64], buf[512], *p;
	int ppid = -1, fd;
	ssize_t n;
	if (pid <= 0)
		return false;
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return false;
	buf[n] = '\0';
	p = strrchr(buf, ')'); /* comm may hold spaces and parentheses */
	if (!p || sscanf(p + 1, " %*c %d", &ppid) != 1)
		return false;
	return ppid == (int)getpid() && p[2] != 'Z';
}

/* In the forked child: what it reports back on the pipe, "S<errno>;" when the seccomp filter
 * could not be installed (the worker still starts), "E<errno>" when stdio or exec failed. */
static void __attribute__((noreturn)) exec_worker(const struct ep *ep, int logfd, int pfd, const char *preload)
{
	char msg[32];
	int nul, rc, n;
	sigset_t all;

	setsid();
	/* An ignored signal stays ignored across exec: give the worker defaults, also
	 * for what our own parent left ignored (a shell's background job ignores
	 * SIGINT and SIGQUIT; the worker must still stop on them). */
	for (int s = 1; s < NSIG; s++)
		if (s != SIGKILL && s != SIGSTOP)
			signal(s, SIG_DFL);
	sigemptyset(&all);
	sigprocmask(SIG_SETMASK, &all, NULL);
	/* stdio opened here, inside the container's mount namespace: CRIU cannot
	 * dump a descriptor opened from outside it. */
	nul = open("/dev/null", O_RDONLY);
	if (nul < 0 || dup2(nul, 0) < 0 || dup2(logfd, 1) < 0 || dup2(logfd, 2) < 0) {
		rc = errno;
		n = snprintf(msg, sizeof(msg), "E%d", rc);
		(void)!write(pfd, msg, (size_t)n);
		_exit(127);
	}
	if (nul > 2)
		close(nul);
	if (ep->seccomp && (rc = seccomp_block_io_uring()) != 0) {
		n = snprintf(msg, sizeof(msg), "S%d;", -rc);
		(void)!write(pfd, msg, (size_t)n);
	}
	if (preload)
		setenv("LD_PRELOAD", preload, 1);
	execvp(ep->argv[0], ep->argv);
	rc = errno;
	n = snprintf(msg, sizeof(msg), "E%d", rc);
	(void)!write(pfd, msg, (size_t)n);
	_exit(rc == ENOENT ? 127 : 126);
}

/* In the parent: reads what the child reported before its exec (until exec closes the pipe). */
static void read_start_report(struct ep *ep, int pfd)
{
	char msg[32];
	ssize_t n = 0;

	for (;;) {
		ssize_t r = read(pfd, msg + n, sizeof(msg) - 1 - (size_t)n);
		if (r > 0) {
			n += r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		break;
	}
	msg[n] = '\0';
	ep->seccomp_status = ep->seccomp ? "on" : "off";
	if (msg[0] == 'S') {
		ep->seccomp_status = "failed";
		ep_log("WARNING: SECCOMP FILTER NOT INSTALLED: %s. The worker may use io_uring, "
		       "which CRIU cannot dump; the agent will refuse to snapshot it.",
		       strerror(atoi(msg + 1)));
	}
	if (strchr(msg, 'E'))
		ep_log("cannot run \"%s\": %s", ep->argv[0], strerror(atoi(strchr(msg, 'E') + 1)));
}

/* Starts the worker; a close-on-exec pipe carries back what happened before its exec. */
pid_t start_worker(struct ep *ep, int logfd)
{
	char *preload = worker_preload(ep);
	int pfd[2];
	pid_t pid;

	if (ep->thp_preload[0] && !preload) {
		ep_log("cannot build the worker's LD_PRELOAD: %s; the huge-page library is not preloaded",
		       strerror(errno));
		ep->thp_preload[0] = '\0';
	}
	if (pipe2(pfd, O_CLOEXEC) != 0)
		return -1;
	pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0)
		exec_worker(ep, logfd, pfd[1], preload);
	close(pfd[1]);
	free(preload);
	read_start_report(ep, pfd[0]);
	close(pfd[0]);
	return pid;
}

/*
 * Copies what the worker appended to its log onto our stdout, without ever
 * blocking on stdout (a stalled reader must not stall the probes). Once all of
 * it is copied and the file is past its cap, empties it, only while active: a
 * file that changes size between a CRIU dump and the restore makes the
 * restore fail, and the agent takes the worker out of `active` before a dump.
 * A line the worker writes between our last read and the truncation is lost.
 */
void copy_log(const struct ep *ep, int rfd, bool block)
{
	char buf[4096];
	for (;;) {
		struct pollfd p = { .fd = 1, .events = POLLOUT };
		ssize_t n, w, off = 0;
		off_t pos;
		if (!block && poll(&p, 1, 0) <= 0)
			return;
		pos = lseek(rfd, 0, SEEK_CUR);
		n = read(rfd, buf, sizeof(buf));
		if (n <= 0) {
			if (n == 0 && ep->log_max_bytes > 0 && pos >= ep->log_max_bytes &&
			    ep->state == ST_ACTIVE && truncate(ep->log_path, 0) == 0)
				lseek(rfd, 0, SEEK_SET);
			return;
		}
		while (off < n) {
			w = write(1, buf + off, (size_t)(n - off));
			if (w <= 0) {
				if (w < 0 && errno == EINTR)
					continue;
				if (w < 0 && errno == EAGAIN && block) {
					poll(&p, 1, 100);
					continue;
				}
				lseek(rfd, pos + off, SEEK_SET); /* try again later */
				return;
			}
			off += w;
		}
	}
}
