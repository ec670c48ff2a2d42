/* stub_process.c: the part of stub_libcuda that a process calls on its own
 * behalf, as an engine does (stub_libcuda.c's header says what each call does
 * and the formats of the files): the hold of a call made while that process is
 * locked or checkpointed, and the device memory it allocates, copies to and
 * from, and frees. Built into the same library as stub_libcuda.c. */
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "stub_process.h"

#define HOLD_POLL_MS 10
#define HOLD_MAX_MS 600000LL /* 10 min: longer than any capture a test makes, and still a bound */
#define MAXA 256 /* allocations one process holds at once */
#define MAXK 1024 /* processes with allocations */

/* ---- the hold ---- */

/* The pid the CLI is given for this process when no nskey: the first NSpid
 * entry (its pid in the namespace of the /proc it sees: the host's pid where
 * /proc is the host's), else getpid(). */
static long long host_pid_self(void)
{
	char line[256];
	long long pid = getpid();
	FILE *f = fopen("/proc/self/status", "r");

	if (!f)
		return pid;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "NSpid:", 6)) {
			pid = atoll(line + 6);
			break;
		}
	fclose(f);
	return pid > 0 ? pid : getpid();
}

long long stub_self_key(void)
{
	struct stat st;

	if (!control_keyed("nskey", 0, NULL, 0))
		return host_pid_self();
	if (stat("/proc/self/ns/pid", &st))
		return getpid();
	/* as state_key: the namespace's inode and the innermost pid, which getpid() is */
	return (long long)(st.st_ino << 22) | getpid();
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static int held(int st)
{
	return st == CU_PROCESS_STATE_LOCKED || st == CU_PROCESS_STATE_CHECKPOINTED;
}

void stub_drop_stale_self(void)
{
	long long key = stub_self_key();
	int st = stub_state_of(key);

	if (!held(st))
		return;
	stub_write_state_key(key, CU_PROCESS_STATE_RUNNING);
	logline_to("holds", "stale key=%lld state=%d dropped", key, st);
}

CUresult stub_hold(const char *fn)
{
	long long key = stub_self_key(), max_ms = HOLD_MAX_MS, t0;
	int st = stub_state_of(key);
	CUresult rc = CUDA_SUCCESS;

	if (!held(st))
		return CUDA_SUCCESS;
	control_keyed("holdmax", 0, &max_ms, 1);
	logline_to("holds", "hold %s key=%lld state=%d", fn, key, st);
	t0 = now_ms();
	/* bounded by time and by count (a poll sleeps at least HOLD_POLL_MS) */
	for (long long i = 0; held(st); i++) {
		if (now_ms() - t0 >= max_ms || i > max_ms / HOLD_POLL_MS) {
			rc = CUDA_ERROR_UNKNOWN;
			break;
		}
		usleep(HOLD_POLL_MS * 1000);
		st = stub_state_of(key);
	}
	logline_to("holds", "release %s key=%lld state=%d ms=%lld rc=%d", fn, key, st, now_ms() - t0, (int)rc);
	return rc;
}

/* ---- the alloc file: per process, its device, bytes, and whether they are on the device ---- */

struct arec {
	long long key, bytes;
	int dev, resident;
};

static int read_arecs(struct arec *r)
{
	char p[4096];
	int n = 0;
	FILE *f;

	path(p, sizeof(p), "alloc");
	f = fopen(p, "r");
	if (!f)
		return 0;
	while (n < MAXK && fscanf(f, "%lld %d %lld %d", &r[n].key, &r[n].dev, &r[n].bytes, &r[n].resident) == 4)
		n++;
	fclose(f);
	return n;
}

static void write_arecs(const struct arec *r, int n)
{
	char p[4096], tmp[4200];
	FILE *f;

	path(p, sizeof(p), "alloc");
	snprintf(tmp, sizeof(tmp), "%s.tmp", p);
	f = fopen(tmp, "w");
	if (!f)
		return;
	for (int i = 0; i < n; i++)
		if (r[i].bytes > 0)
			fprintf(f, "%lld %d %lld %d\n", r[i].key, r[i].dev, r[i].bytes, r[i].resident);
	fclose(f);
	rename(tmp, p);
}

static struct arec *find_arec(struct arec *r, int *n, long long key, int create)
{
	for (int i = 0; i < *n; i++)
		if (r[i].key == key)
			return &r[i];
	if (!create || *n >= MAXK)
		return NULL;
	r[*n] = (struct arec){ .key = key, .bytes = 0, .dev = -1, .resident = 1 };
	return &r[(*n)++];
}

int stub_move_allocs(long long key, int sign, const int *remap, struct devs *d)
{
	static struct arec r[MAXK]; /* under lock_all */
	int n = read_arecs(r), moved = 0;
	struct arec *a = find_arec(r, &n, key, 0);

	if (!a || a->bytes <= 0)
		return 0;
	if (sign < 0 && a->resident) {
		moved = a->dev >= 0 && a->dev < d->n;
		if (moved)
			d->free_b[a->dev] += a->bytes;
		a->resident = 0;
	} else if (sign > 0 && !a->resident) {
		if (remap && a->dev >= 0 && a->dev < d->n && remap[a->dev] >= 0)
			a->dev = remap[a->dev];
		moved = a->dev >= 0 && a->dev < d->n;
		if (moved)
			d->free_b[a->dev] -= a->bytes;
		a->resident = 1;
	}
	write_arecs(r, n);
	return moved;
}

/* delta bytes for the calling process on dev: > 0 taken (refused past the free
 * bytes), < 0 given back. */
static CUresult account(int dev, long long delta)
{
	static struct arec r[MAXK]; /* under lock_all */
	struct devs d;
	long long key = stub_self_key();
	int n, fd = lock_all();
	struct arec *a;
	CUresult rc = CUDA_SUCCESS;

	read_devs(&d);
	n = read_arecs(r);
	a = find_arec(r, &n, key, delta > 0);
	if (dev < 0 || dev >= d.n)
		rc = CUDA_ERROR_INVALID_DEVICE;
	else if (!a)
		rc = delta > 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
	else if (a->bytes > 0 && a->dev != dev)
		rc = CUDA_ERROR_NOT_SUPPORTED; /* the stub keeps one device's memory per process */
	else if (delta > 0 && d.free_b[dev] < delta)
		rc = CUDA_ERROR_OUT_OF_MEMORY;
	if (rc == CUDA_SUCCESS && a) {
		a->dev = dev;
		a->bytes += delta;
		d.free_b[dev] -= delta;
		write_arecs(r, n);
		stub_write_devs(&d);
	}
	unlock_all(fd);
	return rc;
}

/* ---- this process's allocations ---- */

static struct {
	uintptr_t ptr;
	size_t len;
	int dev;
} allocs[MAXA];
static pthread_mutex_t alloc_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t alloc_owner; /* a forked child inherits the table but owns none of it */

static CUresult failed(const char *fn)
{
	long long code = control("fail", fn, getpid());

	return code >= 0 ? (CUresult)code : CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	CUresult rc = stub_hold("cuMemAlloc_v2");
	int dev = stub_current_device(), slot = -1;
	void *p;

	if (rc == CUDA_SUCCESS)
		rc = failed("cuMemAlloc_v2");
	if (rc != CUDA_SUCCESS)
		return rc;
	if (!dptr || !bytesize)
		return CUDA_ERROR_INVALID_VALUE;
	if (dev < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXA && slot < 0; i++)
		if (!allocs[i].ptr)
			slot = i;
	if (slot < 0) {
		pthread_mutex_unlock(&alloc_mu);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	/* Never-touched pages cost nothing: a pool allocated and never written,
	 * as a KV cache is, holds no host memory here. */
	p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED) {
		pthread_mutex_unlock(&alloc_mu);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	rc = account(dev, (long long)bytesize);
	if (rc != CUDA_SUCCESS) {
		munmap(p, bytesize);
	} else {
		allocs[slot].ptr = (uintptr_t)p;
		allocs[slot].len = bytesize;
		allocs[slot].dev = dev;
		alloc_owner = getpid();
		*dptr = (CUdeviceptr)(uintptr_t)p;
	}
	pthread_mutex_unlock(&alloc_mu);
	return rc;
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
	CUresult rc = stub_hold("cuMemFree_v2");

	if (rc == CUDA_SUCCESS)
		rc = failed("cuMemFree_v2");
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXA; i++) {
		if (!allocs[i].ptr || allocs[i].ptr != (uintptr_t)dptr)
			continue;
		munmap((void *)allocs[i].ptr, allocs[i].len);
		rc = account(allocs[i].dev, -(long long)allocs[i].len);
		allocs[i].ptr = 0;
		break;
	}
	pthread_mutex_unlock(&alloc_mu);
	return rc;
}

/* Copies n bytes between the host and [dptr, dptr + n), which must lie in one allocation. */
static CUresult copy(const char *fn, void *host, CUdeviceptr dptr, size_t n, int to_device)
{
	uintptr_t d = (uintptr_t)dptr;
	CUresult rc = stub_hold(fn);

	if (rc == CUDA_SUCCESS)
		rc = failed(fn);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXA; i++) {
		if (!allocs[i].ptr || d < allocs[i].ptr || n > allocs[i].len || d - allocs[i].ptr > allocs[i].len - n)
			continue;
		if (to_device)
			memcpy((void *)d, host, n);
		else
			memcpy(host, (void *)d, n);
		rc = CUDA_SUCCESS;
		break;
	}
	pthread_mutex_unlock(&alloc_mu);
	return rc;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
	return copy("cuMemcpyHtoD_v2", (void *)src, dst, n, 1);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
	return copy("cuMemcpyDtoH_v2", dst, src, n, 0);
}

CUresult cuCtxSynchronize(void)
{
	CUresult rc = stub_hold("cuCtxSynchronize");

	if (rc == CUDA_SUCCESS)
		rc = failed("cuCtxSynchronize");
	if (rc == CUDA_SUCCESS && stub_current_device() < 0)
		rc = CUDA_ERROR_INVALID_CONTEXT;
	return rc;
}

/* A process that exits gives its device memory back, as the real driver frees
 * it (what is checkpointed is not on the device: nothing to give). A process
 * killed outright cannot: StubDriver.forget_pid_namespace does it for a pod. */
__attribute__((destructor)) static void give_back(void)
{
	static struct arec r[MAXK];
	struct devs d;
	struct arec *a;
	int n, fd;

	if (alloc_owner != getpid())
		return;
	fd = lock_all();
	read_devs(&d);
	n = read_arecs(r);
	a = find_arec(r, &n, stub_self_key(), 0);
	if (a) {
		if (a->resident && a->dev >= 0 && a->dev < d.n) {
			d.free_b[a->dev] += a->bytes;
			stub_write_devs(&d);
		}
		a->bytes = 0;
		write_arecs(r, n);
	}
	unlock_all(fd);
}
