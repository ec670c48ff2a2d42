/* stub_files.h: the files the test stubs share under $DYNSNAP_STUB_DIR, for
 * stub_libcuda.c and ../stub_nvml/stub_nvml.c. Both stand in for one NVIDIA
 * driver, so they read the same fake devices and free memory, obey the same
 * control file and append to the same call log (see stub_libcuda.c for the
 * formats). Everything here is static inline: each stub is one translation
 * unit and uses what it needs. */
#ifndef DYNSNAP_STUB_FILES_H
#define DYNSNAP_STUB_FILES_H

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#define MAXD 16

struct devs {
	unsigned char uuid[MAXD][16];
	long long free_b[MAXD], total_b[MAXD];
	int n;
};

static inline const char *dir(void)
{
	const char *d = getenv("DYNSNAP_STUB_DIR");

	return d ? d : "/tmp/dynsnap-stub";
}

static inline void path(char *buf, size_t len, const char *name)
{
	snprintf(buf, len, "%s/%s", dir(), name);
}

/* Serialises read-modify-write of the state files across threads and
 * processes. */
static inline int lock_all(void)
{
	char p[4096];
	int fd;

	path(p, sizeof(p), "lock");
	fd = open(p, O_CREAT | O_RDWR, 0644);
	if (fd >= 0)
		flock(fd, LOCK_EX);
	return fd;
}

static inline void unlock_all(int fd)
{
	if (fd >= 0) {
		flock(fd, LOCK_UN);
		close(fd);
	}
}

/* Appends one formatted line to the state directory's file name. */
static inline void vlogline_to(const char *name, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
static inline void vlogline_to(const char *name, const char *fmt, va_list ap)
{
	char p[4096];
	FILE *f;

	path(p, sizeof(p), name);
	f = fopen(p, "a");
	if (!f)
		return;
	vfprintf(f, fmt, ap);
	fputc('\n', f);
	fclose(f);
}

static inline void logline_to(const char *name, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline void logline_to(const char *name, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vlogline_to(name, fmt, ap);
	va_end(ap);
}

static inline void logline(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void logline(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vlogline_to("log", fmt, ap);
	va_end(ap);
}

/* Looks up the last control line "WORD KEY V1 .. Vn" whose KEY equals key; copies its n
 * values (n <= 2) into vals. Returns 1 when such a line exists, 0 otherwise. */
static inline int control_keyed(const char *word, int key, long long *vals, int n)
{
	char p[4096], line[256];
	int found = 0;
	FILE *f;

	path(p, sizeof(p), "control");
	f = fopen(p, "r");
	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f)) {
		char w[32];
		int k;
		long long v[2];

		if (sscanf(line, "%31s %d %lld %lld", w, &k, &v[0], &v[1]) < 2 + n || strcmp(w, word) || k != key)
			continue;
		for (int i = 0; i < n; i++)
			vals[i] = v[i];
		found = 1;
	}
	fclose(f);
	return found;
}

/* Looks up a control directive for fn and pid; returns its value or -1. */
static inline long long control(const char *kind, const char *fn, int pid)
{
	char p[4096], line[512];
	long long val = -1;
	FILE *f;

	path(p, sizeof(p), "control");
	f = fopen(p, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		char k[32], name[128], who[32];
		long long v;

		if (sscanf(line, "%31s %127s %31s %lld", k, name, who, &v) != 4)
			continue;
		if (strcmp(k, kind) || strcmp(name, fn))
			continue;
		if (strcmp(who, "*") && atoi(who) != pid)
			continue;
		val = v;
	}
	fclose(f);
	return val;
}

static inline int hexv(int c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

static inline void read_devs(struct devs *d)
{
	char p[4096], line[512];
	FILE *f;

	memset(d, 0, sizeof(*d));
	path(p, sizeof(p), "devices");
	f = fopen(p, "r");
	if (!f) {
		memset(d->uuid[0], 0x11, 16);
		d->free_b[0] = d->total_b[0] = 80LL << 30;
		d->n = 1;
		return;
	}
	while (d->n < MAXD && fgets(line, sizeof(line), f)) {
		char u[128];
		long long fr, tot;
		int k = 0;

		if (sscanf(line, "%127s %lld %lld", u, &fr, &tot) != 3)
			continue;
		for (char *c = u; *c && k < 32; c++) {
			int v = hexv((unsigned char)*c);

			if (v < 0)
				continue;
			if (k % 2 == 0)
				d->uuid[d->n][k / 2] = (unsigned char)(v << 4);
			else
				d->uuid[d->n][k / 2] |= (unsigned char)v;
			k++;
		}
		d->free_b[d->n] = fr;
		d->total_b[d->n] = tot;
		d->n++;
	}
	fclose(f);
}

#endif
