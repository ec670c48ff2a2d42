/* Internal interfaces of dynsnap-entrypoint (see docs/ENTRYPOINT.md). */
#ifndef DYNSNAP_ENTRYPOINT_H
#define DYNSNAP_ENTRYPOINT_H

#include <limits.h>
#include <stdbool.h>
#include <sys/types.h>

#include "dynsnap_protocol.h"

/* The huge-page library (native/thp/) looked for next to the entrypoint's own binary, and the
 * environment variable that sets or turns off the preload like the flags do. */
#define THP_LIBRARY "libdynsnap-thp.so"
#define THP_PRELOAD_ENV "DYNSNAP_THP_PRELOAD"

enum ep_state { ST_ACTIVE, ST_SUSPENDING, ST_SUSPENDED, ST_SNAPSHOTTED, ST_RESTORING, ST_COUNT };

struct ep {
	/* configuration */
	char control_dir[PATH_MAX / 2];
	char log_path[PATH_MAX];
	long long log_max_bytes;
	int probe_port;
	int system_port;
	bool seccomp;
	bool pid_cycle; /* when ns_last_pid cannot be written, reach the floor by cycling pids */
	/* libdynsnap-thp.so, prepended to the worker's LD_PRELOAD; empty: not preloaded */
	char thp_preload[PATH_MAX];
	char **argv; /* worker command */

	/* what the control file reports */
	enum ep_state state;
	pid_t worker_pid;      /* session leader = process group leader */
	bool worker_alive;
	int worker_status;     /* container-style status of the last leader exit, -1 if none */
	bool pid_reserved;
	const char *seccomp_status; /* "on", "off", "failed" */
	long long request_seq;      /* last request applied (or rejected) */
	char request_error[160];    /* empty when the last request was applied */
	long long started_ms;
	const char *request_wakeup;  /* "inotify": a new request wakes the loop; "tick": only the tick */
	const char *request_noticed; /* how the last request was noticed: "inotify", "tick", NULL: none yet */
};

extern const char *const ep_state_names[ST_COUNT];
int ep_state_parse(const char *s); /* -1 when unknown */

void ep_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
long long now_ms(void);          /* CLOCK_REALTIME, for the control file */
long long mono_ms(void);         /* CLOCK_MONOTONIC, for deadlines */

/* control.c */
int control_write(const struct ep *ep);
/* Returns 1 and fills seq/state when the agent left a new, complete request;
 * 0 when nothing new; -1 (with err filled) for a malformed request. */
int control_read_request(const struct ep *ep, long long *seq, char *state, size_t statesz,
			 char *err, size_t errsz);

/* probe.c */
int probe_listen(int port);
void probe_serve(int lfd, const struct ep *ep);

/* seccomp.c */
int seccomp_block_io_uring(void); /* 0, or -errno */

#endif
