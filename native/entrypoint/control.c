/*
 * The control directory: entrypoint.json (written here, temp file + rename)
 * and state-request (written by the agent, temp file + rename, read here).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "entrypoint.h"

/* Appends s to buf as a JSON string literal. */
static void json_str(char *buf, size_t sz, const char *s)
{
	size_t n = strlen(buf);
	if (n + 2 >= sz)
		return;
	buf[n++] = '"';
	for (; *s && n + 8 < sz; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\') {
			buf[n++] = '\\';
			buf[n++] = (char)c;
		} else if (c < 0x20) {
			n += (size_t)snprintf(buf + n, sz - n, "\\u%04x", c);
		} else {
			buf[n++] = (char)c;
		}
	}
	buf[n++] = '"';
	buf[n] = '\0';
}

static void json_add(char *buf, size_t sz, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#include <stdarg.h>
static void json_add(char *buf, size_t sz, const char *fmt, ...)
{
	size_t n = strlen(buf);
	va_list ap;
	if (n >= sz)
		return;
	va_start(ap, fmt);
	vsnprintf(buf + n, sz - n, fmt, ap);
	va_end(ap);
}

int control_write(const struct ep *ep)
{
	char buf[8192] = "";
	char path[PATH_MAX + 32], tmp[PATH_MAX + 32];
	long long upd = now_ms();
	size_t len;
	int fd;

	json_add(buf, sizeof(buf), "{\"format\":%d,\"pid\":%d,", DYNSNAP_CONTROL_FORMAT, (int)getpid());
	json_add(buf, sizeof(buf), "\"worker_pid\":%d,\"worker_pgid\":%d,\"worker_sid\":%d,",
		 (int)ep->worker_pid, (int)ep->worker_pid, (int)ep->worker_pid);
	json_add(buf, sizeof(buf), "\"worker_alive\":%s,", ep->worker_alive ? "true" : "false");
	if (ep->worker_status >= 0)
		json_add(buf, sizeof(buf), "\"worker_status\":%d,", ep->worker_status);
	else
		json_add(buf, sizeof(buf), "\"worker_status\":null,");
	json_add(buf, sizeof(buf), "\"system_port\":%d,\"probe_port\":%d,\"state\":",
		 ep->system_port, ep->probe_port);
	json_str(buf, sizeof(buf), ep_state_names[ep->state]);
	json_add(buf, sizeof(buf), ",\"request_seq\":%lld,\"request_error\":", ep->request_seq);
	if (ep->request_error[0])
		json_str(buf, sizeof(buf), ep->request_error);
	else
		json_add(buf, sizeof(buf), "null");
	json_add(buf, sizeof(buf), ",\"request_wakeup\":");
	json_str(buf, sizeof(buf), ep->request_wakeup ? ep->request_wakeup : "tick");
	json_add(buf, sizeof(buf), ",\"request_noticed\":");
	if (ep->request_noticed)
		json_str(buf, sizeof(buf), ep->request_noticed);
	else
		json_add(buf, sizeof(buf), "null");
	json_add(buf, sizeof(buf), ",\"pid_floor\":%d,\"pid_reserved\":%s,\"seccomp\":",
		 DYNSNAP_PID_FLOOR, ep->pid_reserved ? "true" : "false");
	json_str(buf, sizeof(buf), ep->seccomp_status);
	json_add(buf, sizeof(buf), ",\"log_file\":");
	json_str(buf, sizeof(buf), ep->log_path);
	json_add(buf, sizeof(buf), ",\"thp_preload\":");
	if (ep->thp_preload[0])
		json_str(buf, sizeof(buf), ep->thp_preload);
	else
		json_add(buf, sizeof(buf), "null");
	json_add(buf, sizeof(buf), ",\"started\":%lld.%03lld,\"updated\":%lld.%03lld}\n",
		 ep->started_ms / 1000, ep->started_ms % 1000, upd / 1000, upd % 1000);

	snprintf(path, sizeof(path), "%s/%s", ep->control_dir, DYNSNAP_CONTROL_FILE);
	snprintf(tmp, sizeof(tmp), "%s/.%s.tmp", ep->control_dir, DYNSNAP_CONTROL_FILE);
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		goto fail;
	len = strlen(buf);
	if (write(fd, buf, len) != (ssize_t)len) {
		close(fd);
		goto fail;
	}
	if (close(fd) != 0 || rename(tmp, path) != 0)
		goto fail;
	return 0;
fail:
	ep_log("cannot write %s: %s", path, strerror(errno));
	return -1;
}

int control_read_request(const struct ep *ep, long long *seq, char *state, size_t statesz,
			 char *err, size_t errsz)
{
	static struct stat seen;
	static bool seen_valid;
	char path[PATH_MAX + 32], line[256], word[64], *end;
	struct stat st;
	ssize_t n;
	long long s;
	int fd;

	snprintf(path, sizeof(path), "%s/%s", ep->control_dir, DYNSNAP_REQUEST_FILE);
	if (stat(path, &st) != 0)
		return 0;
	if (seen_valid && st.st_ino == seen.st_ino && st.st_size == seen.st_size &&
	    st.st_mtim.tv_sec == seen.st_mtim.tv_sec && st.st_mtim.tv_nsec == seen.st_mtim.tv_nsec)
		return 0;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	n = read(fd, line, sizeof(line) - 1);
	close(fd);
	if (n <= 0 || line[n - 1] != '\n')
		return 0; /* not complete yet (the agent should rename into place); look again */
	line[n] = '\0';
	seen = st;
	seen_valid = true;

	errno = 0;
	s = strtoll(line, &end, 10);
	if (errno || end == line || s <= 0 || sscanf(end, " %63s", word) != 1) {
		snprintf(err, errsz, "malformed request (want \"SEQ STATE\\n\")");
		*seq = 0;
		return -1;
	}
	if (s <= ep->request_seq)
		return 0; /* already handled */
	*seq = s;
	if (ep_state_parse(word) < 0) {
		snprintf(err, errsz, "unknown state \"%.40s\"", word);
		return -1;
	}
	snprintf(state, statesz, "%s", word);
	return 1;
}
