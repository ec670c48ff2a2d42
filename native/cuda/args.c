/* dynsnap-cuda's command line, read with getopt_long. The options CRIU's CUDA plugin uses
 * (`-h` listing --action, --get-state, --get-restore-tid, --action, --pid, --timeout) keep their
 * spelling and meaning; a bad argument is a one-line diagnostic and exit 2 before any driver call.
 * Fills the pid table and the call options (phases.c). Calls only diag.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dynsnap-cuda.h"

enum { OPT_ACTION = 256, OPT_GET_STATE, OPT_GET_TID, OPT_MEM_INFO, OPT_MAP, OPT_NEED_BYTES, OPT_FORCE,
       OPT_SKIP_MEM, OPT_SERIAL, OPT_JSON };

static const struct option options[] = {
	{ "action", required_argument, NULL, OPT_ACTION },
	{ "get-state", no_argument, NULL, OPT_GET_STATE },
	{ "get-restore-tid", no_argument, NULL, OPT_GET_TID },
	{ "mem-info", no_argument, NULL, OPT_MEM_INFO },
	{ "pid", required_argument, NULL, 'p' },
	{ "timeout", required_argument, NULL, 't' },
	{ "gpu-map", required_argument, NULL, OPT_MAP },
	{ "device-map", required_argument, NULL, OPT_MAP },
	{ "need-bytes", required_argument, NULL, OPT_NEED_BYTES },
	{ "force", no_argument, NULL, OPT_FORCE },
	{ "skip-mem", no_argument, NULL, OPT_SKIP_MEM },
	{ "serial", no_argument, NULL, OPT_SERIAL },
	{ "json", no_argument, NULL, OPT_JSON },
	{ "help", no_argument, NULL, 'h' },
	{ NULL, 0, NULL, 0 },
};

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

		long long start = -1;
		int bad_start = 0;

		while (*tok == ' ')
			tok++;
		errno = 0;
		v = strtol(tok, &end, 10);
		if (!errno && *end == '@') { /* PID@START: acted on only while it is that process */
			char *s2 = end + 1, *e2;
			start = strtoll(s2, &e2, 10);
			bad_start = errno || e2 == s2 || start < 0;
			end = e2;
		}
		while (*end == ' ')
			end++;
		if (errno || bad_start || end == tok || *end || v <= 0 || v > INT_MAX) {
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
		jobs[njobs].start = start;
		jobs[njobs++].pid = (int)v;
	}
	free(copy);
	return rc;
}

void usage(FILE *f)
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
		"  -p, --pid PIDS        pid or comma list; repeatable; all handled by this process;\n"
		"                        PID@START: acted on only while that pid's start time (stat\n"
		"                        field 22) is START, checked right before each driver call\n"
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


static int parse_timeout(const char *v)
{
	char *end;
	unsigned long t;

	errno = 0;
	t = strtoul(v, &end, 10);
	if (errno || !*v || *end || t > UINT_MAX || v[0] == '-') {
		diag("invalid --timeout '%s'", v);
		return -1;
	}
	opt.timeout_ms = (unsigned int)t;
	return 0;
}

static int parse_need_bytes(struct cli *c, const char *v)
{
	char *end;

	c->need_bytes = strtoll(v, &end, 10);
	if (!*v || *end || c->need_bytes < 0) {
		diag("invalid --need-bytes '%s'", v);
		return -1;
	}
	return 0;
}

/* One option. Returns -1 to go on, else the exit code. */
static int take_option(struct cli *c, int o, const char *v, int *timeout_set)
{
	switch (o) {
	case 'h': usage(stdout); return EXIT_OK;
	case OPT_ACTION: c->action = v; break;
	case OPT_GET_STATE: c->get_st = 1; break;
	case OPT_GET_TID: c->get_tid = 1; break;
	case OPT_MEM_INFO: c->mem_info = 1; break;
	case 'p': return add_pids(v) ? EXIT_USAGE : -1;
	case 't':
		*timeout_set = 1;
		return parse_timeout(v) ? EXIT_USAGE : -1;
	case OPT_MAP: c->map = v; break;
	case OPT_NEED_BYTES: return parse_need_bytes(c, v) ? EXIT_USAGE : -1;
	case OPT_FORCE: c->force = 1; break;
	case OPT_SKIP_MEM: c->skip_mem = 1; break;
	case OPT_SERIAL: opt.serial = 1; break;
	case OPT_JSON: c->json = 1; break;
	}
	return -1;
}

/* The options, in any order. Returns -1 to go on, else the exit code. */
static int parse_options(struct cli *c, int argc, char **argv, int *timeout_set)
{
	int o, rc;

	opterr = 0; /* our own one-line messages */
	while ((o = getopt_long(argc, argv, ":hp:t:", options, NULL)) != -1) {
		if (o == ':') {
			diag("%s needs a value", argv[optind - 1]);
			return EXIT_USAGE;
		}
		if (o == '?') {
			if (optopt && optopt < OPT_ACTION)
				diag("unknown argument '-%c' (see --help)", optopt);
			else
				diag("unknown argument '%s' (see --help)", argv[optind - 1]);
			return EXIT_USAGE;
		}
		if ((rc = take_option(c, o, optarg, timeout_set)) >= 0)
			return rc;
	}
	if (optind < argc) { /* getopt_long moved the words that are no option here */
		diag("unknown argument '%s' (see --help)", argv[optind]);
		return EXIT_USAGE;
	}
	return -1;
}

/* The action's driver calls into c->first and c->second. 0, or -1 for an unknown action. */
static int parse_action(struct cli *c)
{
	static const struct { const char *name; enum op first, second; } actions[] = {
		{ "lock", OP_LOCK, OP_NONE },	     { "checkpoint", OP_CHECKPOINT, OP_NONE },
		{ "restore", OP_RESTORE, OP_NONE },  { "unlock", OP_UNLOCK, OP_NONE },
		{ "save", OP_LOCK, OP_CHECKPOINT }, { "resume", OP_RESTORE, OP_UNLOCK },
	};

	for (size_t i = 0; i < sizeof(actions) / sizeof(actions[0]); i++)
		if (!strcmp(c->action, actions[i].name)) {
			c->first = actions[i].first;
			c->second = actions[i].second;
			return 0;
		}
	diag("unknown action '%s'", c->action);
	return -1;
}

int parse_args(struct cli *c, int argc, char **argv)
{
	int timeout_set = 0, rc;

	*c = (struct cli){ .first = OP_NONE, .second = OP_NONE, .need_bytes = -1 };
	if ((rc = parse_options(c, argc, argv, &timeout_set)) >= 0)
		return rc;
	if (c->get_st + c->get_tid + c->mem_info + (c->action != NULL) != 1) {
		diag("give exactly one of --action, --get-state, --get-restore-tid, --mem-info");
		return EXIT_USAGE;
	}
	if (c->mem_info) {
		if (njobs) {
			diag("--mem-info takes no --pid");
			return EXIT_USAGE;
		}
		return -1;
	}
	if (!njobs) {
		diag("--pid is required");
		return EXIT_USAGE;
	}
	if (!c->action)
		return -1;
	if (parse_action(c))
		return EXIT_USAGE;
	if (c->map && c->first != OP_RESTORE) {
		diag("--gpu-map ignored for %s: it applies to restore and resume", c->action);
		c->map = NULL;
	}
	/* A save that cannot get every lock must give up and roll back
	 * rather than wait forever on a busy rank. */
	if (!timeout_set && !strcmp(c->action, "save"))
		opt.timeout_ms = 10000;
	return -1;
}
