/* dynsnap-cuda's GPU memory: free bytes per device, through NVML (libnvidia-ml.so.1, DYNSNAP_LIBNVML,
 * loaded at run time) and through a CUDA primary context only where NVML fails; and the records of
 * what a checkpoint freed, which the free-memory check before a restore reads. Calls only
 * driver.c. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dynsnap-cuda.h"

/* NVML's few types, declared here so that no nvml.h is needed (ABI of
 * nvml.h: nvmlReturn_t is an int-sized enum with NVML_SUCCESS 0,
 * nvmlDevice_t an opaque pointer, nvmlMemory_t the v1 struct). */
typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
	unsigned long long total, free, used;
} nvmlMemory_t;

static struct {
	nvmlReturn_t (*Init)(void);
	nvmlReturn_t (*Shutdown)(void);
	nvmlReturn_t (*GetHandleByUUID)(const char *uuid, nvmlDevice_t *dev);
	nvmlReturn_t (*GetMemoryInfo)(nvmlDevice_t dev, nvmlMemory_t *mem);
	int tried, ok;
	nvmlDevice_t dev[MAX_DEVS];
	signed char have[MAX_DEVS]; /* 0 not looked up, 1 handle, -1 NVML failed */
} nvml;

static void nvml_shutdown(void)
{
	if (nvml.ok)
		nvml.Shutdown();
	nvml.ok = 0;
}

/* Loads NVML and initialises it, once per process. Any failure leaves
 * nvml.ok 0 and the readings go through CUDA; nothing is printed, since a
 * successful CRIU-plugin call must stay silent. */
static int nvml_load(void)
{
	const char *path = getenv("DYNSNAP_LIBNVML");
	void *h;

	if (nvml.tried)
		return nvml.ok ? 0 : -1;
	nvml.tried = 1;
	if (!path || !*path)
		path = "libnvidia-ml.so.1";
	h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h)
		return -1;
	nvml.Init = sym(h, "nvmlInit_v2", NULL);
	nvml.Shutdown = sym(h, "nvmlShutdown", NULL);
	nvml.GetHandleByUUID = sym(h, "nvmlDeviceGetHandleByUUID", NULL);
	nvml.GetMemoryInfo = sym(h, "nvmlDeviceGetMemoryInfo", NULL);
	if (!nvml.Init || !nvml.Shutdown || !nvml.GetHandleByUUID || !nvml.GetMemoryInfo ||
	    nvml.Init() != NVML_SUCCESS)
		return -1;
	nvml.ok = 1;
	atexit(nvml_shutdown);
	return 0;
}

/* Free bytes on device idx through NVML: no CUDA context, so it neither
 * costs the context's creation nor touches the driver's state around a
 * checkpoint (on the H200, 0.02 s a save against 0.36-0.43 s for the
 * context, docs/BENCHMARKS.md). The device is found by the UUID CUDA gave
 * it, so CUDA's index order and CUDA_VISIBLE_DEVICES hold; a UUID NVML
 * does not know falls back. A device NVML failed on once stays on
 * CUDA for the rest of the process, so that two readings of one device come
 * from one source. */
static int nvml_free(int idx, long long *free_b)
{
	nvmlMemory_t m;

	if (nvml_load() || nvml.have[idx] < 0)
		return -1;
	if (!nvml.have[idx]) {
		char u[64];

		gpu_uuid_format(&dev_uuid[idx], u, sizeof(u));
		nvml.have[idx] = nvml.GetHandleByUUID(u, &nvml.dev[idx]) == NVML_SUCCESS ? 1 : -1;
		if (nvml.have[idx] < 0)
			return -1;
	}
	if (nvml.GetMemoryInfo(nvml.dev[idx], &m) != NVML_SUCCESS ||
	    m.free > (unsigned long long)LLONG_MAX) {
		nvml.have[idx] = -1;
		return -1;
	}
	*free_b = (long long)m.free;
	return 0;
}

/* Free bytes on device idx through a primary context held only for the
 * query (it is released before any restore so it takes nothing from it).
 * The fallback where NVML is missing or fails: on the H200, the context cost
 * 0.36-0.43 s per save and 0.17-0.21 s per resume (docs/BENCHMARKS.md).
 * Its reading counts the context itself as used. */
static int cuda_free(int idx, long long *free_b)
{
	CUdevice d;
	CUcontext c;
	size_t f, t;
	int rc = -1;

	if (!drv.PrimaryCtxRetain || !drv.MemGetInfo || !drv.CtxSetCurrent ||
	    drv.DeviceGet(&d, idx) != CUDA_SUCCESS || drv.PrimaryCtxRetain(&c, d) != CUDA_SUCCESS)
		return -1;
	if (drv.CtxSetCurrent(c) == CUDA_SUCCESS && drv.MemGetInfo(&f, &t) == CUDA_SUCCESS) {
		*free_b = (long long)f;
		rc = 0;
	}
	drv.CtxSetCurrent(NULL);
	if (drv.PrimaryCtxRelease)
		drv.PrimaryCtxRelease(d);
	return rc;
}

static unsigned int mem_src_used; /* bit per enum mem_src behind this run's numbers */

void sample_free(long long *free_b, signed char *src)
{
	for (int d = 0; d < ndev; d++) {
		src[d] = SRC_NONE;
		free_b[d] = -1;
		if (nvml_free(d, &free_b[d]) == 0)
			src[d] = SRC_NVML;
		else if (cuda_free(d, &free_b[d]) == 0)
			src[d] = SRC_CUDA;
		if (src[d] != SRC_NONE)
			mem_src_used |= 1u << src[d];
	}
}

const char *mem_src_word(void)
{
	switch (mem_src_used) {
	case 1u << SRC_NVML:
		return "\"nvml\"";
	case 1u << SRC_CUDA:
		return "\"cuda\"";
	case 1u << SRC_NVML | 1u << SRC_CUDA:
		return "\"nvml+cuda\"";
	default:
		return "null";
	}
}

/* ---- GPU memory records: what a checkpoint freed, for the restore check ---- */

static const char *record_dir(void)
{
	const char *d = getenv("DYNSNAP_CUDA_STATE_DIR");

	return d && *d ? d : "/run/dynsnap-cuda";
}

/* One record per pid: the call that checkpointed it (a group id), and bytes
 * freed per GPU by that whole call. A call checkpointing several pids on one
 * GPU can only measure their sum, so restore counts each group once. */
void write_records(const char *group, const long long *freed)
{
	char path[PATH_MAX], tmp[PATH_MAX + 8], u[64];
	const char *dir = record_dir();

	if (mkdir(dir, 0700) != 0 && errno != EEXIST)
		return;
	for (int i = 0; i < njobs; i++) {
		FILE *f;

		if (jobs[i].err_op != OP_NONE || jobs[i].skipped)
			continue;
		snprintf(path, sizeof(path), "%s/%d", dir, jobs[i].pid);
		snprintf(tmp, sizeof(tmp), "%s.tmp", path);
		f = fopen(tmp, "w");
		if (!f)
			continue;
		fprintf(f, "group %s\n", group);
		for (int d = 0; d < ndev; d++) {
			if (freed[d] <= 0)
				continue;
			gpu_uuid_format(&dev_uuid[d], u, sizeof(u));
			fprintf(f, "%s %lld\n", u, freed[d]);
		}
		if (fclose(f) == 0)
			rename(tmp, path);
	}
}

/* need[d] += bytes recorded for the pids, after applying the GPU map.
 * Returns 1 when any record was found. */
int read_records(long long *need)
{
	char groups[MAX_PIDS][64];
	int ngroups = 0, found = 0;

	for (int i = 0; i < njobs; i++) {
		char path[PATH_MAX], line[256], group[64] = "";
		FILE *f;
		int dup = 0;

		snprintf(path, sizeof(path), "%s/%d", record_dir(), jobs[i].pid);
		f = fopen(path, "r");
		if (!f)
			continue;
		found = 1;
		if (fgets(line, sizeof(line), f) && sscanf(line, "group %63s", group) == 1) {
			for (int g = 0; g < ngroups; g++)
				if (!strcmp(groups[g], group))
					dup = 1;
			if (!dup && ngroups < MAX_PIDS)
				snprintf(groups[ngroups++], 64, "%s", group);
		}
		while (!dup && fgets(line, sizeof(line), f)) {
			char us[80];
			long long b;
			struct gpu_uuid u;
			int d;

			if (sscanf(line, "%79s %lld", us, &b) != 2 || gpu_uuid_parse(us, &u))
				continue;
			for (int p = 0; p < opt.npairs; p++)
				if (!memcmp(opt.pairs[p].old_uuid.b, u.b, GPU_UUID_LEN)) {
					u = opt.pairs[p].new_uuid;
					break;
				}
			d = dev_index(&u);
			if (d >= 0)
				need[d] += b;
		}
		fclose(f);
	}
	return found;
}

void drop_records(void)
{
	char path[PATH_MAX];

	for (int i = 0; i < njobs; i++) {
		if (jobs[i].err_op != OP_NONE)
			continue;
		snprintf(path, sizeof(path), "%s/%d", record_dir(), jobs[i].pid);
		unlink(path);
	}
}
