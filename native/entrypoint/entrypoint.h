/*
 * Internal interfaces of dynsnap-entrypoint (see docs/ENTRYPOINT.md, "Source layout").
 *
 * Who calls whom, with no cycle: main.c calls args.c, worker.c, control.c and probe.c, and passes
 * them the state (struct ep) they read; worker.c calls seccomp.c; control.c calls json.c; probe.c
 * calls upstream.c; every file may call common.c, which calls none of them. No file calls back
 * into main.c.
 */
#ifndef DYNSNAP_ENTRYPOINT_H
#define DYNSNAP_ENTRYPOINT_H

#include <limits.h>
#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "dynsnap_protocol.h"

/* The huge-page library (native/thp/) looked for next to the entrypoint's own binary, and the
 * environment variable that sets or turns off the preload like the flags do. */
#define THP_LIBRARY "libdynsnap-thp.so"
#define THP_PRELOAD_ENV "DYNSNAP_THP_PRELOAD"

/* entrypoint.json: each string that may come from outside (a path, the worker's command line, a
 * request's text) carries at most FIELD_MAX bytes of it, cut on a character boundary; the
 * entrypoint's own words at most WORD_MAX; the whole file at most CONTROL_MAX bytes. */
#define FIELD_MAX 2048
#define WORD_MAX 32
#define CONTROL_MAX 65536

enum ep_state { ST_ACTIVE, ST_SUSPENDING, ST_SUSPENDED, ST_SNAPSHOTTED, ST_RESTORING, ST_ROUTABLE, ST_COUNT };

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
	/* argv joined by spaces, for the control file: FIELD_MAX bytes and the next character whole
	 * (json.c cuts it on that character's boundary) */
	char worker_command[FIELD_MAX + 4];

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

/* common.c */
extern const char *const ep_state_names[ST_COUNT];
int ep_state_parse(const char *s); /* -1 when unknown */
void ep_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
long long now_ms(void);          /* CLOCK_REALTIME, for the control file */
long long mono_ms(void);         /* CLOCK_MONOTONIC, for deadlines */

/* args.c: exits 2 with the reason and the usage text on bad arguments, 0 after --help */
void parse_args(struct ep *ep, int argc, char **argv);

/* worker.c */
bool reserve_pids(bool cycle);
pid_t start_worker(struct ep *ep, int logfd);
bool is_our_child(pid_t pid);
int wstatus_code(int ws);
void copy_log(const struct ep *ep, int rfd, bool block);

/* json.c */
struct jbuf {
	char *p;
	size_t cap, len;
	bool full; /* something did not fit: the text is incomplete and must not be used */
};
void jb_init(struct jbuf *b, char *p, size_t cap);
void jb_raw(struct jbuf *b, const char *s);
void jb_fmt(struct jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void jb_str(struct jbuf *b, const char *s, size_t limit); /* s NULL: null */
size_t utf8_seq(const unsigned char *s, bool *ok);

/* control.c */
int control_write(const struct ep *ep);
/* Returns 1 and fills seq/state when the agent left a new, complete request;
 * 0 when nothing new; -1 (with err filled) for a malformed request. */
int control_read_request(const struct ep *ep, long long *seq, char *state, size_t statesz,
			 char *err, size_t errsz);

/* upstream.c: asking the worker (GET /live or /health on 127.0.0.1), for probe.c; never blocks. */
#define UPSTREAM_BODY_MAX 4095 /* bytes of the worker's body passed on */
struct upstream {
	int fd; /* -1: none */
	enum { UP_CONNECT, UP_SEND, UP_RECV } phase;
	size_t len, off; /* bytes in buf; sent of them */
	char buf[16384]; /* our request, then the worker's answer */
};
int upstream_start(struct upstream *u, int port, const char *path, const char **err); /* 0, or -1 (*err) */
short upstream_events(const struct upstream *u);          /* what to poll for */
int upstream_io(struct upstream *u, const char **err);    /* 0: not yet; 1: answer in; -1: failed (*err) */
int upstream_answer(struct upstream *u, char *ctype, size_t ctypesz, const char **body,
		    const char **err);                    /* the status, or -1 (*err) */
void upstream_close(struct upstream *u);

/* probe.c: the probe server, driven by main.c's poll loop; never blocks. */
#define PROBE_MAX_CONNS 16                 /* client connections held at once */
#define PROBE_MAX_FDS (1 + PROBE_MAX_CONNS) /* what probe_fds may add to the poll set */
int probe_listen(int port);                /* binds and keeps the listening socket; -1: errno */
int probe_fds(struct pollfd *pf, int max); /* fills pf, returns how many */
int probe_timeout(int tick_ms);            /* ms poll may wait: tick_ms or the next deadline */
void probe_step(const struct ep *ep);      /* after poll: accept, read, ask, answer, expire */

/* seccomp.c */
int seccomp_block_io_uring(void); /* 0, or -errno */

#endif
