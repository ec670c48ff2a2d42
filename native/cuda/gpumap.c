/* gpumap: see gpumap.h. */
#include "gpumap.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int hexval(int c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	c = tolower(c);
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

int gpu_uuid_parse(const char *s, struct gpu_uuid *out)
{
	int n = 0;

	if (strncasecmp(s, "GPU-", 4) == 0)
		s += 4;
	for (; *s; s++) {
		int v;

		/* nvidia-smi prints dashes, the device plugin and the driver's
		 * raw bytes do not: both spellings name the same GPU. */
		if (*s == '-')
			continue;
		v = hexval((unsigned char)*s);
		if (v < 0 || n >= 2 * GPU_UUID_LEN)
			return -1;
		if (n % 2 == 0)
			out->b[n / 2] = (unsigned char)(v << 4);
		else
			out->b[n / 2] |= (unsigned char)v;
		n++;
	}
	return n == 2 * GPU_UUID_LEN ? 0 : -1;
}

void gpu_uuid_format(const struct gpu_uuid *u, char *buf, size_t len)
{
	const unsigned char *b = u->b;

	snprintf(buf, len,
		 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
		 b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
		 b[12], b[13], b[14], b[15]);
}

/* An index is a short decimal number; a UUID is 32 hex digits, so a short
 * all-digit word can only be an index. */
static int is_index(const char *s)
{
	size_t n = strlen(s);

	if (n == 0 || n > 4)
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!isdigit((unsigned char)s[i]))
			return 0;
	return 1;
}

static int resolve_side(const char *side, const struct gpu_uuid *visible, int nvisible,
			struct gpu_uuid *out, char *err, size_t errlen)
{
	if (is_index(side)) {
		int idx = atoi(side);

		/* Resolved here, while parsing: an index only means something
		 * relative to this process's enumeration, which is exactly what a
		 * migration changes. */
		if (idx >= nvisible) {
			snprintf(err, errlen, "GPU index %d does not exist (%d visible)", idx,
				 nvisible);
			return -1;
		}
		*out = visible[idx];
		return 0;
	}
	if (gpu_uuid_parse(side, out) != 0) {
		snprintf(err, errlen, "'%s' is neither a GPU index nor a GPU UUID", side);
		return -1;
	}
	return 0;
}

static int is_visible(const struct gpu_uuid *u, const struct gpu_uuid *visible, int nvisible)
{
	for (int i = 0; i < nvisible; i++)
		if (memcmp(u->b, visible[i].b, GPU_UUID_LEN) == 0)
			return 1;
	return 0;
}

int gpumap_parse(const char *spec, const struct gpu_uuid *visible, int nvisible,
		 struct gpu_pair *out, int max, char *err, size_t errlen)
{
	char *copy = strdup(spec), *next, *item;
	int n = 0, pos = 0, blank = 1;

	if (!copy) {
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	for (const char *p = spec; *p; p++)
		if (!isspace((unsigned char)*p))
			blank = 0;
	/* Items are split by hand, not with strtok: strtok folds ",," and a
	 * leading or trailing comma away, so "0=1,,1=0" would pass for a whole
	 * map although a pair was evidently lost on its way here (the way
	 * --pid refuses an empty item). A blank map has no items at all and is
	 * refused by the coverage check below. */
	for (next = blank ? NULL : copy; next;) {
		char *eq, *old_s, *new_s;
		char uuid[64];

		item = next;
		next = strchr(item, ',');
		if (next)
			*next++ = '\0';
		pos++;
		old_s = item;
		while (isspace((unsigned char)*old_s))
			old_s++;
		if (!*old_s) {
			snprintf(err, errlen, "item %d of the map is empty (a stray comma?)", pos);
			goto fail;
		}
		eq = strchr(item, '=');
		if (!eq || strchr(eq + 1, '=')) {
			snprintf(err, errlen, "pair '%s' is not OLD=NEW", item);
			goto fail;
		}
		*eq = '\0';
		new_s = eq + 1;
		for (char *p = eq - 1; p >= old_s && isspace((unsigned char)*p); p--)
			*p = '\0';
		while (isspace((unsigned char)*new_s))
			new_s++;
		for (char *p = new_s + strlen(new_s); p > new_s && isspace((unsigned char)p[-1]);)
			*--p = '\0';
		if (n >= max) {
			snprintf(err, errlen, "more than %d pairs", max);
			goto fail;
		}
		if (resolve_side(old_s, visible, nvisible, &out[n].old_uuid, err, errlen) ||
		    resolve_side(new_s, visible, nvisible, &out[n].new_uuid, err, errlen))
			goto fail;
		if (!is_visible(&out[n].new_uuid, visible, nvisible)) {
			gpu_uuid_format(&out[n].new_uuid, uuid, sizeof(uuid));
			snprintf(err, errlen, "target %s is not a visible GPU", uuid);
			goto fail;
		}
		for (int i = 0; i < n; i++) {
			if (!memcmp(out[i].old_uuid.b, out[n].old_uuid.b, GPU_UUID_LEN)) {
				gpu_uuid_format(&out[n].old_uuid, uuid, sizeof(uuid));
				snprintf(err, errlen, "source %s is mapped twice", uuid);
				goto fail;
			}
			if (!memcmp(out[i].new_uuid.b, out[n].new_uuid.b, GPU_UUID_LEN)) {
				gpu_uuid_format(&out[n].new_uuid, uuid, sizeof(uuid));
				snprintf(err, errlen, "target %s is used twice", uuid);
				goto fail;
			}
		}
		n++;
	}
	/* The driver wants every GPU the process sees remapped; a short map is
	 * refused here, with a reason, rather than by the driver without one. */
	if (n != nvisible) {
		snprintf(err, errlen,
			 "map has %d pair(s) but %d GPU(s) are visible: it must cover every visible GPU",
			 n, nvisible);
		goto fail;
	}
	free(copy);
	return n;
fail:
	free(copy);
	return -1;
}
