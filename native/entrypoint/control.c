/*
 * The control directory: entrypoint.json (written here, temp file + rename, its text made by
 * json.c) and state-request (written by the agent, temp file + rename, read here). Calls only
 * common.c and json.c; main.c passes the state in.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "entrypoint.h"

/*
 * Why these bounds: every string the file carries may come from outside the entrypoint (the
 * command line, the environment, a path, a request file the container can write), so each is cut
 * at FIELD_MAX input bytes (on a character boundary, json.c) and, at worst, each byte becomes a
 * six-byte \u00XX escape. The fixed part (keys, numbers, the state words) is far below 1 KiB.
 * With that the whole document always fits CONTROL_MAX, so it is always written whole.
 */
#define CONTROL_STRINGS 4 /* log_file, thp_preload, worker_command, request_error */
#define CONTROL_WORDS 4   /* state, request_wakeup, request_noticed, seccomp: our own words */
_Static_assert(CONTROL_STRINGS * (6 * FIELD_MAX + 2) + CONTROL_WORDS * (6 * WORD_MAX + 2) + 1024 <= CONTROL_MAX,
	       "entrypoint.json might not fit its buffer");

/* The document, into b. */
static void control_json(struct jbuf *b, const struct ep *ep, long long upd)
{
	jb_fmt(b, "{\"format\":%d,\"pid\":%d,", DYNSNAP_CONTROL_FORMAT, (int)getpid());
	jb_fmt(b, "\"worker_pid\":%d,\"worker_pgid\":%d,", (int)ep->worker_pid, (int)ep->worker_pid);
	jb_fmt(b, "\"worker_sid\":%d,\"worker_alive\":%s,", (int)ep->worker_pid,
	       ep->worker_alive ? "true" : "false");
	if (ep->worker_status >= 0)
		jb_fmt(b, "\"worker_status\":%d,", ep->worker_status);
	else
		jb_raw(b, "\"worker_status\":null,");
	jb_fmt(b, "\"system_port\":%d,\"probe_port\":%d,\"state\":", ep->system_port, ep->probe_port);
	jb_str(b, ep_state_names[ep->state], WORD_MAX);
	jb_fmt(b, ",\"request_seq\":%lld,\"request_error\":", ep->request_seq);
	jb_str(b, ep->request_error[0] ? ep->request_error : NULL, FIELD_MAX);
	jb_raw(b, ",\"request_wakeup\":");
	jb_str(b, ep->request_wakeup ? ep->request_wakeup : "tick", WORD_MAX);
	jb_raw(b, ",\"request_noticed\":");
	jb_str(b, ep->request_noticed, WORD_MAX);
	jb_fmt(b, ",\"pid_floor\":%d,\"pid_reserved\":%s,\"seccomp\":", DYNSNAP_PID_FLOOR,
	       ep->pid_reserved ? "true" : "false");
	jb_str(b, ep->seccomp_status, WORD_MAX);
	jb_raw(b, ",\"log_file\":");
	jb_str(b, ep->log_path, FIELD_MAX);
	jb_raw(b, ",\"thp_preload\":");
	jb_str(b, ep->thp_preload[0] ? ep->thp_preload : NULL, FIELD_MAX);
	jb_raw(b, ",\"worker_command\":");
	jb_str(b, ep->worker_command, FIELD_MAX);
	jb_fmt(b, ",\"started\":%lld.%03lld,", ep->started_ms / 1000, ep->started_ms % 1000);
	jb_fmt(b, "\"updated\":%lld.%03lld}\n", upd / 1000, upd % 1000);
}

int control_write(const struct ep *ep)
{
	static char buf[CONTROL_MAX];
	char path[PATH_MAX + 32], tmp[PATH_MAX + 32];
	struct jbuf b;
	int fd;

	jb_init(&b, buf, sizeof(buf));
	control_json(&b, ep, now_ms());
	snprintf(path, sizeof(path), "%s/%s", ep->control_dir, DYNSNAP_CONTROL_FILE);
	if (b.full) { /* cannot happen (the assertion above); never write half a document */
		ep_log("cannot write %s: the document does not fit %d bytes", path, CONTROL_MAX);
		return -1;
	}
	snprintf(tmp, sizeof(tmp), "%s/.%s.tmp", ep->control_dir, DYNSNAP_CONTROL_FILE);
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		goto fail;
	if (write(fd, buf, b.len) != (ssize_t)b.len) {
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
