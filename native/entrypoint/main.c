/*
 * dynsnap-entrypoint: PID 1 of a Dynamo worker container.
 *
 * Reserves the pid range, starts the worker in its own session with its
 * output going to a log file (copied to our stdout), serves standby-aware
 * /live and /health, follows the state the node agent sets in the control
 * directory, and stays up while the worker tree is being captured by CRIU.
 * It also preloads libdynsnap-thp.so into the worker, so that the CUDA
 * driver's host copy of a checkpoint lands on huge pages (thp_setup).
 * docs/ENTRYPOINT.md is the contract.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "entrypoint.h"

#define TICK_MS 100 /* how often the log is copied and the request file looked at (also without inotify) */
#define EXIT_USAGE 2
/* kubelet keeps its own copy of our stdout; this file only has to bridge the
 * gap, and it usually lives on an emptyDir that may have a size limit. */
#define LOG_MAX_BYTES_DEFAULT (64LL << 20)

const char *const ep_state_names[ST_COUNT] = {
	[ST_ACTIVE] = DYNSNAP_STATE_ACTIVE,
	[ST_SUSPENDING] = DYNSNAP_STATE_SUSPENDING,
	[ST_SUSPENDED] = DYNSNAP_STATE_SUSPENDED,
	[ST_SNAPSHOTTED] = DYNSNAP_STATE_SNAPSHOTTED,
	[ST_RESTORING] = DYNSNAP_STATE_RESTORING,
};

/* Signals passed on to the worker's process group. */
static const int forwarded[] = { SIGTERM, SIGINT, SIGHUP, SIGQUIT };

int ep_state_parse(const char *s)
{
	for (int i = 0; i < ST_COUNT; i++)
		if (strcmp(s, ep_state_names[i]) == 0)
			return i;
	return -1;
}

void ep_log(const char *fmt, ...)
{
	char buf[1024];
	va_list ap;
	int n = snprintf(buf, sizeof(buf), "dynsnap-entrypoint: ");
	va_start(ap, fmt);
	vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
	va_end(ap);
	fprintf(stderr, "%s\n", buf);
}

long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

long long mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: dynsnap-entrypoint [options] [--] COMMAND [ARG...]\n"
		"Runs COMMAND (a Dynamo worker) as the child of a standby-aware PID 1.\n"
		"  --control-dir DIR   directory shared with the dynsnap agent (default %s)\n"
		"  --log-file PATH     worker stdout+stderr, copied to our stdout (default DIR/%s)\n"
		"  --log-max-bytes N   empty the log file past N bytes, once copied (default %lld; 0: never)\n"
		"  --probe-port N      port for /live and /health (default %d)\n"
		"  --system-port N     the worker's system port (default $DYN_SYSTEM_PORT)\n"
		"  --no-seccomp        do not refuse io_uring to the worker\n"
		"  --no-pid-cycle      reserve the pid range only by writing ns_last_pid, never by\n"
		"                      starting and reaping short-lived children\n"
		"  --thp-preload PATH  put this huge-page library first in the worker's LD_PRELOAD\n"
		"                      (default: %s next to this program, if there; $%s=PATH)\n"
		"  --no-thp-preload    do not preload it ($%s=off)\n"
		"  -h, --help          this text\n",
		DYNSNAP_CONTROL_DIR_DEFAULT, DYNSNAP_LOG_FILE, LOG_MAX_BYTES_DEFAULT,
		DYNSNAP_PROBE_PORT_DEFAULT, THP_LIBRARY, THP_PRELOAD_ENV, THP_PRELOAD_ENV);
}

static void __attribute__((noreturn, format(printf, 1, 2))) usage_error(const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "dynsnap-entrypoint: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n");
	usage(stderr);
	exit(EXIT_USAGE);
}

static int parse_port(const char *opt, const char *s)
{
	char *end;
	long v;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < 1 || v > 65535)
		usage_error("%s: not a port number: \"%s\"", opt, s);
	return (int)v;
}

/*
 * Which huge-page library the worker preloads (ep->thp_preload, empty: none).
 *
 * Why by default: at a checkpoint the CUDA driver copies the worker's GPU memory into a mapping it
 * makes with MAP_POPULATE inside the worker, faulted in 4 KiB at a time where the node's THP
 * setting is `madvise` (the usual one). libdynsnap-thp.so, loaded in the worker, makes that one
 * mapping on huge pages instead (native/thp/dynsnap-thp.c says how, and what else it leaves alone):
 * on the H200 a 16 GiB worker saved 1.43x and resumed 1.27x faster, without the node's setting
 * changing (docs/BENCHMARKS.md). Only the worker can ask for its own huge pages, hence the preload.
 *
 * `want` is the path from --thp-preload or $DYNSNAP_THP_PRELOAD, or NULL for the default: the
 * library next to this binary (the init container copies both), silently none when it is not
 * there. A path that was asked for and cannot be read is loud but not fatal: the worker still
 * serves, only its checkpoints are slower.
 */
static void thp_setup(struct ep *ep, const char *want)
{
	char self[PATH_MAX];
	ssize_t n;

	ep->thp_preload[0] = '\0';
	if (want) {
		if (access(want, R_OK) != 0) {
			ep_log("WARNING: HUGE-PAGE LIBRARY NOT PRELOADED: %s: %s. The worker runs without it; "
			       "its CUDA checkpoints land on 4 KiB pages and take longer.", want, strerror(errno));
			return;
		}
		snprintf(ep->thp_preload, sizeof(ep->thp_preload), "%s", want);
		return;
	}
	n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n <= 0 || (size_t)n + sizeof(THP_LIBRARY) >= sizeof(self))
		return;
	self[n] = '\0';
	*(strrchr(self, '/') + 1) = '\0'; /* the kernel's path of an executable is absolute */
	if ((size_t)snprintf(ep->thp_preload, sizeof(ep->thp_preload), "%s%s", self, THP_LIBRARY) >=
	    sizeof(ep->thp_preload) || access(ep->thp_preload, R_OK) != 0)
		ep->thp_preload[0] = '\0';
}

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

static void parse_args(struct ep *ep, int argc, char **argv)
{
	const char *sysport = getenv("DYN_SYSTEM_PORT");
	const char *log = NULL;
	const char *thp = getenv(THP_PRELOAD_ENV);
	bool thp_off = false;
	int i;

	snprintf(ep->control_dir, sizeof(ep->control_dir), "%s", DYNSNAP_CONTROL_DIR_DEFAULT);
	ep->probe_port = DYNSNAP_PROBE_PORT_DEFAULT;
	ep->log_max_bytes = LOG_MAX_BYTES_DEFAULT;
	ep->seccomp = true;
	ep->pid_cycle = true;
	for (i = 1; i < argc; i++) {
		char *a = argv[i], *val = NULL, name[32];
		if (strcmp(a, "--") == 0) {
			i++;
			break;
		}
		if (a[0] != '-')
			break;
		if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
			usage(stdout);
			exit(0);
		}
		if (strcmp(a, "--no-seccomp") == 0) {
			ep->seccomp = false;
			continue;
		}
		if (strcmp(a, "--no-pid-cycle") == 0) {
			ep->pid_cycle = false;
			continue;
		}
		if (strcmp(a, "--no-thp-preload") == 0) {
			thp_off = true;
			continue;
		}
		snprintf(name, sizeof(name), "%.*s", (int)strcspn(a, "="), a);
		if (strcmp(name, "--control-dir") && strcmp(name, "--log-file") &&
		    strcmp(name, "--probe-port") && strcmp(name, "--system-port") &&
		    strcmp(name, "--log-max-bytes") && strcmp(name, "--thp-preload"))
			usage_error("unknown option \"%s\"", a);
		if (strchr(a, '='))
			val = strchr(a, '=') + 1;
		else if (i + 1 < argc)
			val = argv[++i];
		else
			usage_error("%s needs a value", name);
		if (!*val)
			usage_error("%s needs a value", name);
		if (strcmp(name, "--control-dir") == 0) {
			if (strlen(val) >= sizeof(ep->control_dir))
				usage_error("--control-dir: path too long");
			snprintf(ep->control_dir, sizeof(ep->control_dir), "%s", val);
		}
		else if (strcmp(name, "--log-file") == 0)
			log = val;
		else if (strcmp(name, "--log-max-bytes") == 0) {
			char *end;
			errno = 0;
			ep->log_max_bytes = strtoll(val, &end, 10);
			if (errno || end == val || *end || ep->log_max_bytes < 0)
				usage_error("--log-max-bytes: not a byte count: \"%s\"", val);
		} else if (strcmp(name, "--probe-port") == 0)
			ep->probe_port = parse_port(name, val);
		else if (strcmp(name, "--thp-preload") == 0) {
			if (val[0] != '/')
				usage_error("--thp-preload must be an absolute path: \"%s\"", val);
			thp = val; /* the flag wins over the environment */
		} else
			sysport = val;
	}
	if (i >= argc)
		usage_error("no worker command given");
	ep->argv = argv + i;
	if (!sysport || !*sysport)
		usage_error("the worker's system port is unknown: set DYN_SYSTEM_PORT or --system-port");
	ep->system_port = parse_port("--system-port/DYN_SYSTEM_PORT", sysport);
	if (ep->system_port == ep->probe_port)
		usage_error("--probe-port %d is the worker's system port; pick another", ep->probe_port);
	if (ep->control_dir[0] != '/')
		usage_error("--control-dir must be an absolute path: \"%s\"", ep->control_dir);
	if (log)
		snprintf(ep->log_path, sizeof(ep->log_path), "%s", log);
	else
		snprintf(ep->log_path, sizeof(ep->log_path), "%s/%s", ep->control_dir, DYNSNAP_LOG_FILE);
	if (ep->log_path[0] != '/')
		usage_error("--log-file must be an absolute path: \"%s\"", ep->log_path);
	if (thp_off || (thp && strcmp(thp, "off") == 0))
		ep->thp_preload[0] = '\0';
	else if (thp && *thp && thp[0] != '/')
		usage_error("$%s must be an absolute path or \"off\": \"%s\"", THP_PRELOAD_ENV, thp);
	else
		thp_setup(ep, thp && *thp ? thp : NULL);
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
static bool reserve_pids(bool cycle)
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

static int mkdir_p(const char *dir)
{
	char p[PATH_MAX];
	snprintf(p, sizeof(p), "%s", dir);
	for (char *s = p + 1; *s; s++) {
		if (*s != '/')
			continue;
		*s = '\0';
		if (mkdir(p, 0755) != 0 && errno != EEXIST)
			return -1;
		*s = '/';
	}
	if (mkdir(p, 0755) != 0 && errno != EEXIST)
		return -1;
	return 0;
}

/* Container-style status: exit code, or 128 + signal. */
static int wstatus_code(int ws)
{
	if (WIFEXITED(ws))
		return WEXITSTATUS(ws);
	if (WIFSIGNALED(ws))
		return 128 + WTERMSIG(ws);
	return 1;
}

/* Whether pid is alive and our child (a restored tree's root is reparented to us). */
static bool is_our_child(pid_t pid)
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

/*
 * Starts the worker. A close-on-exec pipe carries back what happened before
 * exec: "S<errno>" when the seccomp filter could not be installed (the worker
 * still starts), "E<errno>" when exec failed.
 */
static pid_t start_worker(struct ep *ep, int logfd)
{
	int pfd[2], nul, rc;
	pid_t pid;
	char msg[32], *preload = worker_preload(ep);
	ssize_t n;
	sigset_t all;

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
	if (pid == 0) {
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
			(void)!write(pfd[1], msg, (size_t)n);
			_exit(127);
		}
		if (nul > 2)
			close(nul);
		if (ep->seccomp && (rc = seccomp_block_io_uring()) != 0) {
			n = snprintf(msg, sizeof(msg), "S%d;", -rc);
			(void)!write(pfd[1], msg, (size_t)n);
		}
		if (preload)
			setenv("LD_PRELOAD", preload, 1);
		execvp(ep->argv[0], ep->argv);
		rc = errno;
		n = snprintf(msg, sizeof(msg), "E%d", rc);
		(void)!write(pfd[1], msg, (size_t)n);
		_exit(rc == ENOENT ? 127 : 126);
	}
	close(pfd[1]);
	free(preload);
	n = 0;
	for (;;) {
		ssize_t r = read(pfd[0], msg + n, sizeof(msg) - 1 - (size_t)n);
		if (r > 0) {
			n += r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		break;
	}
	close(pfd[0]);
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
static void copy_log(const struct ep *ep, int rfd, bool block)
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

/*
 * Wake latency (issue 12): the agent waits for the acknowledgement of every state request, and a
 * wake or a capture is several requests in a row, so a request must not wait out the rest of a
 * tick (up to 100 ms each). An inotify watch on the control directory puts the loop's poll() on
 * the agent's rename of a new state-request (IN_MOVED_TO; IN_CLOSE_WRITE for one written in
 * place). Set up in the entrypoint itself after the worker is forked: the worker's seccomp filter
 * never applies to it, and the worker never holds the descriptor. Where it cannot be set up
 * (the per-user instance limit reached, a filesystem without inotify, any errno) the tick still
 * picks requests up, as it always did: logged once, "request_wakeup": "tick". Returns the
 * descriptor or -1.
 */
static int request_watch(struct ep *ep)
{
	const char *what = "inotify_init1";
	int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC), e;

	if (fd >= 0) {
		what = "inotify_add_watch";
		if (inotify_add_watch(fd, ep->control_dir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_ONLYDIR) >= 0) {
			ep->request_wakeup = "inotify";
			return fd;
		}
	}
	e = errno;
	if (fd >= 0)
		close(fd);
	ep->request_wakeup = "tick";
	ep_log("note: no inotify watch on %s (%s: %s): state requests are picked up at the %d ms tick "
	       "instead of at once, so every wake is slower%s", ep->control_dir, what, strerror(e), TICK_MS,
	       e == EMFILE ? " (the user's inotify instances are used up: fs.inotify.max_user_instances, "
			     "or user.max_inotify_instances in a user namespace)" :
	       e == ENOSPC ? " (the user's inotify watches are used up: fs.inotify.max_user_watches)" : "");
	return -1;
}

/*
 * Empties the watch's queue: the events only wake the loop, which then reads the request file
 * itself. A watch the kernel dropped (the directory was removed or its filesystem unmounted) ends
 * the inotify path: closed, back to the tick, *changed so the control file says so.
 */
static void request_watch_drain(struct ep *ep, int *fd, bool *changed)
{
	char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
	bool gone = false;
	ssize_t n;

	while ((n = read(*fd, buf, sizeof(buf))) > 0) {
		const struct inotify_event *ev;
		for (char *p = buf; p < buf + n; p += sizeof(*ev) + ev->len) {
			ev = (const struct inotify_event *)(void *)p;
			if (ev->mask & IN_IGNORED)
				gone = true;
		}
	}
	if (gone) {
		ep_log("note: the inotify watch on %s was removed by the kernel: state requests are picked up "
		       "at the %d ms tick from now on", ep->control_dir, TICK_MS);
		close(*fd);
		*fd = -1;
		ep->request_wakeup = "tick";
		*changed = true;
	}
}

int main(int argc, char **argv)
{
	static struct ep ep;
	struct sigaction sa = { .sa_handler = SIG_DFL };
	sigset_t mask;
	int sfd, lfd, logfd, rfd, ifd;
	bool stopping = false;

	parse_args(&ep, argc, argv);
	ep.worker_status = -1;
	ep.started_ms = now_ms();
	setvbuf(stderr, NULL, _IOLBF, 0);

	/* Signals arrive through a signalfd. A blocked signal is queued even for
	 * a namespace's init (whose SIG_DFL signals from outside are dropped). */
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	for (size_t i = 0; i < sizeof(forwarded) / sizeof(forwarded[0]); i++)
		sigaddset(&mask, forwarded[i]);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
	if (sfd < 0) {
		ep_log("signalfd: %s", strerror(errno));
		return 1;
	}
	sa.sa_handler = SIG_IGN;
	sigaction(SIGPIPE, &sa, NULL);

	if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0)
		ep_log("PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
	if (getpid() != 1)
		ep_log("note: pid %d, not PID 1 of the pid namespace: a tree restored by CRIU is "
		       "reparented to the namespace's init, not to this process", (int)getpid());

	/* First, before anything is forked. */
	ep.pid_reserved = reserve_pids(ep.pid_cycle);

	if (mkdir_p(ep.control_dir) != 0) {
		ep_log("cannot create control directory %s: %s", ep.control_dir, strerror(errno));
		return 1;
	}
	/* A request left on the volume by the previous container is not for us. */
	{
		char req[PATH_MAX + 32];
		snprintf(req, sizeof(req), "%s/%s", ep.control_dir, DYNSNAP_REQUEST_FILE);
		if (unlink(req) == 0)
			ep_log("removed a state request left by a previous container");
	}
	/* O_APPEND: after a CRIU restore the worker keeps appending at the end.
	 * Nothing but the worker ever writes this file: CRIU refuses to restore a
	 * descriptor whose file changed size since the dump. */
	logfd = open(ep.log_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
	rfd = open(ep.log_path, O_RDONLY | O_CLOEXEC);
	if (logfd < 0 || rfd < 0) {
		ep_log("cannot open log file %s: %s", ep.log_path, strerror(errno));
		return 1;
	}
	lfd = probe_listen(ep.probe_port);
	if (lfd < 0) {
		ep_log("cannot listen on probe port %d: %s", ep.probe_port, strerror(errno));
		return 1;
	}

	ep.state = ST_ACTIVE;
	ep.worker_pid = start_worker(&ep, logfd);
	if (ep.worker_pid < 0) {
		ep_log("fork: %s", strerror(errno));
		return 1;
	}
	close(logfd);
	ep.worker_alive = true;
	ep_log("started worker pid %d (probe port %d, system port %d, control dir %s, pid floor %d %s, "
	       "seccomp %s, thp preload %s)", (int)ep.worker_pid, ep.probe_port, ep.system_port,
	       ep.control_dir, DYNSNAP_PID_FLOOR, ep.pid_reserved ? "reserved" : "NOT reserved",
	       ep.seccomp_status, ep.thp_preload[0] ? ep.thp_preload : "off");
	ifd = request_watch(&ep); /* after the fork: the worker never holds it */
	control_write(&ep);

	for (;;) {
		/* pf[2]: the request watch; poll() skips it while it is -1 (no watch) */
		struct pollfd pf[3] = { { .fd = sfd, .events = POLLIN }, { .fd = lfd, .events = POLLIN },
					{ .fd = ifd, .events = POLLIN } };
		struct signalfd_siginfo si;
		bool changed = false, by_watch = false;
		long long seq = 0;
		char want[32], err[160];
		int ws, r;
		pid_t pid;

		if (poll(pf, 3, TICK_MS) < 0 && errno != EINTR) {
			ep_log("poll: %s", strerror(errno));
			return 1;
		}
		copy_log(&ep, rfd, false);

		while (read(sfd, &si, sizeof(si)) == sizeof(si)) {
			int sig = (int)si.ssi_signo;
			if (sig == SIGCHLD)
				continue;
			if (ep.worker_alive || is_our_child(ep.worker_pid)) {
				ep_log("passing signal %d to the worker's process group %d", sig, (int)ep.worker_pid);
				kill(-ep.worker_pid, sig);
				stopping = true;
			} else {
				ep_log("signal %d with no worker running (state %s): exiting", sig,
				       ep_state_names[ep.state]);
				copy_log(&ep, rfd, true);
				return 0;
			}
		}

		while ((pid = waitpid(-1, &ws, WNOHANG)) > 0) {
			if (pid != ep.worker_pid)
				continue; /* an orphan of the worker tree */
			ep.worker_alive = false;
			ep.worker_status = wstatus_code(ws);
			changed = true;
			if (stopping || ep.state == ST_ACTIVE || ep.state == ST_SUSPENDED) {
				copy_log(&ep, rfd, true);
				ep_log("worker pid %d exited with status %d (state %s): exiting with it",
				       (int)pid, ep.worker_status, ep_state_names[ep.state]);
				control_write(&ep);
				return ep.worker_status;
			}
			ep_log("worker pid %d exited with status %d while %s: staying up for the agent",
			       (int)pid, ep.worker_status, ep_state_names[ep.state]);
		}

		/* Drained every time round, just before the request is read. A request counts as noticed
		 * by the watch when the watch is what woke poll() this turn (the agent's temp file or its
		 * rename), not when the tick did with an event queued meanwhile. The entrypoint's own
		 * entrypoint.json renames wake it too: harmless, one more turn of the loop. */
		if (ifd >= 0) {
			by_watch = pf[2].revents & POLLIN;
			request_watch_drain(&ep, &ifd, &changed);
		}
		r = control_read_request(&ep, &seq, want, sizeof(want), err, sizeof(err));
		if (r != 0) {
			if (seq > 0)
				ep.request_seq = seq;
			ep.request_noticed = by_watch ? "inotify" : "tick";
			changed = true;
			if (r < 0) {
				snprintf(ep.request_error, sizeof(ep.request_error), "%s", err);
				ep_log("state request refused: %s", err);
			} else {
				enum ep_state to = (enum ep_state)ep_state_parse(want);
				ep.request_error[0] = '\0';
				if (!ep.worker_alive && is_our_child(ep.worker_pid)) {
					ep.worker_alive = true;
					ep_log("worker pid %d is running again (restored) and is our child",
					       (int)ep.worker_pid);
				}
				if (to != ep.state)
					ep_log("state %s -> %s (request %lld)", ep_state_names[ep.state],
					       ep_state_names[to], seq);
				ep.state = to;
				if (to == ST_ACTIVE && !ep.worker_alive) {
					copy_log(&ep, rfd, true);
					ep_log("state set to active but no worker is running (last status %d): "
					       "exiting %d so that the container starts afresh",
					       ep.worker_status, DYNSNAP_EXIT_NO_WORKER);
					control_write(&ep);
					return DYNSNAP_EXIT_NO_WORKER;
				}
			}
		}
		if (changed)
			control_write(&ep);

		if (pf[1].revents & POLLIN)
			probe_serve(lfd, &ep);
	}
}
