/* dynsnap-cuda's actions: the queries CRIU's plugin makes (--get-state, --get-restore-tid) and the
 * driver calls of --action with what is read around them. Everything that can refuse (the GPU
 * map, the free-memory check) is checked before the first state change. Calls phases.c,
 * memory.c, output.c, driver.c and diag.c. */
#define _GNU_SOURCE
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "dynsnap-cuda.h"

/* What one action reads around its driver calls. */
struct around {
	long long free_before[MAX_DEVS], need[MAX_DEVS];
	signed char src_before[MAX_DEVS];
	int restore_sampled; /* the free-memory check read free_before */
	int sampled;         /* a checkpoint read free_before: measure what it freed */
	int rolled_back;     /* a save's locks were undone */
};

int query(const struct cli *c)
{
	int fails = 0;

	for (int i = 0; i < njobs; i++) {
		CUresult r;
		int st = -1, tid = 0;

		r = c->get_st ? get_state(jobs[i].pid, &st) : get_restore_tid(jobs[i].pid, &tid);
		if (r != CUDA_SUCCESS) {
			diag("%s pid %d: %s (%d)", c->get_st ? "get-state" : "get-restore-tid",
			     jobs[i].pid, errname(r), (int)r);
			fails++;
			continue;
		}
		/* One pid prints the bare word, exactly as CRIU's plugin
		 * parses it; several print "pid value" lines. */
		if (njobs > 1)
			printf("%d ", jobs[i].pid);
		if (c->get_st)
			printf("%s\n", state_word(st));
		else
			printf("%d\n", tid);
	}
	return fails ? EXIT_FAILED : EXIT_OK;
}

/* --gpu-map into opt.pairs, against this process's own enumeration. 0, or EXIT_USAGE. */
static int resolve_map(const char *map)
{
	char err[512];

	if (enumerate_devices()) {
		diag("cannot enumerate GPUs to resolve --gpu-map");
		return EXIT_USAGE;
	}
	opt.npairs = gpumap_parse(map, dev_uuid, ndev, opt.pairs, GPUMAP_MAX, err, sizeof(err));
	if (opt.npairs < 0) {
		diag("invalid --gpu-map '%s': %s", map, err);
		return EXIT_USAGE;
	}
	return 0;
}

/* Before a restore: does each target GPU have what the checkpoint freed (or --need-bytes)?
 * Returns 0, or EXIT_NOMEM after reporting the refusal (no process touched). */
static int check_free_memory(const struct cli *c, struct around *a)
{
	int have = read_records(a->need);

	if (c->need_bytes >= 0) {
		have = 1;
		for (int d = 0; d < ndev; d++)
			a->need[d] = c->need_bytes;
	}
	if (!have)
		return 0;
	sample_free(a->free_before, a->src_before);
	a->restore_sampled = 1;
	for (int d = 0; d < ndev; d++) {
		long long free_b = a->free_before[d], need = a->need[d];
		char u[64];

		if (need <= 0 || free_b < 0 || free_b >= need)
			continue;
		gpu_uuid_format(&dev_uuid[d], u, sizeof(u));
		snprintf(refusal, sizeof(refusal),
			 "refused: GPU %d (%s) has %lld MiB free, the process needs %lld MiB", d, u,
			 free_b >> 20, need >> 20);
		diag("refusing %s: GPU %d (%s) has %lld MiB free, the process needs %lld MiB (--force to override)",
		     c->action, d, u, free_b >> 20, need >> 20);
		for (int i = 0; i < njobs; i++)
			jobs[i].state_after = jobs[i].state_before;
		if (c->json)
			print_json(c->action);
		return EXIT_NOMEM;
	}
	return 0;
}

/* save: every lock before any checkpoint. A rank checkpointed while a peer still runs can strand
 * a collective mid-flight. Returns the number of failures. */
static int run_save(struct around *a, int have_dev)
{
	int fails = run_phase(OP_LOCK, NULL, 0);

	mark("lock");
	if (fails) {
		int locked[MAX_PIDS];

		/* A pid left locked is a hung workload: worse than a failed
		 * capture. Undo the locks that were taken. */
		for (int i = 0; i < njobs; i++)
			locked[i] = jobs[i].err_op == OP_NONE;
		run_phase(OP_UNLOCK, locked, 0);
		a->rolled_back = 1;
		return fails;
	}
	if (have_dev) {
		sample_free(a->free_before, a->src_before);
		a->sampled = 1;
	}
	/* A failed checkpoint stops and leaves the locks: pids already
	 * checkpointed can only be recovered by a restore the caller
	 * drives. */
	fails = run_phase(OP_CHECKPOINT, NULL, 1);
	mark("checkpoint");
	return fails;
}

/* The action's driver calls. Returns the number of failures. */
static int run_calls(const struct cli *c, struct around *a, int have_dev)
{
	int fails;

	if (c->second == OP_CHECKPOINT)
		return run_save(a, have_dev);
	if (c->first == OP_CHECKPOINT && have_dev) {
		sample_free(a->free_before, a->src_before);
		a->sampled = 1;
	}
	fails = run_phase(c->first, NULL, 0);
	mark(op_name[c->first]);
	if (!fails && c->second != OP_NONE) {
		fails = run_phase(c->second, NULL, 0);
		mark(op_name[c->second]);
	}
	return fails;
}

/* After a checkpoint: what it freed on each GPU, recorded for the restore's check. */
static void record_freed(const struct cli *c, struct around *a)
{
	long long free_after[MAX_DEVS], freed[MAX_DEVS], total = 0;
	signed char src_after[MAX_DEVS];
	char group[64];

	sample_free(free_after, src_after);
	/* NVML and CUDA do not agree on free bytes (on the H200, inside
	 * the helper's own context cuMemGetInfo said 523 MiB less than
	 * NVML), so a difference is only taken between two readings of
	 * one source. */
	for (int d = 0; d < ndev; d++) {
		freed[d] = a->free_before[d] >= 0 && free_after[d] >= 0 && a->src_before[d] == src_after[d] ?
				   free_after[d] - a->free_before[d] :
				   0;
		if (freed[d] > 0)
			total += freed[d];
	}
	snprintf(group, sizeof(group), "%d-%ld", (int)getpid(), (long)time(NULL));
	write_records(group, freed);
	if (njobs == 1)
		jobs[0].bytes = total;
	if (c->json)
		gpus_line(a->free_before, a->src_before, free_after, src_after);
}

int act(const struct cli *c)
{
	struct around a = { .need = { 0 } };
	int is_restore = c->first == OP_RESTORE, is_ckpt, have_dev, restore_line, fails, rc;

	if (c->map && (rc = resolve_map(c->map)))
		return rc;
	for (int i = 0; i < njobs; i++)
		get_state(jobs[i].pid, &jobs[i].state_before);
	mark("state before");
	if (is_restore && !c->force && !c->skip_mem && enumerate_devices() == 0 &&
	    (rc = check_free_memory(c, &a)))
		return rc;
	is_ckpt = c->first == OP_CHECKPOINT || c->second == OP_CHECKPOINT;
	have_dev = is_ckpt && !c->skip_mem && enumerate_devices() == 0;
	/* The "gpus" line of a restore: its reading before (the free-memory
	 * check's, or one now) and one after. */
	restore_line = is_restore && c->json && !c->skip_mem && enumerate_devices() == 0;
	if (restore_line && !a.restore_sampled)
		sample_free(a.free_before, a.src_before);
	mark("free memory before");

	fails = run_calls(c, &a, have_dev);
	/* No reading after a save whose locks were rolled back: nothing was
	 * read before it, and nothing was freed. */
	if (a.sampled && !jobs[0].skipped)
		record_freed(c, &a);
	if (restore_line) {
		long long free_after[MAX_DEVS];
		signed char src_after[MAX_DEVS];

		sample_free(free_after, src_after);
		gpus_line(a.free_before, a.src_before, free_after, src_after);
	}
	if (is_restore) {
		for (int d = 0; d < ndev && njobs == 1; d++)
			if (a.need[d] > 0)
				jobs[0].bytes = (jobs[0].bytes < 0 ? 0 : jobs[0].bytes) + a.need[d];
		if (!fails)
			drop_records();
	}
	mark("free memory after");
	for (int i = 0; i < njobs; i++)
		get_state(jobs[i].pid, &jobs[i].state_after);
	mark("state after");
	if (c->json)
		print_json(c->action);
	mark("printed");
	if (fails) {
		report_failure(c->action, a.rolled_back ? "locks rolled back" : NULL);
		return EXIT_FAILED;
	}
	return EXIT_OK;
}
