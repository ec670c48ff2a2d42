/* dynsnap-nsexec: start one of the agent's own programs in a worker's namespaces, never in its
 * mount namespace (docs/NATIVE.md, "dynsnap-nsexec"; docs/threat-model.md).
 *
 *   dynsnap-nsexec --target-pidfd FD [--target-start TICKS] --ns pid,net,ipc,uts,cgroup
 *                  [--private-mounts] [--mntns-fd N] [--join-cgroups] [--outlive] -- PROGRAM [ARG...]
 *
 * The agent is root on the node; everything of a worker's (its files, its /proc, its PID 1) is
 * written by the pod's author. A program started by `nsenter -m` runs its dynamic loader in the
 * worker's mount namespace, where /etc/ld.so.preload is the pod's: a library the pod names would
 * run as the node's root. So this launcher never enters a mount namespace. It:
 *
 *  1. takes the target as a pidfd (the agent opened it and checked the process's identity; the
 *     pidfd pins it), reads its pid from the pidfd's fdinfo, opens /proc/<pid>/ns/<type> for the
 *     user and mount namespaces and each one asked for, then checks the pidfd's process still
 *     lives (so the files it opened are that process's, not a reused pid's) and, given
 *     --target-start, that its start time is the one the agent saw;
 *  2. refuses (exit 122, "refused:") unless the target's user namespace is the launcher's own
 *     (the node's) and every namespace it would enter, and the mount namespace, is owned by it: a
 *     PID 1 that moved itself into a user namespace of its own (and so into namespaces it owns)
 *     would otherwise decide what the program sees;
 *  3. enters the checked namespaces through the descriptors it checked (setns), never by pid;
 *  4. with --private-mounts, makes a mount namespace of its own: a copy of the caller's (the
 *     agent's files, never the worker's), every mount private, so nothing mounted in it is seen
 *     anywhere else and all of it goes when its last process ends;
 *  5. forks (a pid namespace applies to children), and in the child: SIGKILL when the launcher
 *     dies (unless --outlive), a fresh procfs on /proc for the target's pid namespace (with
 *     --private-mounts and pid), with --join-cgroups the target's own cgroups joined (each
 *     hierarchy mounted in the private mount namespace for the move, then unmounted: the program,
 *     and what it starts, are accounted and limited as the target's container, and outlive the
 *     caller's container, whose processes its runtime kills by cgroup), the checked mount namespace
 *     kept open at descriptor N for the program (--mntns-fd: CRIU's --join-ns mnt:/proc/self/fd/N),
 *     every other descriptor above 2 closed, then exec of PROGRAM, a path of the caller's file system;
 *  6. forwards SIGTERM, SIGINT and SIGHUP to the child and exits with its status (128+signal
 *     when it was killed).
 *
 * Exit codes of its own: 122 refused (the namespaces are not the runtime's), 125 it failed
 * (errno-level, its message says which call), 126 PROGRAM could not be executed, 127 it does not
 * exist. Built static
 * (native/nsexec/Makefile): nothing it loads comes from anywhere but its own file. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXIT_REFUSED 122
#define EXIT_FAILED 125
#define EXIT_NOEXEC 126

#ifndef NS_GET_USERNS
#define NS_GET_USERNS 0xb701 /* _IO(0xb7, 0x1), linux/nsfs.h */
#endif
#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif

struct ns_type {
	const char *name;   /* --ns word, and /proc/<pid>/ns/<name> */
	int flag;           /* setns nstype */
	const char *file;   /* what to open under /proc/<pid>/ns/ */
};

/* The namespaces it may enter. Never mnt (its loader would read the worker's files) and never
 * user (the checks below are made against the node's). */
static const struct ns_type ENTERABLE[] = {
	{"pid", CLONE_NEWPID, "pid"},
	{"net", CLONE_NEWNET, "net"},
	{"ipc", CLONE_NEWIPC, "ipc"},
	{"uts", CLONE_NEWUTS, "uts"},
	{"cgroup", CLONE_NEWCGROUP, "cgroup"},
};
#define N_ENTERABLE (sizeof ENTERABLE / sizeof ENTERABLE[0])

static void die(int code, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
static void die(int code, const char *fmt, ...) {
	va_list ap;
	fputs(code == EXIT_REFUSED ? "dynsnap-nsexec: refused: " : "dynsnap-nsexec: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(code);
}

static void usage(void) {
	fprintf(stderr,
		"usage: dynsnap-nsexec --target-pidfd FD [--target-start TICKS] --ns TYPE[,TYPE...]\n"
		"                      [--private-mounts] [--mntns-fd N] [--join-cgroups] [--outlive]\n"
		"                      -- PROGRAM [ARG...]\n"
		"  TYPE: pid net ipc uts cgroup (never mnt or user)\n");
	exit(2);
}

static long parse_num(const char *s, const char *what) {
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < 0)
		die(2, "%s: not a number: %s", what, s);
	return v;
}

/* The pid the pidfd names (its fdinfo's "Pid:"), or -1 once the process has exited. */
static long pidfd_pid(int pidfd) {
	char path[64], line[256];
	snprintf(path, sizeof path, "/proc/self/fdinfo/%d", pidfd);
	FILE *f = fopen(path, "re");
	if (!f)
		die(EXIT_FAILED, "%s: %s", path, strerror(errno));
	long pid = 0;
	int found = 0;
	while (fgets(line, sizeof line, f))
		if (sscanf(line, "Pid: %ld", &pid) == 1) {
			found = 1;
			break;
		}
	fclose(f);
	if (!found)
		die(EXIT_FAILED, "descriptor %d is not a pidfd (no Pid: in its fdinfo)", pidfd);
	return pid;
}

/* Field 22 of /proc/<pid>/stat: the start time, clock ticks after boot; -1 if unreadable. */
static long long start_time(long pid) {
	char path[64], buf[4096];
	snprintf(path, sizeof path, "/proc/%ld/stat", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	char *p = strrchr(buf, ')'); /* comm may hold anything: the fields after it start at the last ')' */
	if (!p)
		return -1;
	long long v = -1;
	/* state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime
	 * priority nice threads itrealvalue starttime */
	if (sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %lld", &v) != 1)
		return -1;
	return v;
}

static int open_ns(long pid, const char *file) {
	char path[64];
	snprintf(path, sizeof path, "/proc/%ld/ns/%s", pid, file);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		die(EXIT_FAILED, "%s: %s", path, strerror(errno));
	return fd;
}

static ino_t inode_of(int fd, const char *what) {
	struct stat st;
	if (fstat(fd, &st))
		die(EXIT_FAILED, "fstat of %s: %s", what, strerror(errno));
	return st.st_ino;
}

/* The inode of the user namespace that owns the namespace open at fd. */
static ino_t owner_of(int fd, const char *what) {
	int u = ioctl(fd, NS_GET_USERNS);
	if (u < 0)
		die(EXIT_FAILED, "the owner of the target's %s namespace (NS_GET_USERNS): %s", what, strerror(errno));
	ino_t ino = inode_of(u, what);
	close(u);
	return ino;
}

/* The target's cgroups, one line of /proc/<pid>/cgroup each ("ID:CONTROLLERS:PATH"), read in its
 * cgroup namespace (so the paths are relative to that namespace's root, which is where a cgroup file
 * system mounted from inside it is rooted). */
#define MAX_CGROUP_LINES 32
static char cgroup_lines[MAX_CGROUP_LINES][1024];
static int n_cgroup_lines;

static void read_cgroups(long pid) {
	char path[64], line[1024];
	snprintf(path, sizeof path, "/proc/%ld/cgroup", pid);
	FILE *f = fopen(path, "re");
	if (!f)
		die(EXIT_FAILED, "%s: %s", path, strerror(errno));
	while (fgets(line, sizeof line, f)) {
		line[strcspn(line, "\n")] = 0;
		if (!*line)
			continue;
		if (n_cgroup_lines == MAX_CGROUP_LINES)
			die(EXIT_FAILED, "%s: more than %d hierarchies", path, MAX_CGROUP_LINES);
		snprintf(cgroup_lines[n_cgroup_lines++], sizeof cgroup_lines[0], "%s", line);
	}
	fclose(f);
	if (!n_cgroup_lines)
		die(EXIT_FAILED, "%s: no cgroup", path);
}

/* Moves this process into the cgroups read_cgroups() read: each hierarchy mounted on a tmpfs of the
 * (private) mount namespace, "0" written to its cgroup.procs at the target's path, then unmounted. */
static void join_cgroups(void) {
	const char *yard = "/sys/fs/cgroup";
	if (mount("dynsnap-nsexec", yard, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0700"))
		die(EXIT_FAILED, "a tmpfs on %s: %s", yard, strerror(errno));
	for (int i = 0; i < n_cgroup_lines; i++) {
		char *line = cgroup_lines[i], *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
		if (!c1 || !c2 || c2[1] != '/')
			die(EXIT_FAILED, "the target's cgroup line %s: not ID:CONTROLLERS:/PATH", line);
		*c2 = 0;
		const char *ctrls = c1 + 1, *cgpath = c2 + 1;
		char dir[64], opts[512], procs[2048];
		snprintf(dir, sizeof dir, "%s/%d", yard, i);
		if (mkdir(dir, 0700))
			die(EXIT_FAILED, "mkdir %s: %s", dir, strerror(errno));
		int rc;
		if (!*ctrls) {
			rc = mount("cgroup2", dir, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
		} else {
			snprintf(opts, sizeof opts, "%s%s", strncmp(ctrls, "name=", 5) ? "" : "none,", ctrls);
			rc = mount("cgroup", dir, "cgroup", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts);
		}
		if (rc)
			die(EXIT_FAILED, "mounting the cgroup hierarchy \"%s\": %s", ctrls, strerror(errno));
		snprintf(procs, sizeof procs, "%s%s/cgroup.procs", dir, cgpath);
		int fd = open(procs, O_WRONLY | O_CLOEXEC);
		if (fd < 0 || write(fd, "0", 1) != 1)
			die(EXIT_FAILED, "joining the target's cgroup %s (%s): %s", cgpath, *ctrls ? ctrls : "unified",
			    strerror(errno));
		close(fd);
		umount2(dir, MNT_DETACH);
	}
	umount2(yard, MNT_DETACH);
}

static int child_pid = -1;

static void forward(int sig) {
	if (child_pid > 0)
		kill(child_pid, sig);
}

/* Every descriptor above 2 closed but keep (-1: none). */
static void close_others(int keep) {
	long max = sysconf(_SC_OPEN_MAX);
	if (max < 0 || max > 1 << 20)
		max = 1 << 20;
#ifdef SYS_close_range
	if (keep < 0) {
		if (syscall(SYS_close_range, 3U, ~0U, 0U) == 0)
			return;
	} else if ((keep == 3 || syscall(SYS_close_range, 3U, (unsigned)keep - 1, 0U) == 0) &&
		   syscall(SYS_close_range, (unsigned)keep + 1, ~0U, 0U) == 0) {
		return;
	}
#endif
	for (long fd = 3; fd < max; fd++)
		if (fd != keep)
			close((int)fd);
}

int main(int argc, char **argv) {
	int pidfd = -1, private_mounts = 0, mntns_out = -1, join = 0, outlive = 0;
	long long want_start = -1;
	int want[N_ENTERABLE] = {0};
	int i = 1;
	for (; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--")) {
			i++;
			break;
		} else if (!strcmp(a, "--target-pidfd") && i + 1 < argc) {
			pidfd = (int)parse_num(argv[++i], "--target-pidfd");
		} else if (!strcmp(a, "--target-start") && i + 1 < argc) {
			want_start = parse_num(argv[++i], "--target-start");
		} else if (!strcmp(a, "--ns") && i + 1 < argc) {
			char *list = strdup(argv[++i]), *save = NULL;
			if (!list)
				die(EXIT_FAILED, "out of memory");
			for (char *w = strtok_r(list, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
				size_t k = 0;
				while (k < N_ENTERABLE && strcmp(ENTERABLE[k].name, w))
					k++;
				if (k == N_ENTERABLE)
					die(2, "--ns %s: not one of pid net ipc uts cgroup (mnt and user are never entered)", w);
				want[k] = 1;
			}
			free(list);
		} else if (!strcmp(a, "--private-mounts")) {
			private_mounts = 1;
		} else if (!strcmp(a, "--join-cgroups")) {
			join = 1;
		} else if (!strcmp(a, "--outlive")) {
			outlive = 1;
		} else if (!strcmp(a, "--mntns-fd") && i + 1 < argc) {
			mntns_out = (int)parse_num(argv[++i], "--mntns-fd");
			if (mntns_out < 3)
				die(2, "--mntns-fd %d: must be above 2", mntns_out);
		} else {
			usage();
		}
	}
	if (pidfd < 0 || i >= argc)
		usage();
	if (mntns_out == pidfd)
		die(2, "--mntns-fd %d: that is the target's pidfd", mntns_out);
	if (join && (!private_mounts || !want[4]))
		die(2, "--join-cgroups needs --private-mounts and --ns cgroup (the hierarchies are mounted there)");
	if (argv[i][0] != '/')
		die(2, "PROGRAM %s: must be an absolute path (of the agent's own file system)", argv[i]);

	/* 1. The pinned target's namespaces, opened while it is shown to live. */
	long pid = pidfd_pid(pidfd);
	if (pid <= 0)
		die(EXIT_FAILED, "the target process has exited");
	int user_fd = open_ns(pid, "user"), mnt_fd = open_ns(pid, "mnt");
	int fds[N_ENTERABLE];
	for (size_t k = 0; k < N_ENTERABLE; k++)
		fds[k] = want[k] ? open_ns(pid, ENTERABLE[k].file) : -1;
	long long started = start_time(pid);
	if (syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) != 0 || pidfd_pid(pidfd) != pid)
		die(EXIT_FAILED, "the target process (pid %ld) exited while its namespaces were opened", pid);
	if (want_start >= 0 && started != want_start)
		die(EXIT_FAILED, "pid %ld is not the target the agent checked (started at %lld, not %lld)", pid,
		    started, want_start);

	/* 2. Only namespaces the runtime made: the node's user namespace, and each owned by it. */
	int self_user = open("/proc/self/ns/user", O_RDONLY | O_CLOEXEC);
	if (self_user < 0)
		die(EXIT_FAILED, "/proc/self/ns/user: %s", strerror(errno));
	ino_t node_user = inode_of(self_user, "the launcher's user namespace");
	close(self_user);
	ino_t target_user = inode_of(user_fd, "the target's user namespace");
	if (target_user != node_user)
		die(EXIT_REFUSED, "ForeignNamespace: the target (pid %ld) is in user namespace %lu, not the node's (%lu)", pid,
		    (unsigned long)target_user, (unsigned long)node_user);
	ino_t owner = owner_of(mnt_fd, "mnt");
	if (owner != node_user)
		die(EXIT_REFUSED, "ForeignNamespace: the target's mnt namespace is owned by user namespace %lu, not the node's (%lu)",
		    (unsigned long)owner, (unsigned long)node_user);
	for (size_t k = 0; k < N_ENTERABLE; k++) {
		if (fds[k] < 0)
			continue;
		owner = owner_of(fds[k], ENTERABLE[k].name);
		if (owner != node_user)
			die(EXIT_REFUSED, "ForeignNamespace: the target's %s namespace is owned by user namespace %lu, not the node's (%lu)",
			    ENTERABLE[k].name, (unsigned long)owner, (unsigned long)node_user);
	}
	close(user_fd);

	/* 3. Entered through the checked descriptors. */
	for (size_t k = 0; k < N_ENTERABLE; k++) {
		if (fds[k] < 0)
			continue;
		if (setns(fds[k], ENTERABLE[k].flag))
			die(EXIT_FAILED, "setns(%s): %s", ENTERABLE[k].name, strerror(errno));
		close(fds[k]);
	}

	if (join)
		read_cgroups(pid); /* in the target's cgroup namespace now: paths relative to its root */

	/* 4. A mount namespace of its own, nothing propagated in or out. */
	if (private_mounts) {
		if (unshare(CLONE_NEWNS))
			die(EXIT_FAILED, "unshare(CLONE_NEWNS): %s", strerror(errno));
		if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL))
			die(EXIT_FAILED, "making its mounts private: %s", strerror(errno));
	}
	if (mntns_out >= 0) {
		/* not close-on-exec there: the program gets it (dup2 onto itself keeps the flag: cleared) */
		if (dup2(mnt_fd, mntns_out) < 0 || fcntl(mntns_out, F_SETFD, 0) < 0)
			die(EXIT_FAILED, "the mount namespace at descriptor %d: %s", mntns_out, strerror(errno));
	}
	if (mnt_fd != mntns_out)
		close(mnt_fd);

	/* 5. The child, in the pid namespace. */
	sigset_t all, old;
	sigfillset(&all);
	sigprocmask(SIG_BLOCK, &all, &old);
	/* The child checks through this pipe that the launcher still lives once its death signal is
	 * set: the launcher holds the write end, so the read end hangs up when it is gone (getppid says
	 * nothing there, its parent being outside its pid namespace; nor can it signal a pidfd of it). */
	int alive[2];
	if (pipe2(alive, O_CLOEXEC))
		die(EXIT_FAILED, "pipe2: %s", strerror(errno));
	child_pid = fork();
	if (child_pid < 0)
		die(EXIT_FAILED, "fork: %s", strerror(errno));
	if (child_pid == 0) {
		sigprocmask(SIG_SETMASK, &old, NULL);
		if (!outlive && prctl(PR_SET_PDEATHSIG, SIGKILL))
			die(EXIT_FAILED, "prctl(PR_SET_PDEATHSIG): %s", strerror(errno));
		close(alive[1]);
		struct pollfd p = {.fd = alive[0], .events = POLLIN};
		if (!outlive && poll(&p, 1, 0) != 0)
			die(EXIT_FAILED, "the launcher died before its child started");
		close(alive[0]);
		if (join)
			join_cgroups();
		if (private_mounts && want[0]) {
			/* /proc for the target's pid namespace: the pids the program is given are in-namespace ones */
			if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
				die(EXIT_FAILED, "mounting /proc for the target's pid namespace: %s", strerror(errno));
		}
		close(pidfd);
		close_others(mntns_out);
		execv(argv[i], &argv[i]);
		die(errno == ENOENT ? EXIT_NOEXEC + 1 : EXIT_NOEXEC, "exec %s: %s", argv[i], strerror(errno));
	}
	close(pidfd);
	close(alive[0]);
	if (mntns_out >= 0)
		close(mntns_out);

	/* 6. Signals passed on; the child's status is ours. */
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = forward;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sigprocmask(SIG_SETMASK, &old, NULL);
	int status;
	for (;;) {
		pid_t r = waitpid(child_pid, &status, 0);
		if (r == child_pid)
			break;
		if (r < 0 && errno != EINTR)
			die(EXIT_FAILED, "waitpid: %s", strerror(errno));
	}
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	return 128 + WTERMSIG(status);
}
