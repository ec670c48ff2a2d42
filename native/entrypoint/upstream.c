/*
 * Asking the worker, for the probe server (probe.c): GET http://127.0.0.1:system_port/path
 * (HTTP/1.0), on a non-blocking socket, one step whenever the socket is ready; never waits. The
 * deadline is the caller's. Calls only common.c.
 */
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "entrypoint.h"

void upstream_close(struct upstream *u)
{
	if (u->fd >= 0)
		close(u->fd);
	u->fd = -1;
}

int upstream_start(struct upstream *u, int port, const char *path, const char **err)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };

	u->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (u->fd < 0) {
		*err = "socket failed";
		return -1;
	}
	u->len = (size_t)snprintf(u->buf, sizeof(u->buf),
				  "GET %s HTTP/1.0\r\nHost: 127.0.0.1:%d\r\nUser-Agent: dynsnap-entrypoint\r\n\r\n",
				  path, port);
	u->off = 0;
	u->phase = UP_SEND;
	if (connect(u->fd, (struct sockaddr *)&a, sizeof(a)) == 0)
		return 0;
	if (errno == EINPROGRESS) {
		u->phase = UP_CONNECT;
		return 0;
	}
	*err = errno == ECONNREFUSED ? "connection refused" : "connect failed";
	upstream_close(u);
	return -1;
}

short upstream_events(const struct upstream *u)
{
	return u->phase == UP_RECV ? POLLIN : POLLOUT;
}

/* Whether the answer is complete: headers and Content-Length bytes of body. */
static bool complete(const struct upstream *u)
{
	const char *hend = strstr(u->buf, "\r\n\r\n"), *p;
	long clen;

	if (!hend || !(p = strcasestr(u->buf, "\r\ncontent-length:")) || p > hend)
		return false;
	clen = strtol(p + 17, NULL, 10);
	return clen >= 0 && u->len >= (size_t)(hend + 4 - u->buf) + (size_t)clen;
}

int upstream_io(struct upstream *u, const char **err)
{
	int soerr = 0;
	socklen_t sl = sizeof(soerr);
	ssize_t n;

	if (u->phase == UP_CONNECT) {
		struct pollfd p = { .fd = u->fd, .events = POLLOUT };
		if (poll(&p, 1, 0) <= 0)
			return 0; /* still connecting */
		getsockopt(u->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
		if (soerr) {
			*err = soerr == ECONNREFUSED ? "connection refused" : "connect failed";
			return -1;
		}
		u->phase = UP_SEND;
	}
	while (u->phase == UP_SEND) {
		n = send(u->fd, u->buf + u->off, u->len - u->off, MSG_NOSIGNAL);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return 0;
		if (n <= 0) {
			*err = "send failed";
			return -1;
		}
		u->off += (size_t)n;
		if (u->off == u->len) {
			u->phase = UP_RECV;
			u->len = 0;
			u->buf[0] = '\0';
		}
	}
	for (;;) {
		n = recv(u->fd, u->buf + u->len, sizeof(u->buf) - 1 - u->len, 0);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return 0;
		if (n < 0) {
			*err = "receive failed";
			return -1;
		}
		u->len += (size_t)n;
		u->buf[u->len] = '\0';
		if (n == 0 || u->len == sizeof(u->buf) - 1 || complete(u))
			return 1;
	}
}

int upstream_answer(struct upstream *u, char *ctype, size_t ctypesz, const char **body, const char **err)
{
	char *hend, *p;
	int status = -1;

	ctype[0] = '\0';
	*body = "";
	if (sscanf(u->buf, "HTTP/%*d.%*d %d", &status) != 1) {
		*err = "not an HTTP response";
		return -1;
	}
	hend = strstr(u->buf, "\r\n\r\n");
	if (!hend)
		return status;
	*hend = '\0';
	if ((p = strcasestr(u->buf, "\r\ncontent-type:"))) {
		p += 15;
		while (*p == ' ')
			p++;
		snprintf(ctype, ctypesz, "%.*s", (int)strcspn(p, "\r\n"), p);
	}
	hend[4 + strnlen(hend + 4, UPSTREAM_BODY_MAX)] = '\0';
	*body = hend + 4;
	return status;
}
