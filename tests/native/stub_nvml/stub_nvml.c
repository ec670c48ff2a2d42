/* stub_nvml: stands in for the NVIDIA driver's NVML (libnvidia-ml.so.1) in
 * dynsnap-cuda's tests, next to ../stub_libcuda. It is the same fake driver:
 * it reads the devices and free memory of $DYNSNAP_STUB_DIR/devices, obeys
 * $DYNSNAP_STUB_DIR/control and appends to $DYNSNAP_STUB_DIR/log, through
 * ../stub_libcuda/stub_files.h (formats in stub_libcuda.c).
 *
 * Only what dynsnap-cuda calls: nvmlInit_v2, nvmlShutdown,
 * nvmlDeviceGetHandleByUUID, nvmlDeviceGetMemoryInfo. As the real library
 * does, it answers NVML_ERROR_UNINITIALIZED before nvmlInit_v2 and after the
 * matching nvmlShutdown, and NVML_ERROR_NOT_FOUND for a UUID it does not
 * know; it finds a device by its UUID exactly as nvidia-smi prints it
 * (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, lowercase). Control lines:
 *
 *   fail nvmlInit_v2 * <code>                  that call returns <code>
 *   fail nvmlDeviceGetHandleByUUID <dev|*> <code>
 *   fail nvmlDeviceGetMemoryInfo <dev|*> <code>
 *   nvmlskew <dev> <bytes>    report that much less free memory than
 *                             cuMemGetInfo does, so a test can tell whose
 *                             number the CLI used (the real two differ too)
 *
 * The ABI is nvml.h's: nvmlReturn_t an int-sized enum (NVML_SUCCESS 0),
 * nvmlDevice_t an opaque pointer, nvmlMemory_t {total, free, used} as
 * unsigned long long. */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>

#include "stub_files.h"

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
	unsigned long long total, free, used;
} nvmlMemory_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6

struct nvmlDevice_st {
	int index;
};

static struct nvmlDevice_st handles[MAXD];
static int inits;

static void uuid_str(const unsigned char *u, char *buf, size_t len)
{
	snprintf(buf, len,
		 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
		 u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
		 u[13], u[14], u[15]);
}

static long long skew(int dev)
{
	long long v = 0;

	return control_keyed("nvmlskew", dev, &v, 1) ? v : 0;
}

nvmlReturn_t nvmlInit_v2(void)
{
	long long code = control("fail", "nvmlInit_v2", 0);
	nvmlReturn_t rc = code >= 0 ? (nvmlReturn_t)code : NVML_SUCCESS;

	if (rc == NVML_SUCCESS)
		inits++;
	logline("nvmlInit_v2 rc=%d", rc);
	return rc;
}

nvmlReturn_t nvmlShutdown(void)
{
	nvmlReturn_t rc = inits > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;

	if (inits > 0)
		inits--;
	logline("nvmlShutdown rc=%d", rc);
	return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
	struct devs d;
	nvmlReturn_t rc = NVML_ERROR_NOT_FOUND;
	long long code;
	int found = -1;

	read_devs(&d);
	for (int k = 0; uuid && k < d.n; k++) {
		char u[64];

		uuid_str(d.uuid[k], u, sizeof(u));
		if (!strcmp(u, uuid))
			found = k;
	}
	code = control("fail", "nvmlDeviceGetHandleByUUID", found);
	if (!inits) {
		rc = NVML_ERROR_UNINITIALIZED;
	} else if (!uuid || !device) {
		rc = NVML_ERROR_INVALID_ARGUMENT;
	} else if (code >= 0) {
		rc = (nvmlReturn_t)code;
	} else if (found >= 0) {
		handles[found].index = found;
		*device = &handles[found];
		rc = NVML_SUCCESS;
	}
	logline("nvmlDeviceGetHandleByUUID uuid=%s dev=%d rc=%d", uuid ? uuid : "(null)", found, rc);
	return rc;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
	struct devs d;
	nvmlReturn_t rc = NVML_SUCCESS;
	int dev = -1, fd;

	fd = lock_all();
	read_devs(&d);
	unlock_all(fd);
	if (device >= handles && device < handles + MAXD)
		dev = device->index;
	if (!inits) {
		rc = NVML_ERROR_UNINITIALIZED;
	} else if (dev < 0 || dev >= d.n || !memory) {
		rc = NVML_ERROR_INVALID_ARGUMENT;
	} else {
		long long code = control("fail", "nvmlDeviceGetMemoryInfo", dev);

		if (code >= 0) {
			rc = (nvmlReturn_t)code;
		} else {
			long long fr = d.free_b[dev] - skew(dev);

			memory->total = (unsigned long long)d.total_b[dev];
			memory->free = (unsigned long long)(fr > 0 ? fr : 0);
			memory->used = memory->total - memory->free;
		}
	}
	logline("nvmlDeviceGetMemoryInfo dev=%d rc=%d", dev, rc);
	return rc;
}
