/*
 * dynsnap-entrypoint: PID 1 of a Dynamo worker container.
 *
 * Reserves the pid range, starts the worker in its own session with its
 * output going to a log file (copied to our stdout), serves standby-aware
 * /live and /health, follows the state the node agent sets in the control
 * directory, and stays up while the worker tree is being captured by CRIU.
 * It also preloads libdynsnap-thp.so into the worker, so that the CUDA
 * driver's host copy of a checkpoint lands on huge pages (args.c, thp_setup).
 * docs/ENTRYPOINT.md is the contract.
 *
 * This file is the main loop: one thread, one poll() over the signals, the request watch and the
 * probe server's sockets, none of which ever blocks it. It calls the other files and passes them
 * the state (struct ep); none of them calls back (entrypoint.h draws the graph).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "entrypoint.h"

#define TICK_MS 100 /* how often the log is copied and the request file looked at (also without inotify) */

/* Signals passed on to the worker's process group. */
static const int forwarded[] = { SIGTERM, SIGINT, SIGHUP, SIGQUIT };

/* The loop's descriptors and what it remembers between turns. */
struct loop {
	struct ep *ep;
	int sfd, rfd, ifd; /* signals; the log, read side; the request watch (-1: none) */
	bool stopping;     /* a stop signal was passed to the worker */
};

static int mkdir_p(const char *dir)
{
	char p[PATH_MAX];
	size_t n = strlen(dir);
	if (n >= sizeof(p)) {
		errno = ENAMETOOLONG;
		return -1;
	}
	memcpy(p, dir, n + 1);
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

/* Signals arrive through a signalfd. A blocked signal is queued even for a namespace's init
 * (whose SIG_DFL signals from outside are dropped). */
static int signals_setup(void)
{
	struct sigaction sa = { .sa_handler = SIG_IGN };
	sigset_t mask;
	int sfd;

	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	for (size_t i = 0; i < sizeof(forwarded) / sizeof(forwarded[0]); i++)
		sigaddset(&mask, forwarded[i]);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
	if (sfd < 0)
		ep_log("signalfd: %s", strerror(errno));
	sigaction(SIGPIPE, &sa, NULL);
	return sfd;
}

/* Everything before the worker starts: pid range, control directory, log file, probe port.
 * Returns the log's write side (for the worker) or -1 after saying why. */
static int prepare(struct loop *l)
{
	struct ep *ep = l->ep;
	char req[PATH_MAX + 32];
	int logfd;

	if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0)
		ep_log("PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
	if (getpid() != 1)
		ep_log("note: pid %d, not PID 1 of the pid namespace: a tree restored by CRIU is "
		       "reparented to the namespace's init, not to this process", (int)getpid());
	ep->pid_reserved = reserve_pids(ep->pid_cycle); /* first, before anything is forked */
	if (mkdir_p(ep->control_dir) != 0) {
		ep_log("cannot create control directory %s: %s", ep->control_dir, strerror(errno));
		return -1;
	}
	/* A request left on the volume by the previous container is not for us. */
	snprintf(req, sizeof(req), "%.*s/%s", (int)sizeof(ep->control_dir), ep->control_dir,
		 DYNSNAP_REQUEST_FILE);
	if (unlink(req) == 0)
		ep_log("removed a state request left by a previous container");
	/* O_APPEND: after a CRIU restore the worker keeps appending at the end.
	 * Nothing but the worker ever writes this file: CRIU refuses to restore a
	 * descriptor whose file changed size since the dump. */
	logfd = open(ep->log_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
	l->rfd = open(ep->log_path, O_RDONLY | O_CLOEXEC);
	if (logfd < 0 || l->rfd < 0) {
		ep_log("cannot open log file %s: %s", ep->log_path, strerror(errno));
		return -1;
	}
	if (probe_listen(ep->probe_port) < 0) {
		ep_log("cannot listen on probe port %d: %s", ep->probe_port, strerror(errno));
		return -1;
	}
	return logfd;
}

/* Signals of this turn. Returns the exit status when the entrypoint is to exit, else -1. */
static int on_signals(struct loop *l)
{
	struct ep *ep = l->ep;
	struct signalfd_siginfo si;

	while (read(l->sfd, &si, sizeof(si)) == sizeof(si)) {
		int sig = (int)si.ssi_signo;
		if (sig == SIGCHLD)
			continue;
		if (ep->worker_alive || is_our_child(ep->worker_pid)) {
			ep_log("passing signal %d to the worker's process group %d", sig, (int)ep->worker_pid);
			kill(-ep->worker_pid, sig);
			l->stopping = true;
		} else {
			ep_log("signal %d with no worker running (state %s): exiting", sig,
			       ep_state_names[ep->state]);
			copy_log(ep, l->rfd, true);
			return 0;
		}
	}
	return -1;
}

/* Reaps what exited. Returns the exit status when the entrypoint exits with its worker, else -1. */
static int on_reaped(struct loop *l, bool *changed)
{
	struct ep *ep = l->ep;
	pid_t pid;
	int ws;

	while ((pid = waitpid(-1, &ws, WNOHANG)) > 0) {
		if (pid != ep->worker_pid)
			continue; /* an orphan of the worker tree */
		ep->worker_alive = false;
		ep->worker_status = wstatus_code(ws);
		*changed = true;
		if (l->stopping || ep->state == ST_ACTIVE || ep->state == ST_SUSPENDED || ep->state == ST_ROUTABLE) {
			copy_log(ep, l->rfd, true);
			ep_log("worker pid %d exited with status %d (state %s): exiting with it",
			       (int)pid, ep->worker_status, ep_state_names[ep->state]);
			control_write(ep);
			return ep->worker_status;
		}
		ep_log("worker pid %d exited with status %d while %s: staying up for the agent",
		       (int)pid, ep->worker_status, ep_state_names[ep->state]);
	}
	return -1;
}

/* Applies a request for state `want`. Returns the exit status when `active` finds no worker. */
static int apply_request(struct loop *l, long long seq, const char *want)
{
	struct ep *ep = l->ep;
	enum ep_state to = (enum ep_state)ep_state_parse(want);

	ep->request_error[0] = '\0';
	if (!ep->worker_alive && is_our_child(ep->worker_pid)) {
		ep->worker_alive = true;
		ep_log("worker pid %d is running again (restored) and is our child", (int)ep->worker_pid);
	}
	if (to != ep->state)
		ep_log("state %s -> %s (request %lld)", ep_state_names[ep->state], ep_state_names[to], seq);
	ep->state = to;
	if (to == ST_ACTIVE && !ep->worker_alive) {
		copy_log(ep, l->rfd, true);
		ep_log("state set to active but no worker is running (last status %d): "
		       "exiting %d so that the container starts afresh",
		       ep->worker_status, DYNSNAP_EXIT_NO_WORKER);
		control_write(ep);
		return DYNSNAP_EXIT_NO_WORKER;
	}
	return -1;
}

/*
 * The agent's request of this turn, if any. The watch is drained every time round, just before the
 * request is read. A request counts as noticed by the watch when the watch is what woke poll() this
 * turn (the agent's temp file or its rename), not when the tick did with an event queued meanwhile.
 * The entrypoint's own entrypoint.json renames wake it too: harmless, one more turn of the loop.
 * Returns the exit status when the entrypoint is to exit, else -1.
 */
static int on_request(struct loop *l, bool by_watch, bool *changed)
{
	struct ep *ep = l->ep;
	long long seq = 0;
	char want[32], err[160];
	int r;

	if (l->ifd >= 0)
		request_watch_drain(ep, &l->ifd, changed);
	else
		by_watch = false;
	r = control_read_request(ep, &seq, want, sizeof(want), err, sizeof(err));
	if (r == 0)
		return -1;
	if (seq > 0)
		ep->request_seq = seq;
	ep->request_noticed = by_watch ? "inotify" : "tick";
	*changed = true;
	if (r > 0)
		return apply_request(l, seq, want);
	snprintf(ep->request_error, sizeof(ep->request_error), "%s", err);
	ep_log("state request refused: %s", err);
	return -1;
}

/* The loop. Returns the entrypoint's exit status. */
static int run(struct loop *l)
{
	for (;;) {
		/* pf[1]: the request watch; poll() skips it while it is -1 (no watch) */
		struct pollfd pf[2 + PROBE_MAX_FDS] = { { .fd = l->sfd, .events = POLLIN },
							{ .fd = l->ifd, .events = POLLIN } };
		int n = 2 + probe_fds(pf + 2, PROBE_MAX_FDS), rc;
		bool changed = false;

		if (poll(pf, (nfds_t)n, probe_timeout(TICK_MS)) < 0 && errno != EINTR) {
			ep_log("poll: %s", strerror(errno));
			return 1;
		}
		copy_log(l->ep, l->rfd, false);
		if ((rc = on_signals(l)) >= 0 || (rc = on_reaped(l, &changed)) >= 0 ||
		    (rc = on_request(l, pf[1].revents & POLLIN, &changed)) >= 0)
			return rc;
		if (changed)
			control_write(l->ep);
		probe_step(l->ep); /* after the request: the answers speak for the state it set */
	}
}

int main(int argc, char **argv)
{
	static struct ep ep;
	struct loop l = { .ep = &ep, .ifd = -1 };
	int logfd;

	parse_args(&ep, argc, argv);
	ep.worker_status = -1;
	ep.started_ms = now_ms();
	setvbuf(stderr, NULL, _IOLBF, 0);
	l.sfd = signals_setup();
	if (l.sfd < 0 || (logfd = prepare(&l)) < 0)
		return 1;
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
	l.ifd = request_watch(&ep); /* after the fork: the worker never holds it */
	control_write(&ep);
	return run(&l);
}
