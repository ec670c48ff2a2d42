/* dynsnap-cuda's stdout: the --json records (one per pid, then the GPUs' free memory around the
 * call), the one-line reason of a failure on stderr, and --mem-info. Calls memory.c, driver.c and
 * diag.c. */
#define _GNU_SOURCE
#include <stdio.h>

#include "dynsnap-cuda.h"

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

void gpus_line(const long long *before, const signed char *src_before, const long long *after,
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
char refusal[256];

void print_json(const char *action)
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
void report_failure(const char *action, const char *what)
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
int print_mem_info(void)
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
