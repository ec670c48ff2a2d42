/* dynsnap-cuda's driver: libcuda.so.1 loaded at run time (DYNSNAP_LIBCUDA overrides the path), so
 * this builds where no driver exists and its tests run against a stub; cuInit on first need; the
 * devices this process sees; the queries on one pid. Calls only diag.c. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "dynsnap-cuda.h"

struct drv drv;

void *sym(void *h, const char *a, const char *b)
{
	void *p = dlsym(h, a);

	return p || !b ? p : dlsym(h, b);
}

int load_driver(void)
{
	const char *path = getenv("DYNSNAP_LIBCUDA");
	void *h;

	if (!path || !*path)
		path = "libcuda.so.1";
	h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		diag("cannot load %s: %s", path, dlerror());
		return -1;
	}
	drv.Init = sym(h, "cuInit", NULL);
	drv.GetErrorName = sym(h, "cuGetErrorName", NULL);
	drv.DeviceGetCount = sym(h, "cuDeviceGetCount", NULL);
	drv.DeviceGet = sym(h, "cuDeviceGet", NULL);
	drv.DeviceGetUuid = sym(h, "cuDeviceGetUuid_v2", "cuDeviceGetUuid");
	drv.PrimaryCtxRetain = sym(h, "cuDevicePrimaryCtxRetain", NULL);
	drv.PrimaryCtxRelease = sym(h, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
	drv.CtxSetCurrent = sym(h, "cuCtxSetCurrent", NULL);
	drv.MemGetInfo = sym(h, "cuMemGetInfo_v2", "cuMemGetInfo");
	drv.Lock = sym(h, "cuCheckpointProcessLock", NULL);
	drv.Checkpoint = sym(h, "cuCheckpointProcessCheckpoint", NULL);
	drv.Restore = sym(h, "cuCheckpointProcessRestore", NULL);
	drv.Unlock = sym(h, "cuCheckpointProcessUnlock", NULL);
	drv.GetState = sym(h, "cuCheckpointProcessGetState", NULL);
	drv.GetRestoreTid = sym(h, "cuCheckpointProcessGetRestoreThreadId", NULL);
	if (!drv.Init || !drv.Lock || !drv.Checkpoint || !drv.Restore || !drv.Unlock ||
	    !drv.GetState || !drv.GetRestoreTid) {
		diag("%s lacks the checkpoint API (driver older than r550?)", path);
		return -1;
	}
	drv.init_ok = -1; /* cuInit on first need: driver_init */
	return 0;
}

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init_now(void)
{
	drv.init_ok = drv.Init(0) == CUDA_SUCCESS;
}

/* cuInit, on first need, not at load. The checkpoint calls work on other
 * processes without it (the H200's driver took them with no cuInit in the
 * caller); device enumeration and a context need it. With the only CUDA
 * process on the GPU checkpointed, cuInit took 100-185 ms on the H200 against
 * 10 ms while that process ran (DYNSNAP_CUDA_TIMING, docs/BENCHMARKS.md): a
 * cost every look at a sleeping worker paid. Returns whether it succeeded;
 * failing only matters for the map and the memory readings. */
static int driver_init(void)
{
	pthread_once(&init_once, init_now);
	return drv.init_ok > 0;
}

/* A checkpoint call that a driver refused for want of cuInit is made again
 * after it (the first such answer makes the cuInit). */
int retry_after_init(CUresult r)
{
	return r == CUDA_ERROR_NOT_INITIALIZED && driver_init();
}

const char *errname(CUresult r)
{
	const char *s = NULL;

	if (drv.GetErrorName && drv.GetErrorName(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUDA_ERROR_UNKNOWN";
}


const char *state_word(int st)
{
	switch (st) {
	case CU_PROCESS_STATE_RUNNING:
		return "running";
	case CU_PROCESS_STATE_LOCKED:
		return "locked";
	case CU_PROCESS_STATE_CHECKPOINTED:
		return "checkpointed";
	case CU_PROCESS_STATE_FAILED:
		return "failed";
	default:
		return "unknown";
	}
}

struct gpu_uuid dev_uuid[MAX_DEVS];
int ndev = -1;

int enumerate_devices(void)
{
	int n = 0;

	if (ndev >= 0)
		return 0;
	if (!driver_init() || !drv.DeviceGetCount || !drv.DeviceGet || !drv.DeviceGetUuid ||
	    drv.DeviceGetCount(&n) != CUDA_SUCCESS)
		return -1;
	if (n > MAX_DEVS)
		n = MAX_DEVS;
	for (int i = 0; i < n; i++) {
		CUdevice d;
		CUuuid u;

		if (drv.DeviceGet(&d, i) != CUDA_SUCCESS || drv.DeviceGetUuid(&u, d) != CUDA_SUCCESS)
			return -1;
		memcpy(dev_uuid[i].b, u.bytes, GPU_UUID_LEN);
	}
	ndev = n;
	return 0;
}

int dev_index(const struct gpu_uuid *u)
{
	for (int i = 0; i < ndev; i++)
		if (!memcmp(dev_uuid[i].b, u->b, GPU_UUID_LEN))
			return i;
	return -1;
}

/* The driver's state of pid into *st (left as it was when the driver fails). */
CUresult get_state(int pid, int *st)
{
	CUprocessState s;
	CUresult r = drv.GetState(pid, &s);

	if (retry_after_init(r))
		r = drv.GetState(pid, &s);
	if (r == CUDA_SUCCESS)
		*st = (int)s;
	return r;
}

CUresult get_restore_tid(int pid, int *tid)
{
	CUresult r = drv.GetRestoreTid(pid, tid);

	if (retry_after_init(r))
		r = drv.GetRestoreTid(pid, tid);
	return r;
}
