/*
 * What the entrypoint's other files share: the state names, the log line on stderr and the two
 * clocks. It calls none of them, so every file may call it without a cycle (docs/ENTRYPOINT.md,
 * "Source layout").
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "entrypoint.h"

const char *const ep_state_names[ST_COUNT] = {
	[ST_ACTIVE] = DYNSNAP_STATE_ACTIVE,
	[ST_SUSPENDING] = DYNSNAP_STATE_SUSPENDING,
	[ST_SUSPENDED] = DYNSNAP_STATE_SUSPENDED,
	[ST_SNAPSHOTTED] = DYNSNAP_STATE_SNAPSHOTTED,
	[ST_RESTORING] = DYNSNAP_STATE_RESTORING,
	[ST_ROUTABLE] = DYNSNAP_STATE_ROUTABLE,
};

int ep_state_parse(const char *s)
{
	for (int i = 0; i < ST_COUNT; i++)
		if (strcmp(s, ep_state_names[i]) == 0)
			return i;
	return -1;
}

void ep_log(const char *fmt, ...)
{
	char buf[1024];
	va_list ap;
	int n = snprintf(buf, sizeof(buf), "dynsnap-entrypoint: ");
	va_start(ap, fmt);
	vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
	va_end(ap);
	fprintf(stderr, "%s\n", buf);
}

long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

long long mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
