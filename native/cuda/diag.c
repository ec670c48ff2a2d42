/* dynsnap-cuda's stderr: the one-line diagnostics, prefixed with the name it was called by (CRIU's
 * CUDA plugin calls it cuda-checkpoint), and the DYNSNAP_CUDA_TIMING stage lines. Calls none of
 * the other files. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dynsnap-cuda.h"

const char *prog = "dynsnap-cuda";

void diag(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "%s: ", prog);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

/* DYNSNAP_CUDA_TIMING=1: one stderr line per stage of an action, with the
 * milliseconds since the start ("timing +12.3 ms driver loaded"), to find
 * where a call spends what its driver calls do not (docs/BENCHMARKS.md). */
void mark(const char *what)
{
	static int on = -1;
	static struct timespec t0;
	struct timespec t;

	if (on < 0) {
		const char *e = getenv("DYNSNAP_CUDA_TIMING");

		on = e && *e && strcmp(e, "0") != 0;
		clock_gettime(CLOCK_MONOTONIC, &t0);
	}
	if (!on)
		return;
	clock_gettime(CLOCK_MONOTONIC, &t);
	fprintf(stderr, "timing +%.1f ms %s\n",
		(double)(t.tv_sec - t0.tv_sec) * 1e3 + (double)(t.tv_nsec - t0.tv_nsec) / 1e6, what);
}
