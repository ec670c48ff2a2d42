/*
 * The pod's probe endpoints. /live: 200 while the entrypoint lives, except that while the worker
 * is active it answers what the worker's /live answers. /health: the worker's /health while
 * active, 503 in every other state.
 *
 * Served from main.c's poll loop without ever blocking it (docs/ENTRYPOINT.md, "Probe server"):
 * every socket is non-blocking, each connection is a small state machine that moves whenever its
 * socket is ready, and each phase has a deadline. So a client that sends one byte a second, or
 * nothing, or a worker that does not answer, costs the loop nothing but a slot: state requests
 * and other probes go on being served. At most PROBE_MAX_CONNS connections are held; when all
 * are taken, the oldest one that has not sent its whole request yet makes room for the new one
 * (a prober sends its request at once, so it is never the one that goes). One peer address (one
 * pod, or the node's kubelet) holds at most PROBE_PEER_SHARE of them: a peer past its share makes
 * room among its own connections or has the new one closed at once, so a flood from another pod,
 * whole requests or silent connects, leaves kubelet's probes their slots, and the listen backlog
 * (PROBE_BACKLOG) is drained at every turn, those over their share closed as they come.
 * Calls upstream.c (asking the worker) and common.c; main.c passes the state in.
 */
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "entrypoint.h"

/* A prober sends its request at once: one that has not come whole by then is not from a prober
 * that is still waiting (twice kubelet's default 1 s probe timeout). */
#define REQUEST_TIMEOUT_MS 2000
/* Under kubelet's default probe timeout (1 s), so a slow worker is reported as failing by us
 * rather than as a probe timeout. */
#define WORKER_TIMEOUT_MS 800
/* Our answer is a few KiB and fits the socket's buffer; a client that reads nothing gets this. */
#define ANSWER_TIMEOUT_MS 1000
#define ACCEPT_BURST 32 /* accepted per turn of the loop, so a flood of connects takes turns too */
#define PROBE_BACKLOG 128 /* connects the kernel queues before we accept them */
#define PROBE_PEER_SHARE (PROBE_MAX_CONNS / 2) /* connections one peer address may hold */

enum phase { FREE, REQUEST, WORKER, ANSWER };

struct conn {
	enum phase phase;
	int fd;                   /* the client */
	long long deadline;       /* of the current phase, mono_ms */
	unsigned long long order; /* accept order: the oldest request gives way first */
	unsigned char peer[16];   /* the client's address (IPv4 as IPv4-mapped IPv6) */
	bool head;
	const char *path;         /* "/live" or "/health" while the worker is asked */
	size_t len, off;          /* bytes in req or out; sent of out */
	char req[2048];           /* the client's request */
	struct upstream up;       /* the worker, while asked */
	char out[UPSTREAM_BODY_MAX + 1 + 512]; /* our answer */
};

static int lfd = -1; /* the listening socket */
static struct {      /* zeroed (in .bss, not in the binary): every slot FREE */
	unsigned long long accepted;
	struct conn c[PROBE_MAX_CONNS];
} ps;

int probe_listen(int port)
{
	int one = 1, zero = 0, fd;
	struct sockaddr_in6 a6 = { .sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port),
				   .sin6_addr = IN6ADDR_ANY_INIT };
	struct sockaddr_in a4 = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				  .sin_addr.s_addr = htonl(INADDR_ANY) };

	/* Dual-stack when the pod has IPv6, plain IPv4 otherwise. */
	fd = socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd >= 0) {
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
		if (bind(fd, (struct sockaddr *)&a6, sizeof(a6)) == 0 && listen(fd, PROBE_BACKLOG) == 0)
			return lfd = fd;
		close(fd);
	}
	fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&a4, sizeof(a4)) != 0 || listen(fd, PROBE_BACKLOG) != 0) {
		int e = errno;
		close(fd);
		errno = e;
		return -1;
	}
	return lfd = fd;
}

static void conn_close(struct conn *c)
{
	upstream_close(&c->up);
	if (c->phase != FREE)
		close(c->fd);
	c->phase = FREE;
	c->fd = -1;
}

static const char *reason(int code)
{
	switch (code) {
	case 200: return "OK";
	case 400: return "Bad Request";
	case 404: return "Not Found";
	case 405: return "Method Not Allowed";
	case 503: return "Service Unavailable";
	default: return "Status";
	}
}

/* Turns c to ANSWER with this answer; the X-Dynsnap-State header is the state at this moment. */
static void answer(struct conn *c, const struct ep *ep, int code, const char *ctype, const char *body)
{
	int n = snprintf(c->out, sizeof(c->out),
			 "HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
			 "X-Dynsnap-State: %s\r\nConnection: close\r\n\r\n%s",
			 code, reason(code), ctype, strlen(body), ep_state_names[ep->state], c->head ? "" : body);
	upstream_close(&c->up);
	c->len = n < 0 ? 0 : (size_t)n >= sizeof(c->out) ? sizeof(c->out) - 1 : (size_t)n;
	c->off = 0;
	c->phase = ANSWER;
	c->deadline = mono_ms() + ANSWER_TIMEOUT_MS;
}

static void answer_unreachable(struct conn *c, const struct ep *ep, const char *err)
{
	char body[256];
	snprintf(body, sizeof(body),
		 "{\"status\":\"unreachable\",\"state\":\"active\",\"error\":\"worker %s: %s\","
		 "\"source\":\"dynsnap-entrypoint\"}\n", c->path, err);
	answer(c, ep, 503, "application/json", body);
}

/* Starts asking the worker, with its deadline. */
static void worker_start(struct conn *c, const struct ep *ep)
{
	const char *err;

	c->deadline = mono_ms() + WORKER_TIMEOUT_MS;
	c->phase = WORKER;
	if (upstream_start(&c->up, ep->system_port, c->path, &err) != 0)
		answer_unreachable(c, ep, err);
}

/* One step of asking the worker; its answer passed on once it is in. */
static void worker_step(struct conn *c, const struct ep *ep)
{
	char ctype[128];
	const char *err, *body;
	int r = upstream_io(&c->up, &err);

	if (r == 0)
		return;
	if (r > 0 && (r = upstream_answer(&c->up, ctype, sizeof(ctype), &body, &err)) >= 0)
		answer(c, ep, r, ctype[0] ? ctype : "text/plain", body);
	else
		answer_unreachable(c, ep, err);
}

/* The client's whole request is in: answer it, or ask the worker. */
static void request_done(struct conn *c, const struct ep *ep)
{
	char method[16], target[256];

	if (sscanf(c->req, "%15s %255s", method, target) != 2) {
		answer(c, ep, 400, "text/plain", "bad request\n");
		return;
	}
	c->head = strcmp(method, "HEAD") == 0;
	if (!c->head && strcmp(method, "GET") != 0) {
		answer(c, ep, 405, "text/plain", "only GET and HEAD\n");
		return;
	}
	target[strcspn(target, "?#")] = '\0';
	if (strcmp(target, "/live") == 0)
		c->path = "/live";
	else if (strcmp(target, "/health") == 0)
		c->path = "/health";
	else {
		answer(c, ep, 404, "text/plain", "dynsnap-entrypoint serves /live and /health\n");
		return;
	}
	if (ep->state != ST_ACTIVE) {
		/* Asleep routable, the pod stays Ready: its worker's own health check would wait in a CUDA
		 * call (the process is checkpointed), so the entrypoint answers for it. */
		bool live = c->path[1] == 'l', ready = live || ep->state == ST_ROUTABLE;
		char body[256];
		snprintf(body, sizeof(body), "{\"status\":\"%s\",\"state\":\"%s\",\"source\":\"dynsnap-entrypoint\"}\n",
			 live ? "live" : ready ? "ready" : "notready", ep_state_names[ep->state]);
		answer(c, ep, ready ? 200 : 503, "application/json", body);
		return;
	}
	worker_start(c, ep);
}

static void read_request(struct conn *c, const struct ep *ep)
{
	for (;;) {
		ssize_t n = recv(c->fd, c->req + c->len, sizeof(c->req) - 1 - c->len, 0);
		if (n > 0) {
			c->len += (size_t)n;
			c->req[c->len] = '\0';
			if (strstr(c->req, "\r\n\r\n") || strstr(c->req, "\n\n") || c->len == sizeof(c->req) - 1)
				break;
		} else if (n == 0) {
			break; /* the client is done sending: answer what came */
		} else if (errno == EINTR) {
			continue;
		} else if (errno == EAGAIN) {
			return; /* the rest later, before the deadline */
		} else {
			conn_close(c);
			return;
		}
	}
	if (!c->len) {
		conn_close(c);
		return;
	}
	request_done(c, ep);
}

static void write_answer(struct conn *c)
{
	while (c->off < c->len) {
		ssize_t n = send(c->fd, c->out + c->off, c->len - c->off, MSG_NOSIGNAL);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return;
		if (n <= 0)
			break;
		c->off += (size_t)n;
	}
	conn_close(c);
}

/* A phase past its deadline. */
static void expire(struct conn *c, const struct ep *ep, long long now)
{
	if (c->phase == FREE || now < c->deadline)
		return;
	switch (c->phase) {
	case REQUEST: /* never came whole: not from a prober that is still waiting */
	case ANSWER:  /* nobody reads it */
		conn_close(c);
		break;
	default: /* the worker did not answer in time: say so */
		answer_unreachable(c, ep, c->up.phase == UP_CONNECT ? "connect timed out" : "no answer in time");
	}
}

/* A slot for a new connection: a free one, else the oldest still waiting for its request (it is
 * closed); -1 when every slot is busy with a whole request (each ends by its deadline). */
static int take_slot(bool evict)
{
	int oldest = -1;

	for (int i = 0; i < PROBE_MAX_CONNS; i++) {
		if (ps.c[i].phase == FREE)
			return i;
		if (ps.c[i].phase == REQUEST && (oldest < 0 || ps.c[i].order < ps.c[oldest].order))
			oldest = i;
	}
	if (oldest >= 0 && evict)
		conn_close(&ps.c[oldest]);
	return oldest;
}

/* The peer's address as 16 bytes (an IPv4 one as IPv4-mapped IPv6, as a dual-stack socket gives it). */
static void peer_key(const struct sockaddr_storage *sa, unsigned char key[16])
{
	memset(key, 0, 16);
	if (sa->ss_family == AF_INET6) {
		memcpy(key, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
	} else if (sa->ss_family == AF_INET) {
		key[10] = key[11] = 0xff;
		memcpy(key + 12, &((const struct sockaddr_in *)sa)->sin_addr, 4);
	}
}

/* How many slots the peer holds; its oldest still waiting for its request in *oldest (-1: none). */
static int peer_slots(const unsigned char key[16], int *oldest)
{
	int n = 0;

	*oldest = -1;
	for (int i = 0; i < PROBE_MAX_CONNS; i++) {
		struct conn *c = &ps.c[i];
		if (c->phase == FREE || memcmp(c->peer, key, 16) != 0)
			continue;
		n++;
		if (c->phase == REQUEST && (*oldest < 0 || c->order < ps.c[*oldest].order))
			*oldest = i;
	}
	return n;
}

/* A slot for a connection from the peer `key`: within its share, a free slot or the oldest waiting
 * request of anyone (take_slot); past it, only the peer's own oldest waiting request; -1: none. */
static int slot_for(const unsigned char key[16])
{
	int own;

	if (peer_slots(key, &own) < PROBE_PEER_SHARE)
		return take_slot(true);
	if (own >= 0)
		conn_close(&ps.c[own]);
	return own;
}

static void accept_some(void)
{
	/* Every slot busy with a whole request (each ends by its deadline): the rest waits in the backlog. */
	for (int i = 0; i < ACCEPT_BURST && take_slot(false) >= 0; i++) {
		struct sockaddr_storage sa;
		socklen_t len = sizeof(sa);
		unsigned char key[16];
		struct conn *c;
		int fd = accept4(lfd, (struct sockaddr *)&sa, &len, SOCK_NONBLOCK | SOCK_CLOEXEC), at;

		if (fd < 0)
			return;
		peer_key(&sa, key);
		at = slot_for(key);
		if (at < 0) { /* over its share, every one of them a whole request: not held */
			close(fd);
			continue;
		}
		c = &ps.c[at];
		c->phase = REQUEST;
		c->fd = fd;
		c->up.fd = -1;
		c->order = ++ps.accepted;
		memcpy(c->peer, key, 16);
		c->deadline = mono_ms() + REQUEST_TIMEOUT_MS;
		c->head = false;
		c->len = c->off = 0;
		c->req[0] = '\0';
	}
}

int probe_fds(struct pollfd *pf, int max)
{
	int n = 0;

	if (lfd >= 0 && n < max && take_slot(false) >= 0) /* full of whole requests: let them wait */
		pf[n++] = (struct pollfd){ .fd = lfd, .events = POLLIN };
	for (int i = 0; i < PROBE_MAX_CONNS && n < max; i++) {
		struct conn *c = &ps.c[i];
		switch (c->phase) {
		case FREE: break;
		case REQUEST: pf[n++] = (struct pollfd){ .fd = c->fd, .events = POLLIN }; break;
		case WORKER: pf[n++] = (struct pollfd){ .fd = c->up.fd, .events = upstream_events(&c->up) }; break;
		case ANSWER: pf[n++] = (struct pollfd){ .fd = c->fd, .events = POLLOUT }; break;
		}
	}
	return n;
}

int probe_timeout(int tick_ms)
{
	long long now = mono_ms(), t = tick_ms;

	for (int i = 0; i < PROBE_MAX_CONNS; i++)
		if (ps.c[i].phase != FREE && ps.c[i].deadline - now < t)
			t = ps.c[i].deadline - now;
	return t < 0 ? 0 : (int)t;
}

/* Moves c on as far as its sockets let it, without waiting. */
static void conn_step(struct conn *c, const struct ep *ep)
{
	if (c->phase == REQUEST)
		read_request(c, ep);
	if (c->phase == WORKER)
		worker_step(c, ep);
	if (c->phase == ANSWER)
		write_answer(c);
}

/* Every connection moved on, deadlines applied, then new ones taken (at the bound, the oldest
 * that has still not sent a whole request after this turn's reads makes room) and started on:
 * a prober's request is usually in already. */
void probe_step(const struct ep *ep)
{
	long long now;

	for (int i = 0; i < PROBE_MAX_CONNS; i++)
		conn_step(&ps.c[i], ep);
	now = mono_ms();
	for (int i = 0; i < PROBE_MAX_CONNS; i++)
		expire(&ps.c[i], ep, now);
	accept_some();
	for (int i = 0; i < PROBE_MAX_CONNS; i++)
		if (ps.c[i].phase == REQUEST && ps.c[i].len == 0)
			conn_step(&ps.c[i], ep);
}
