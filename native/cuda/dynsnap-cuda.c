/* dynsnap-cuda: a CLI over the CUDA driver's checkpoint API.
 *
 * A drop-in `cuda-checkpoint` for CRIU's CUDA plugin (--get-state,
 * --get-restore-tid, --action lock|checkpoint|restore|unlock, one --pid), plus
 * what dynsnap's agent needs on top: several pids from one process, `save`
 * (lock every pid, then checkpoint every pid), `resume` (restore then unlock),
 * a GPU map for restore, a free-memory check before restore, and --json.
 *
 * libcuda.so.1 is loaded at run time (DYNSNAP_LIBCUDA overrides the path), so
 * this builds where no driver exists and its tests run against a stub. GPU free
 * memory is read through NVML (libnvidia-ml.so.1, DYNSNAP_LIBNVML), also
 * loaded at run time, and through a CUDA primary context only where NVML fails.
 * See docs/NATIVE.md for usage, exit codes and the JSON format. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gpumap.h"

#define MAX_PIDS 256
#define MAX_DEVS 64

enum exit_code {
	EXIT_OK = 0,
	EXIT_FAILED = 1,   /* a driver call failed; states are reported */
	EXIT_USAGE = 2,    /* bad arguments or map: nothing was touched */
	EXIT_NOMEM = 3,    /* free-memory check refused the restore: nothing was touched */
	EXIT_NODRIVER = 4, /* libcuda could not be loaded */
};

/* ---- driver entry points, resolved with dlsym ---- */

static struct {
	__typeof__(cuInit) *Init;
	__typeof__(cuGetErrorName) *GetErrorName;
	__typeof__(cuDeviceGetCount) *DeviceGetCount;
	__typeof__(cuDeviceGet) *DeviceGet;
	__typeof__(cuDeviceGetUuid) *DeviceGetUuid;
	__typeof__(cuDevicePrimaryCtxRetain) *PrimaryCtxRetain;
	__typeof__(cuDevicePrimaryCtxRelease) *PrimaryCtxRelease;
	__typeof__(cuCtxSetCurrent) *CtxSetCurrent;
	__typeof__(cuMemGetInfo) *MemGetInfo;
	__typeof__(cuCheckpointProcessLock) *Lock;
	__typeof__(cuCheckpointProcessCheckpoint) *Checkpoint;
	__typeof__(cuCheckpointProcessRestore) *Restore;
	__typeof__(cuCheckpointProcessUnlock) *Unlock;
	__typeof__(cuCheckpointProcessGetState) *GetState;
	__typeof__(cuCheckpointProcessGetRestoreThreadId) *GetRestoreTid;
	int init_ok;
} drv;

static const char *prog = "dynsnap-cuda";

static void diag(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "%s: ", prog);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

static void *sym(void *h, const char *a, const char *b)
{
	void *p = dlsym(h, a);

	return p || !b ? p : dlsym(h, b);
}

static int load_driver(void)
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
static int retry_after_init(CUresult r)
{
	return r == CUDA_ERROR_NOT_INITIALIZED && driver_init();
}

static const char *errname(CUresult r)
{
	const char *s = NULL;

	if (drv.GetErrorName && drv.GetErrorName(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUDA_ERROR_UNKNOWN";
}

/* DYNSNAP_CUDA_TIMING=1: one stderr line per stage of an action, with the
 * milliseconds since the start ("timing +12.3 ms driver loaded"), to find
 * where a call spends what its driver calls do not (docs/BENCHMARKS.md). */
static void mark(const char *what)
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

static const char *state_word(int st)
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

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---- devices ---- */

static struct gpu_uuid dev_uuid[MAX_DEVS];
static int ndev = -1;

static int enumerate_devices(void)
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

static int dev_index(const struct gpu_uuid *u)
{
	for (int i = 0; i < ndev; i++)
		if (!memcmp(dev_uuid[i].b, u->b, GPU_UUID_LEN))
			return i;
	return -1;
}

/* ---- free GPU memory ---- */

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

enum mem_src { SRC_NONE, SRC_NVML, SRC_CUDA };
static unsigned int mem_src_used; /* bit per enum mem_src behind this run's numbers */

static void sample_free(long long *free_b, signed char *src)
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

static const char *mem_src_word(void)
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

/* ---- per-pid work ---- */

enum op { OP_LOCK, OP_CHECKPOINT, OP_RESTORE, OP_UNLOCK, OP_NONE };
static const char *op_name[] = { "lock", "checkpoint", "restore", "unlock" };

struct job {
	int pid;
	int state_before, state_after;
	double ms[4];      /* per op, -1 when not run */
	CUresult err;      /* first failing call */
	int err_op;        /* OP_NONE when ok */
	int skipped;       /* not attempted because an earlier pid failed (serial) */
	long long bytes;   /* GPU bytes freed (checkpoint) or needed (restore), -1 unknown */
};

static struct {
	unsigned int timeout_ms;
	struct gpu_pair pairs[GPUMAP_MAX];
	int npairs;
	int serial;
} opt;

static struct job jobs[MAX_PIDS];
static int njobs;

struct phase_arg {
	struct job *j;
	enum op op;
};

static CUresult call_op(struct job *j, enum op op)
{
	CUresult r;

	switch (op) {
	case OP_LOCK: {
		CUcheckpointLockArgs a;

		memset(&a, 0, sizeof(a));
		a.timeoutMs = opt.timeout_ms;
		r = drv.Lock(j->pid, &a);
		break;
	}
	case OP_CHECKPOINT:
		r = drv.Checkpoint(j->pid, NULL);
		break;
	case OP_RESTORE: {
		CUcheckpointRestoreArgs a;
		CUcheckpointGpuPair pairs[GPUMAP_MAX];

		memset(&a, 0, sizeof(a));
		for (int i = 0; i < opt.npairs; i++) {
			memcpy(pairs[i].oldUuid.bytes, opt.pairs[i].old_uuid.b, GPU_UUID_LEN);
			memcpy(pairs[i].newUuid.bytes, opt.pairs[i].new_uuid.b, GPU_UUID_LEN);
		}
		a.gpuPairs = pairs;
		a.gpuPairsCount = (unsigned int)opt.npairs;
		r = drv.Restore(j->pid, opt.npairs ? &a : NULL);
		break;
	}
	case OP_UNLOCK:
		r = drv.Unlock(j->pid, NULL);
		break;
	default:
		r = CUDA_ERROR_INVALID_VALUE;
	}
	return r;
}

static CUresult do_op(struct job *j, enum op op)
{
	double t0 = now_ms();
	CUresult r = call_op(j, op);

	if (retry_after_init(r))
		r = call_op(j, op);
	j->ms[op] = now_ms() - t0;
	if (r != CUDA_SUCCESS && j->err_op == OP_NONE) {
		j->err = r;
		j->err_op = op;
	}
	return r;
}

static void *phase_thread(void *p)
{
	struct phase_arg *a = p;

	do_op(a->j, a->op);
	return NULL;
}

/* Runs op on every selected job. Parallel by default: the driver overlaps
 * per-process checkpoint and restore work (docs/BENCHMARKS.md), so a helper
 * that serialises them wastes most of the wait. With stop_on_fail (serial
 * only) the first failure stops the phase; later pids are marked skipped.
 * Returns the number of failures. */
static int run_phase(enum op op, const int *sel, int stop_on_fail)
{
	pthread_t th[MAX_PIDS];
	struct phase_arg args[MAX_PIDS];
	int started[MAX_PIDS] = { 0 }, fails = 0, n = 0;

	for (int i = 0; i < njobs; i++)
		if (!sel || sel[i])
			n++;
	for (int i = 0; i < njobs; i++) {
		if (sel && !sel[i])
			continue;
		if (opt.serial || n == 1) {
			if (fails && stop_on_fail) {
				jobs[i].skipped = 1;
				continue;
			}
			if (do_op(&jobs[i], op) != CUDA_SUCCESS)
				fails++;
			continue;
		}
		args[i].j = &jobs[i];
		args[i].op = op;
		if (pthread_create(&th[i], NULL, phase_thread, &args[i]) == 0)
			started[i] = 1;
		else
			phase_thread(&args[i]);
	}
	for (int i = 0; i < njobs; i++)
		if (started[i])
			pthread_join(th[i], NULL);
	if (!opt.serial && n > 1)
		for (int i = 0; i < njobs; i++)
			if ((!sel || sel[i]) && jobs[i].err_op == (int)op)
				fails++;
	return fails;
}

/* The driver's state of pid into *st (left as it was when the driver fails). */
static CUresult get_state(int pid, int *st)
{
	CUprocessState s;
	CUresult r = drv.GetState(pid, &s);

	if (retry_after_init(r))
		r = drv.GetState(pid, &s);
	if (r == CUDA_SUCCESS)
		*st = (int)s;
	return r;
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
static void write_records(const char *group, const long long *freed)
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
static int read_records(long long *need)
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

static void drop_records(void)
{
	char path[PATH_MAX];

	for (int i = 0; i < njobs; i++) {
		if (jobs[i].err_op != OP_NONE)
			continue;
		snprintf(path, sizeof(path), "%s/%d", record_dir(), jobs[i].pid);
		unlink(path);
	}
}

/* ---- output ---- */

/* Each GPU's free memory before and after the call, for the agent's status
 * ("gpus": freeBefore/freeAfter), printed by --json as one last line
 * {"gpus":[...]} next to the per-pid records. Read here, around the driver
 * calls, so that the agent needs no --mem-info helpers of its own before and
 * after: each is a process start, a driver load and an NVML init, 0.034 s
 * (median) on the H200, twice per wake and per capture (docs/BENCHMARKS.md,
 * "Issue 12 on the H200"). */
static struct {
	int on;
	long long before[MAX_DEVS], after[MAX_DEVS];
	signed char src_before[MAX_DEVS], src_after[MAX_DEVS];
} gmem;

static void gpus_line(const long long *before, const signed char *src_before, const long long *after,
		      const signed char *src_after)
{
	for (int d = 0; d < ndev; d++) {
		gmem.before[d] = before[d];
		gmem.src_before[d] = src_before[d];
		gmem.after[d] = after[d];
		gmem.src_after[d] = src_after[d];
	}
	gmem.on = ndev > 0;
}

static void print_gpus_json(void)
{
	if (!gmem.on)
		return;
	printf("{\"gpus\":[");
	for (int d = 0; d < ndev; d++) {
		char u[64];

		gpu_uuid_format(&dev_uuid[d], u, sizeof(u));
		printf("%s{\"index\":%d,\"uuid\":\"%s\",\"free_before\":", d ? "," : "", d, u);
		if (gmem.before[d] >= 0)
			printf("%lld", gmem.before[d]);
		else
			printf("null");
		printf(",\"free_after\":");
		if (gmem.after[d] >= 0 && gmem.src_after[d] == gmem.src_before[d])
			printf("%lld", gmem.after[d]);
		else
			printf("null");
		printf(",\"source\":\"%s\"}", gmem.src_before[d] == SRC_NVML ? "nvml" :
						 gmem.src_before[d] == SRC_CUDA ? "cuda" : "none");
	}
	printf("]}\n");
}

/* Set when the whole action was refused before any state change (free memory):
 * every pid's JSON record then says ok:false with this reason. */
static char refusal[256];

static void print_json(const char *action)
{
	for (int i = 0; i < njobs; i++) {
		struct job *j = &jobs[i];
		int first = 1;

		printf("{\"pid\":%d,\"action\":\"%s\",\"ok\":%s,\"state_before\":\"%s\","
		       "\"state_after\":\"%s\",\"ms\":{",
		       j->pid, action, j->err_op == OP_NONE && !j->skipped && !refusal[0] ? "true" : "false",
		       state_word(j->state_before), state_word(j->state_after));
		for (int o = 0; o < 4; o++) {
			if (j->ms[o] < 0)
				continue;
			printf("%s\"%s\":%.3f", first ? "" : ",", op_name[o], j->ms[o]);
			first = 0;
		}
		printf("},\"bytes\":");
		if (j->bytes >= 0)
			printf("%lld", j->bytes);
		else
			printf("null");
		printf(",\"mem_source\":%s,\"error\":", mem_src_word());
		if (j->err_op != OP_NONE)
			printf("\"%s %s (%d)\"", op_name[j->err_op], errname(j->err), (int)j->err);
		else if (j->skipped)
			printf("\"skipped after an earlier failure\"");
		else if (refusal[0])
			printf("\"%s\"", refusal);
		else
			printf("null");
		printf("}\n");
	}
	print_gpus_json();
	fflush(stdout);
}

/* The one-line reason on failure, naming every pid's state so the caller
 * knows what it has to clean up. */
static void report_failure(const char *action, const char *what)
{
	char buf[4096];
	size_t off = 0;

	for (int i = 0; i < njobs && off < sizeof(buf) - 64; i++)
		off += (size_t)snprintf(buf + off, sizeof(buf) - off, "%s%d=%s", i ? " " : "",
					jobs[i].pid, state_word(jobs[i].state_after));
	for (int i = 0; i < njobs; i++)
		if (jobs[i].err_op != OP_NONE) {
			if (njobs == 1)
				diag("%s pid %d: %s failed: %s (%d)", action, jobs[i].pid,
				     op_name[jobs[i].err_op], errname(jobs[i].err), (int)jobs[i].err);
			else
				diag("%s failed%s%s: %s pid %d: %s (%d); states: %s", action,
				     what ? ", " : "", what ? what : "", op_name[jobs[i].err_op],
				     jobs[i].pid, errname(jobs[i].err), (int)jobs[i].err, buf);
			return;
		}
}

/* --mem-info: free memory of every visible GPU, one JSON object per line, read
 * the way save and resume read it (NVML first, the primary context as fallback).
 * The agent records these before and after a capture or a wake. */
static int print_mem_info(void)
{
	long long free_b[MAX_DEVS];
	signed char src[MAX_DEVS];

	if (load_driver())
		return EXIT_NODRIVER;
	if (enumerate_devices()) {
		diag("cannot enumerate GPUs");
		return EXIT_FAILED;
	}
	sample_free(free_b, src);
	for (int d = 0; d < ndev; d++) {
		char u[64];

		gpu_uuid_format(&dev_uuid[d], u, sizeof(u));
		printf("{\"index\":%d,\"uuid\":\"%s\",\"free\":", d, u);
		if (free_b[d] >= 0)
			printf("%lld", free_b[d]);
		else
			printf("null");
		printf(",\"source\":\"%s\"}\n", src[d] == SRC_NVML ? "nvml" : src[d] == SRC_CUDA ? "cuda" : "none");
	}
	fflush(stdout);
	return EXIT_OK;
}

/* ---- argument parsing ---- */

static int add_pids(const char *list)
{
	char *copy = strdup(list), *save = NULL, *tok;
	int rc = 0;

	if (!copy)
		return -1;
	if (!*list || list[strlen(list) - 1] == ',' || list[0] == ',' || strstr(list, ",,")) {
		diag("invalid --pid '%s'", list);
		free(copy);
		return -1;
	}
	for (tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		char *end;
		long v;

		while (*tok == ' ')
			tok++;
		errno = 0;
		v = strtol(tok, &end, 10);
		while (*end == ' ')
			end++;
		if (errno || end == tok || *end || v <= 0 || v > INT_MAX) {
			diag("invalid pid '%s' in --pid '%s'", tok, list);
			rc = -1;
			break;
		}
		for (int i = 0; i < njobs; i++)
			if (jobs[i].pid == v) {
				diag("pid %ld given twice", v);
				rc = -1;
				break;
			}
		if (rc)
			break;
		if (njobs >= MAX_PIDS) {
			diag("more than %d pids", MAX_PIDS);
			rc = -1;
			break;
		}
		jobs[njobs++].pid = (int)v;
	}
	free(copy);
	return rc;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: %s --get-state --pid PIDS\n"
		"       %s --get-restore-tid --pid PIDS\n"
		"       %s --mem-info\n"
		"       %s --action lock|checkpoint|restore|unlock|save|resume --pid PIDS [options]\n"
		"\n"
		"  --action ACTION       lock, checkpoint, restore, unlock (the driver calls);\n"
		"                        save = lock every pid, then checkpoint every pid;\n"
		"                        resume = restore every pid, then unlock every pid\n"
		"  --get-state           print running|locked|checkpointed|failed\n"
		"  --get-restore-tid     print the restore thread id\n"
		"  --mem-info            free memory of every visible GPU, one JSON line each\n"
		"  -p, --pid PIDS        pid or comma list; repeatable; all handled by this process\n"
		"  -t, --timeout MS      lock timeout in ms (lock: 0 = none; save: default 10000)\n"
		"  --gpu-map, --device-map OLD=NEW,...\n"
		"                        restore/resume: remap GPUs; each side an index or UUID\n"
		"                        (GPU- prefix and dashes optional); must cover every\n"
		"                        visible GPU; ignored for lock/checkpoint/save\n"
		"  --need-bytes N        free bytes each target GPU must have before restore\n"
		"                        (default: what the recorded checkpoint freed)\n"
		"  --force               skip the free-memory check before restore\n"
		"  --skip-mem            no GPU memory sampling at all (no bytes, no record,\n"
		"                        no check)\n"
		"  --serial              one pid at a time (default: pids in parallel threads)\n"
		"  --json                one JSON object per pid on stdout\n"
		"  -h, --help            this help\n"
		"\n"
		"exit: 0 ok, 1 driver call failed, 2 bad arguments (nothing touched),\n"
		"      3 not enough free GPU memory (nothing touched), 4 no usable libcuda\n"
		"env:  DYNSNAP_LIBCUDA (driver library path), DYNSNAP_LIBNVML (NVML library\n"
		"      path, for free GPU memory), DYNSNAP_CUDA_STATE_DIR\n",
		prog, prog, prog, prog);
}

int main(int argc, char **argv)
{
	const char *action = NULL, *map = NULL;
	int get_st = 0, get_tid = 0, json = 0, force = 0, timeout_set = 0, fails = 0, skip_mem = 0;
	int mem_info = 0;
	long long need_bytes = -1;
	char err[512];
	char *base = strdup(argv[0]);

	if (base)
		prog = strdup(basename(base));
	mark("start");
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;

#define NEEDV()                                              \
	do {                                                 \
		if (!v) {                                    \
			diag("%s needs a value", a);         \
			return EXIT_USAGE;                   \
		}                                            \
		i++;                                         \
	} while (0)
		if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
			usage(stdout);
			return EXIT_OK;
		} else if (!strcmp(a, "--action")) {
			NEEDV();
			action = v;
		} else if (!strcmp(a, "--get-state")) {
			get_st = 1;
		} else if (!strcmp(a, "--get-restore-tid")) {
			get_tid = 1;
		} else if (!strcmp(a, "--mem-info")) {
			mem_info = 1;
		} else if (!strcmp(a, "--pid") || !strcmp(a, "-p")) {
			NEEDV();
			if (add_pids(v))
				return EXIT_USAGE;
		} else if (!strcmp(a, "--timeout") || !strcmp(a, "-t")) {
			char *end;
			unsigned long t;

			NEEDV();
			errno = 0;
			t = strtoul(v, &end, 10);
			if (errno || !*v || *end || t > UINT_MAX || v[0] == '-') {
				diag("invalid --timeout '%s'", v);
				return EXIT_USAGE;
			}
			opt.timeout_ms = (unsigned int)t;
			timeout_set = 1;
		} else if (!strcmp(a, "--gpu-map") || !strcmp(a, "--device-map")) {
			NEEDV();
			map = v;
		} else if (!strcmp(a, "--need-bytes")) {
			char *end;

			NEEDV();
			need_bytes = strtoll(v, &end, 10);
			if (!*v || *end || need_bytes < 0) {
				diag("invalid --need-bytes '%s'", v);
				return EXIT_USAGE;
			}
		} else if (!strcmp(a, "--force")) {
			force = 1;
		} else if (!strcmp(a, "--skip-mem")) {
			skip_mem = 1;
		} else if (!strcmp(a, "--serial")) {
			opt.serial = 1;
		} else if (!strcmp(a, "--json")) {
			json = 1;
		} else {
			diag("unknown argument '%s' (see --help)", a);
			return EXIT_USAGE;
		}
#undef NEEDV
	}
	if (get_st + get_tid + mem_info + (action != NULL) != 1) {
		diag("give exactly one of --action, --get-state, --get-restore-tid, --mem-info");
		return EXIT_USAGE;
	}
	if (mem_info) {
		if (njobs) {
			diag("--mem-info takes no --pid");
			return EXIT_USAGE;
		}
		return print_mem_info();
	}
	if (!njobs) {
		diag("--pid is required");
		return EXIT_USAGE;
	}
	enum op first = OP_NONE, second = OP_NONE;
	int is_restore = 0;

	if (action) {
		if (!strcmp(action, "lock")) {
			first = OP_LOCK;
		} else if (!strcmp(action, "checkpoint")) {
			first = OP_CHECKPOINT;
		} else if (!strcmp(action, "restore")) {
			first = OP_RESTORE;
		} else if (!strcmp(action, "unlock")) {
			first = OP_UNLOCK;
		} else if (!strcmp(action, "save")) {
			first = OP_LOCK;
			second = OP_CHECKPOINT;
		} else if (!strcmp(action, "resume")) {
			first = OP_RESTORE;
			second = OP_UNLOCK;
		} else {
			diag("unknown action '%s'", action);
			return EXIT_USAGE;
		}
		is_restore = first == OP_RESTORE;
		if (map && !is_restore) {
			diag("--gpu-map ignored for %s: it applies to restore and resume", action);
			map = NULL;
		}
		/* A save that cannot get every lock must give up and roll back
		 * rather than wait forever on a busy rank. */
		if (!timeout_set && !strcmp(action, "save"))
			opt.timeout_ms = 10000;
	}

	if (load_driver())
		return EXIT_NODRIVER;
	mark("driver loaded");
	for (int i = 0; i < njobs; i++) {
		for (int o = 0; o < 4; o++)
			jobs[i].ms[o] = -1;
		jobs[i].err_op = OP_NONE;
		jobs[i].bytes = -1;
		jobs[i].state_before = jobs[i].state_after = -1;
	}

	if (get_st || get_tid) {
		for (int i = 0; i < njobs; i++) {
			CUresult r;
			int st = -1, tid = 0;

			if (get_st) {
				r = get_state(jobs[i].pid, &st);
			} else {
				r = drv.GetRestoreTid(jobs[i].pid, &tid);
				if (retry_after_init(r))
					r = drv.GetRestoreTid(jobs[i].pid, &tid);
			}
			if (r != CUDA_SUCCESS) {
				diag("%s pid %d: %s (%d)", get_st ? "get-state" : "get-restore-tid",
				     jobs[i].pid, errname(r), (int)r);
				fails++;
				continue;
			}
			/* One pid prints the bare word, exactly as CRIU's plugin
			 * parses it; several print "pid value" lines. */
			if (njobs > 1)
				printf("%d ", jobs[i].pid);
			if (get_st)
				printf("%s\n", state_word(st));
			else
				printf("%d\n", tid);
		}
		return fails ? EXIT_FAILED : EXIT_OK;
	}

	/* Everything that can refuse is checked before the first state change. */
	long long free_before[MAX_DEVS], need[MAX_DEVS] = { 0 };
	signed char src_before[MAX_DEVS];

	if (map) {
		if (enumerate_devices()) {
			diag("cannot enumerate GPUs to resolve --gpu-map");
			return EXIT_USAGE;
		}
		opt.npairs = gpumap_parse(map, dev_uuid, ndev, opt.pairs, GPUMAP_MAX, err,
					  sizeof(err));
		if (opt.npairs < 0) {
			diag("invalid --gpu-map '%s': %s", map, err);
			return EXIT_USAGE;
		}
	}
	for (int i = 0; i < njobs; i++)
		get_state(jobs[i].pid, &jobs[i].state_before);
	mark("state before");
	int restore_sampled = 0;

	if (is_restore && !force && !skip_mem && enumerate_devices() == 0) {
		int have = read_records(need);

		if (need_bytes >= 0) {
			have = 1;
			for (int d = 0; d < ndev; d++)
				need[d] = need_bytes;
		}
		if (have) {
			sample_free(free_before, src_before);
			restore_sampled = 1;
			for (int d = 0; d < ndev; d++) {
				char u[64];

				if (need[d] <= 0 || free_before[d] < 0 || free_before[d] >= need[d])
					continue;
				gpu_uuid_format(&dev_uuid[d], u, sizeof(u));
				snprintf(refusal, sizeof(refusal),
					 "refused: GPU %d (%s) has %lld MiB free, the process needs %lld MiB", d, u,
					 free_before[d] >> 20, need[d] >> 20);
				diag("refusing %s: GPU %d (%s) has %lld MiB free, the process needs %lld MiB (--force to override)",
				     action, d, u, free_before[d] >> 20, need[d] >> 20);
				for (int i = 0; i < njobs; i++)
					jobs[i].state_after = jobs[i].state_before;
				if (json)
					print_json(action);
				return EXIT_NOMEM;
			}
		}
	}

	int is_ckpt = first == OP_CHECKPOINT || second == OP_CHECKPOINT, rolled_back = 0;
	int have_dev = is_ckpt && !skip_mem && enumerate_devices() == 0, sampled = 0;
	/* The "gpus" line of a restore: its reading before (the free-memory
	 * check's, or one now) and one after. */
	int restore_line = is_restore && json && !skip_mem && enumerate_devices() == 0;

	if (restore_line && !restore_sampled)
		sample_free(free_before, src_before);
	mark("free memory before");

	if (second == OP_CHECKPOINT) {
		/* save: every lock before any checkpoint. A rank checkpointed
		 * while a peer still runs can strand a collective mid-flight. */
		fails = run_phase(OP_LOCK, NULL, 0);
		mark("lock");
		if (fails) {
			int locked[MAX_PIDS];

			/* A pid left locked is a hung workload: worse than a failed
			 * capture. Undo the locks that were taken. */
			for (int i = 0; i < njobs; i++)
				locked[i] = jobs[i].err_op == OP_NONE;
			run_phase(OP_UNLOCK, locked, 0);
			rolled_back = 1;
		} else {
			if (have_dev) {
				sample_free(free_before, src_before);
				sampled = 1;
			}
			/* A failed checkpoint stops and leaves the locks: pids already
			 * checkpointed can only be recovered by a restore the caller
			 * drives. */
			fails = run_phase(OP_CHECKPOINT, NULL, 1);
			mark("checkpoint");
		}
	} else {
		if (first == OP_CHECKPOINT && have_dev) {
			sample_free(free_before, src_before);
			sampled = 1;
		}
		fails = run_phase(first, NULL, 0);
		mark(op_name[first]);
		if (!fails && second != OP_NONE) {
			fails = run_phase(second, NULL, 0);
			mark(op_name[second]);
		}
	}

	/* No reading after a save whose locks were rolled back: nothing was
	 * read before it, and nothing was freed. */
	if (sampled && !jobs[0].skipped) {
		long long free_after[MAX_DEVS], freed[MAX_DEVS], total = 0;
		signed char src_after[MAX_DEVS];
		char group[64];

		sample_free(free_after, src_after);
		/* NVML and CUDA do not agree on free bytes (on the H200, inside
		 * the helper's own context cuMemGetInfo said 523 MiB less than
		 * NVML), so a difference is only taken between two readings of
		 * one source. */
		for (int d = 0; d < ndev; d++) {
			freed[d] = free_before[d] >= 0 && free_after[d] >= 0 &&
						   src_before[d] == src_after[d] ?
					   free_after[d] - free_before[d] :
					   0;
			if (freed[d] > 0)
				total += freed[d];
		}
		snprintf(group, sizeof(group), "%d-%ld", (int)getpid(), (long)time(NULL));
		write_records(group, freed);
		for (int i = 0; i < njobs; i++)
			if (njobs == 1)
				jobs[i].bytes = total;
		if (json)
			gpus_line(free_before, src_before, free_after, src_after);
	}
	if (restore_line) {
		long long free_after[MAX_DEVS];
		signed char src_after[MAX_DEVS];

		sample_free(free_after, src_after);
		gpus_line(free_before, src_before, free_after, src_after);
	}
	if (is_restore) {
		for (int d = 0; d < ndev && njobs == 1; d++)
			if (need[d] > 0)
				jobs[0].bytes = (jobs[0].bytes < 0 ? 0 : jobs[0].bytes) + need[d];
		if (!fails)
			drop_records();
	}
	mark("free memory after");
	for (int i = 0; i < njobs; i++)
		get_state(jobs[i].pid, &jobs[i].state_after);
	mark("state after");
	if (json)
		print_json(action);
	mark("printed");
	if (fails) {
		report_failure(action, rolled_back ? "locks rolled back" : NULL);
		return EXIT_FAILED;
	}
	return EXIT_OK;
}
