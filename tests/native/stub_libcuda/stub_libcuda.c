/* stub_libcuda: stands in for the NVIDIA driver's libcuda checkpoint API in
 * dynsnap-cuda's tests (there is no GPU where they run).
 *
 * It follows the driver's per-process state machine
 * (running -lock-> locked -checkpoint-> checkpointed -restore-> locked
 * -unlock-> running; anything else is CUDA_ERROR_ILLEGAL_STATE), keeps that
 * state per pid in a file so separate invocations see it, records every call
 * in order, and fakes device enumeration and free memory. All of it lives in
 * $DYNSNAP_STUB_DIR, shared with ../stub_nvml (stub_files.h reads it):
 *
 *   state     "key state" lines (key: the pid, or see nskey; 0 running, 1 locked,
 *             2 checkpointed, 3 failed)
 *   log       one line per call, appended when the call returns:
 *               <function> pid=<pid> [timeout=<ms>] [pairs=<old>><new>;...] rc=<code>
 *             for the checkpoint API, and for the calls that read free
 *             memory (cuDevicePrimaryCtxRetain/Release, cuMemGetInfo, and
 *             stub_nvml's nvml* calls):
 *               <function> [dev=<index>] [uuid=<uuid>] rc=<code>
 *   devices   "<uuid hex> <free bytes> <total bytes>" per visible GPU
 *             (absent: one GPU, uuid 11..11, 80 GiB free of 80 GiB)
 *   control   directives, read on every call:
 *               fail <function> <pid|*> <code>   return <code>, state unchanged
 *               hang <function> <pid|*> <ms>     sleep first; a lock with a
 *                                                shorter timeout returns
 *                                                CUDA_ERROR_NOT_READY instead
 *               nocuda <pid>                     pid holds no CUDA context
 *               mem <pid> <device> <bytes>       checkpoint frees, restore
 *                                                takes, that much on a device
 *               nvmlskew <device> <bytes>        stub_nvml reports that much
 *                                                less free than cuMemGetInfo
 *               nskey 0                          key state by (pid namespace,
 *                                                pid in it): survives an
 *                                                in-place CRIU restore
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "stub_files.h"

#define MAXP 1024

static __thread int cur_dev = -1;

static int nocuda(int pid)
{
	return control_keyed("nocuda", pid, NULL, 0);
}

static long long mem_of(int pid, int *devp)
{
	long long v[2];

	if (!control_keyed("mem", pid, v, 2)) {
		*devp = -1;
		return 0;
	}
	*devp = (int)v[0];
	return v[1];
}

/* With a line "nskey 0" in control, per-pid state is keyed by the process's
 * pid namespace and its pid there instead of its host pid. The real driver keeps
 * a process's checkpoint state inside the process, so it survives an in-place
 * CRIU dump and restore (same namespace, same in-namespace pid, a new host pid);
 * keyed this way, the stub's state does too. A pid with no /proc entry (the CLI
 * tests' made-up pids) keeps its own number. */
static long long state_key(int pid)
{
	char p[64], line[256];
	struct stat st;
	long long nspid = -1;
	FILE *f;

	if (!control_keyed("nskey", 0, NULL, 0))
		return pid;
	snprintf(p, sizeof(p), "/proc/%d/ns/pid", pid);
	if (stat(p, &st))
		return pid;
	snprintf(p, sizeof(p), "/proc/%d/status", pid);
	f = fopen(p, "r");
	if (!f)
		return pid;
	while (fgets(line, sizeof(line), f)) {
		char *tok, *save = NULL;

		if (strncmp(line, "NSpid:", 6))
			continue;
		for (tok = strtok_r(line + 6, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save))
			nspid = atoll(tok);
	}
	fclose(f);
	if (nspid < 0)
		return pid;
	return (long long)(st.st_ino << 22) | nspid; /* pid_max is at most 2^22 */
}

static int read_state(int pid)
{
	char p[4096];
	long long q, key = state_key(pid);
	int s, st = CU_PROCESS_STATE_RUNNING;
	FILE *f;

	path(p, sizeof(p), "state");
	f = fopen(p, "r");
	if (!f)
		return st;
	while (fscanf(f, "%lld %d", &q, &s) == 2)
		if (q == key)
			st = s;
	fclose(f);
	return st;
}

static void write_state(int pid, int st)
{
	char p[4096], tmp[4200];
	long long keys[MAXP], q, key = state_key(pid);
	int sts[MAXP], n = 0, s, found = 0;
	FILE *f;

	path(p, sizeof(p), "state");
	f = fopen(p, "r");
	if (f) {
		while (n < MAXP && fscanf(f, "%lld %d", &q, &s) == 2) {
			if (q == key) {
				s = st;
				found = 1;
			}
			keys[n] = q;
			sts[n++] = s;
		}
		fclose(f);
	}
	if (!found && n < MAXP) {
		keys[n] = key;
		sts[n++] = st;
	}
	snprintf(tmp, sizeof(tmp), "%s.tmp", p);
	f = fopen(tmp, "w");
	if (!f)
		return;
	for (int i = 0; i < n; i++)
		fprintf(f, "%lld %d\n", keys[i], sts[i]);
	fclose(f);
	rename(tmp, p);
}

static void write_devs(const struct devs *d)
{
	char p[4096], tmp[4200];
	FILE *f;

	path(p, sizeof(p), "devices");
	snprintf(tmp, sizeof(tmp), "%s.tmp", p);
	f = fopen(tmp, "w");
	if (!f)
		return;
	for (int i = 0; i < d->n; i++) {
		for (int b = 0; b < 16; b++)
			fprintf(f, "%02x", d->uuid[i][b]);
		fprintf(f, " %lld %lld\n", d->free_b[i], d->total_b[i]);
	}
	fclose(f);
	rename(tmp, p);
}

/* Moves a pid's recorded GPU memory: sign -1 frees it (checkpoint), +1
 * takes it back (restore) on dev (remapped target), or its own device. */
static void move_mem(int pid, int sign, int target)
{
	struct devs d;
	int dev;
	long long b = mem_of(pid, &dev);

	if (!b)
		return;
	read_devs(&d);
	if (target >= 0)
		dev = target;
	if (dev < 0 || dev >= d.n)
		return;
	d.free_b[dev] -= sign * b;
	write_devs(&d);
}

static void hang(const char *fn, int pid, unsigned int timeout_ms, int *timed_out)
{
	long long ms = control("hang", fn, pid);

	*timed_out = 0;
	if (ms <= 0)
		return;
	if (timeout_ms && ms > timeout_ms) {
		usleep(timeout_ms * 1000u);
		*timed_out = 1;
		return;
	}
	usleep((useconds_t)ms * 1000u);
}

/* One transition: check the injected faults, then the state machine. */
static CUresult transition(const char *fn, int pid, int from, int to, unsigned int timeout_ms,
			   const char *extra, int mem_sign, int mem_target)
{
	int timed_out, fd;
	long long code;
	CUresult rc = CUDA_SUCCESS;

	hang(fn, pid, timeout_ms, &timed_out);
	fd = lock_all();
	code = control("fail", fn, pid);
	/* The H200's driver (580.159.04) answers a lock that ran out of time
	 * with CUDA_ERROR_NOT_READY, not CUDA_ERROR_TIMEOUT. */
	if (timed_out)
		rc = CUDA_ERROR_NOT_READY;
	else if (code >= 0)
		rc = (CUresult)code;
	else if (nocuda(pid))
		rc = CUDA_ERROR_NOT_FOUND;
	else if (read_state(pid) != from)
		rc = CUDA_ERROR_ILLEGAL_STATE;
	if (rc == CUDA_SUCCESS) {
		write_state(pid, to);
		if (mem_sign)
			move_mem(pid, mem_sign, mem_target);
	}
	if (timeout_ms)
		logline("%s pid=%d timeout=%u%s rc=%d", fn, pid, timeout_ms, extra, (int)rc);
	else
		logline("%s pid=%d%s rc=%d", fn, pid, extra, (int)rc);
	unlock_all(fd);
	return rc;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
	return transition("cuCheckpointProcessLock", pid, CU_PROCESS_STATE_RUNNING,
			  CU_PROCESS_STATE_LOCKED, args ? args->timeoutMs : 0, "", 0, -1);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
	(void)args;
	return transition("cuCheckpointProcessCheckpoint", pid, CU_PROCESS_STATE_LOCKED,
			  CU_PROCESS_STATE_CHECKPOINTED, 0, "", -1, -1);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
	char extra[2048] = "";
	int target = -1;

	if (args && args->gpuPairsCount) {
		struct devs d;
		size_t off;

		read_devs(&d);
		off = (size_t)snprintf(extra, sizeof(extra), " pairs=");
		for (unsigned i = 0; i < args->gpuPairsCount && off < sizeof(extra) - 80; i++) {
			const CUcheckpointGpuPair *p = &args->gpuPairs[i];
			int found = -1;

			for (int b = 0; b < 16; b++)
				off += (size_t)snprintf(extra + off, sizeof(extra) - off, "%02x",
							(unsigned char)p->oldUuid.bytes[b]);
			extra[off++] = '>';
			for (int b = 0; b < 16; b++)
				off += (size_t)snprintf(extra + off, sizeof(extra) - off, "%02x",
							(unsigned char)p->newUuid.bytes[b]);
			extra[off++] = ';';
			extra[off] = '\0';
			for (int k = 0; k < d.n; k++)
				if (!memcmp(d.uuid[k], p->newUuid.bytes, 16))
					found = k;
			/* The real driver refuses a pair naming a GPU it cannot see. */
			if (found < 0) {
				logline("cuCheckpointProcessRestore pid=%d%s rc=%d", pid, extra,
					CUDA_ERROR_INVALID_VALUE);
				return CUDA_ERROR_INVALID_VALUE;
			}
			/* The pid's memory moves to the target of its device's pair. */
			{
				int memdev;

				mem_of(pid, &memdev);
				if (memdev >= 0 && memdev < d.n && !memcmp(d.uuid[memdev], p->oldUuid.bytes, 16))
					target = found;
			}
		}
	}
	return transition("cuCheckpointProcessRestore", pid, CU_PROCESS_STATE_CHECKPOINTED,
			  CU_PROCESS_STATE_LOCKED, 0, extra, +1, target);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
	(void)args;
	return transition("cuCheckpointProcessUnlock", pid, CU_PROCESS_STATE_LOCKED,
			  CU_PROCESS_STATE_RUNNING, 0, "", 0, -1);
}

CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
	long long code = control("fail", "cuCheckpointProcessGetState", pid);
	int fd;

	if (code >= 0)
		return (CUresult)code;
	if (nocuda(pid))
		return CUDA_ERROR_NOT_FOUND;
	fd = lock_all();
	*state = (CUprocessState)read_state(pid);
	unlock_all(fd);
	return CUDA_SUCCESS;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
	long long code = control("fail", "cuCheckpointProcessGetRestoreThreadId", pid);

	if (code >= 0)
		return (CUresult)code;
	if (nocuda(pid))
		return CUDA_ERROR_NOT_FOUND;
	*tid = pid + 1000;
	return CUDA_SUCCESS;
}

/* ---- device enumeration and memory ---- */

CUresult cuInit(unsigned int flags)
{
	long long code = control("fail", "cuInit", 0);

	(void)flags;
	return code >= 0 ? (CUresult)code : CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
	struct devs d;
	long long code = control("fail", "cuDeviceGetCount", 0);

	if (code >= 0)
		return (CUresult)code;
	read_devs(&d);
	*count = d.n;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
	struct devs d;

	read_devs(&d);
	if (ordinal < 0 || ordinal >= d.n)
		return CUDA_ERROR_INVALID_DEVICE;
	*dev = ordinal;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	struct devs d;

	read_devs(&d);
	if (dev < 0 || dev >= d.n)
		return CUDA_ERROR_INVALID_DEVICE;
	memcpy(uuid->bytes, d.uuid[dev], 16);
	return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
	long long code = control("fail", "cuDevicePrimaryCtxRetain", dev);
	CUresult rc = code >= 0 ? (CUresult)code : CUDA_SUCCESS;

	if (rc == CUDA_SUCCESS)
		*ctx = (CUcontext)(uintptr_t)(dev + 1);
	logline("cuDevicePrimaryCtxRetain dev=%d rc=%d", dev, (int)rc);
	return rc;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
	logline("cuDevicePrimaryCtxRelease dev=%d rc=0", dev);
	return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
	cur_dev = ctx ? (int)(uintptr_t)ctx - 1 : -1;
	return CUDA_SUCCESS;
}

CUresult cuMemGetInfo(size_t *free_b, size_t *total_b)
{
	struct devs d;
	long long code = control("fail", "cuMemGetInfo", 0);
	CUresult rc = CUDA_SUCCESS;
	int fd;

	fd = lock_all();
	read_devs(&d);
	unlock_all(fd);
	if (code >= 0) {
		rc = (CUresult)code;
	} else if (cur_dev < 0 || cur_dev >= d.n) {
		rc = CUDA_ERROR_INVALID_CONTEXT;
	} else {
		*free_b = (size_t)d.free_b[cur_dev];
		*total_b = (size_t)d.total_b[cur_dev];
	}
	logline("cuMemGetInfo dev=%d rc=%d", cur_dev, (int)rc);
	return rc;
}

CUresult cuGetErrorName(CUresult error, const char **str)
{
	switch (error) {
	case CUDA_SUCCESS:
		*str = "CUDA_SUCCESS";
		break;
	case CUDA_ERROR_INVALID_VALUE:
		*str = "CUDA_ERROR_INVALID_VALUE";
		break;
	case CUDA_ERROR_ILLEGAL_STATE:
		*str = "CUDA_ERROR_ILLEGAL_STATE";
		break;
	case CUDA_ERROR_NOT_FOUND:
		*str = "CUDA_ERROR_NOT_FOUND";
		break;
	case CUDA_ERROR_TIMEOUT:
		*str = "CUDA_ERROR_TIMEOUT";
		break;
	case CUDA_ERROR_NOT_READY:
		*str = "CUDA_ERROR_NOT_READY";
		break;
	case CUDA_ERROR_OUT_OF_MEMORY:
		*str = "CUDA_ERROR_OUT_OF_MEMORY";
		break;
	default:
		*str = "CUDA_ERROR_UNKNOWN";
		return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}
