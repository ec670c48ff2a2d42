/* gpumap: parsing of the --gpu-map / --device-map argument of dynsnap-cuda.
 *
 * Kept apart from the driver code so the rules (spellings, index resolution,
 * coverage, duplicates) read in one place. Parsing never touches a process:
 * it runs before any state change, so a typo cannot leave a process locked or
 * half-restored. */
#ifndef DYNSNAP_GPUMAP_H
#define DYNSNAP_GPUMAP_H

#include <stddef.h>

#define GPU_UUID_LEN 16
#define GPUMAP_MAX 64

struct gpu_uuid {
	unsigned char b[GPU_UUID_LEN];
};

struct gpu_pair {
	struct gpu_uuid old_uuid; /* GPU the process was checkpointed on */
	struct gpu_uuid new_uuid; /* GPU to restore it onto */
};

/* Parses "OLD=NEW,OLD=NEW,..." where each side is a device index (resolved
 * against visible[], the UUIDs this process sees, in index order) or a UUID
 * with or without "GPU-" and dashes, any case. The map must name every
 * visible GPU exactly once as a target, and no source twice; an empty item
 * ("0=1,,1=0", a leading or trailing comma) is refused, not skipped.
 * Returns the number of pairs, or -1 with a one-line reason in err. */
int gpumap_parse(const char *spec, const struct gpu_uuid *visible, int nvisible,
		 struct gpu_pair *out, int max, char *err, size_t errlen);

/* Formats a UUID as nvidia-smi prints it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx */
void gpu_uuid_format(const struct gpu_uuid *u, char *buf, size_t len);

/* Parses one UUID spelling; 0 on success. */
int gpu_uuid_parse(const char *s, struct gpu_uuid *out);

#endif
