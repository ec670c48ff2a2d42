/*
 * The pod's probe endpoints. /live: 200 while the entrypoint lives, except
 * that while the worker is active it answers what the worker's /live answers.
 * /health: the worker's /health while active, 503 in every other state.
 * One connection at a time; every wait is bounded so that a stuck client or
 * worker delays the main loop by at most about a second.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "entrypoint.h"

/* Under kubelet's default probe timeout (1 s), so a slow worker is reported
 * as failing by us rather than as a probe timeout. */
#define WORKER_TIMEOUT_MS 800
#define CLIENT_TIMEOUT_MS 1000

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
		if (bind(fd, (struct sockaddr *)&a6, sizeof(a6)) == 0 && listen(fd, 16) == 0)
			return fd;
		close(fd);
	}
	fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&a4, sizeof(a4)) != 0 || listen(fd, 16) != 0) {
		int e = errno;
		close(fd);
		errno = e;
		return -1;
	}
	return fd;
}

static int wait_fd(int fd, short ev, long long deadline)
{
	struct pollfd p = { .fd = fd, .events = ev };
	long long left = deadline - mono_ms();
	if (left <= 0)
		return 0;
	return poll(&p, 1, (int)left) > 0;
}

static int send_all(int fd, const char *buf, size_t len, long long deadline)
{
	while (len > 0) {
		ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
		if (n > 0) {
			buf += n;
			len -= (size_t)n;
		} else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
			if (!wait_fd(fd, POLLOUT, deadline))
				return -1;
		} else {
			return -1;
		}
	}
	return 0;
}

/*
 * GET http://127.0.0.1:port/path with a total deadline. Returns the HTTP status
 * and copies the body (truncated) and content type; -1 with err set when the
 * worker could not be asked or did not answer in time.
 */
static int worker_get(int port, const char *path, char *body, size_t bodysz, char *ctype,
		      size_t ctypesz, const char **err)
{
	long long deadline = mono_ms() + WORKER_TIMEOUT_MS;
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	char req[256], resp[16384], *hend, *p;
	size_t got = 0;
	long clen = -1;
	int fd, status = -1, soerr = 0;
	socklen_t sl = sizeof(soerr);

	body[0] = '\0';
	ctype[0] = '\0';
	fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		*err = "socket failed";
		return -1;
	}
	if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
		if (errno != EINPROGRESS) {
			*err = errno == ECONNREFUSED ? "connection refused" : "connect failed";
			goto out;
		}
		if (!wait_fd(fd, POLLOUT, deadline)) {
			*err = "connect timed out";
			goto out;
		}
		getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
		if (soerr) {
			*err = soerr == ECONNREFUSED ? "connection refused" : "connect failed";
			goto out;
		}
	}
	snprintf(req, sizeof(req),
		 "GET %s HTTP/1.0\r\nHost: 127.0.0.1:%d\r\nUser-Agent: dynsnap-entrypoint\r\n\r\n", path,
		 port);
	if (send_all(fd, req, strlen(req), deadline) != 0) {
		*err = "send failed";
		goto out;
	}
	for (;;) {
		ssize_t n = recv(fd, resp + got, sizeof(resp) - 1 - got, 0);
		if (n > 0) {
			got += (size_t)n;
			resp[got] = '\0';
			hend = strstr(resp, "\r\n\r\n");
			if (hend && clen < 0 && (p = strcasestr(resp, "\r\ncontent-length:")) && p < hend)
				clen = strtol(p + 17, NULL, 10);
			if (got == sizeof(resp) - 1 || (hend && clen >= 0 && got >= (size_t)(hend + 4 - resp) + (size_t)clen))
				break;
		} else if (n == 0) {
			break;
		} else if (errno == EAGAIN || errno == EINTR) {
			if (!wait_fd(fd, POLLIN, deadline)) {
				*err = "no answer in time";
				goto out;
			}
		} else {
			*err = "receive failed";
			goto out;
		}
	}
	resp[got] = '\0';
	if (sscanf(resp, "HTTP/%*d.%*d %d", &status) != 1) {
		*err = "not an HTTP response";
		status = -1;
		goto out;
	}
	hend = strstr(resp, "\r\n\r\n");
	if (hend) {
		*hend = '\0';
		if ((p = strcasestr(resp, "\r\ncontent-type:"))) {
			p += 15;
			while (*p == ' ')
				p++;
			snprintf(ctype, ctypesz, "%.*s", (int)strcspn(p, "\r\n"), p);
		}
		snprintf(body, bodysz, "%s", hend + 4);
	}
out:
	close(fd);
	return status;
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

static void respond(int fd, int code, const char *ctype, const char *body, bool head,
		    const struct ep *ep, long long deadline)
{
	char hdr[512];
	int n = snprintf(hdr, sizeof(hdr),
			 "HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
			 "X-Dynsnap-State: %s\r\nConnection: close\r\n\r\n",
			 code, reason(code), ctype, strlen(body), ep_state_names[ep->state]);
	if (send_all(fd, hdr, (size_t)n, deadline) == 0 && !head)
		send_all(fd, body, strlen(body), deadline);
}

static void serve_conn(int fd, const struct ep *ep)
{
	long long deadline = mono_ms() + CLIENT_TIMEOUT_MS;
	char req[2048], method[16], target[256], body[4096], ctype[128];
	const char *path, *err = "";
	size_t got = 0;
	bool head;
	int code;

	for (;;) {
		ssize_t n = recv(fd, req + got, sizeof(req) - 1 - got, 0);
		if (n > 0) {
			got += (size_t)n;
			req[got] = '\0';
			if (strstr(req, "\r\n\r\n") || strstr(req, "\n\n") || got == sizeof(req) - 1)
				break;
		} else if (n == 0) {
			break;
		} else if (errno == EAGAIN || errno == EINTR) {
			if (!wait_fd(fd, POLLIN, deadline))
				return;
		} else {
			return;
		}
	}
	req[got] = '\0';
	if (sscanf(req, "%15s %255s", method, target) != 2) {
		respond(fd, 400, "text/plain", "bad request\n", false, ep, deadline);
		return;
	}
	head = strcmp(method, "HEAD") == 0;
	if (!head && strcmp(method, "GET") != 0) {
		respond(fd, 405, "text/plain", "only GET and HEAD\n", false, ep, deadline);
		return;
	}
	target[strcspn(target, "?#")] = '\0';
	if (strcmp(target, "/live") == 0)
		path = "/live";
	else if (strcmp(target, "/health") == 0)
		path = "/health";
	else {
		respond(fd, 404, "text/plain", "dynsnap-entrypoint serves /live and /health\n", head, ep,
			deadline);
		return;
	}

	if (ep->state != ST_ACTIVE) {
		bool live = path[1] == 'l';
		snprintf(body, sizeof(body), "{\"status\":\"%s\",\"state\":\"%s\",\"source\":\"dynsnap-entrypoint\"}\n",
			 live ? "live" : "notready", ep_state_names[ep->state]);
		respond(fd, live ? 200 : 503, "application/json", body, head, ep, deadline);
		return;
	}
	code = worker_get(ep->system_port, path, body, sizeof(body), ctype, sizeof(ctype), &err);
	if (code < 0) {
		snprintf(body, sizeof(body),
			 "{\"status\":\"unreachable\",\"state\":\"active\",\"error\":\"worker %s: %s\","
			 "\"source\":\"dynsnap-entrypoint\"}\n", path, err);
		respond(fd, 503, "application/json", body, head, ep, deadline);
		return;
	}
	respond(fd, code, ctype[0] ? ctype : "text/plain", body, head, ep, deadline);
}

void probe_serve(int lfd, const struct ep *ep)
{
	/* Bounded: serve what is queued now, then go back to the main loop. */
	for (int i = 0; i < 8; i++) {
		int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0)
			return;
		serve_conn(fd, ep);
		close(fd);
	}
}
