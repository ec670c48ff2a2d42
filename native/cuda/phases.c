/* dynsnap-cuda's driver calls on its pids: lock, checkpoint, restore, unlock, each timed, the first
 * failure of each pid kept; a phase runs one call on every pid, in parallel threads by default.
 * Calls only driver.c. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dynsnap-cuda.h"

const char *const op_name[4] = { "lock", "checkpoint", "restore", "unlock" };
struct opt opt;
struct job jobs[MAX_PIDS];
int njobs;

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void jobs_reset(void)
{
	for (int i = 0; i < njobs; i++) {
		for (int o = 0; o < 4; o++)
			jobs[i].ms[o] = -1;
		jobs[i].err_op = OP_NONE;
		jobs[i].bytes = -1;
		jobs[i].state_before = jobs[i].state_after = -1;
	}
}

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

/* Field 22 of /proc/<pid>/stat (the start time), -1 when it cannot be read (the process is gone). */
static long long start_of(int pid)
{
	char path[64], buf[4096];
	long long v = -1;
	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	char *p = strrchr(buf, ')'); /* comm may hold anything: the fields after it start at the last ')' */
	if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %lld",
			  &v) != 1)
		return -1;
	return v;
}

CUresult do_op(struct job *j, enum op op)
{
	double t0 = now_ms();
	CUresult r;

	/* The pid pinned from the caller's look to this act: another process at it now (the one checked
	 * exited, its pid reused) is never handed to the driver. */
	if (j->start >= 0) {
		long long now = start_of(j->pid);
		if (now != j->start) {
			diag("pid %d is not the process checked (started at %lld, not %lld): not acted on", j->pid, now,
			     j->start);
			r = CUDA_ERROR_NOT_FOUND;
			goto done;
		}
	}
	r = call_op(j, op);

	if (retry_after_init(r))
		r = call_op(j, op);
done:
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
int run_phase(enum op op, const int *sel, int stop_on_fail)
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
