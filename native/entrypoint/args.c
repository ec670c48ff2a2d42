/*
 * The entrypoint's command line (getopt_long; options stop at the first word that is not one, or
 * at "--": the rest is the worker's command) and what follows from it: the huge-page library to
 * preload and the command line as the control file reports it. Bad arguments exit 2 with the
 * reason and the usage text. Calls only common.c.
 */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "entrypoint.h"

#define EXIT_USAGE 2
/* kubelet keeps its own copy of our stdout; this file only has to bridge the
 * gap, and it usually lives on an emptyDir that may have a size limit. */
#define LOG_MAX_BYTES_DEFAULT (64LL << 20)

enum { OPT_CONTROL_DIR = 256, OPT_LOG_FILE, OPT_LOG_MAX, OPT_PROBE_PORT, OPT_SYSTEM_PORT, OPT_NO_SECCOMP,
       OPT_NO_PID_CYCLE, OPT_THP, OPT_NO_THP };

static const struct option options[] = {
	{ "control-dir", required_argument, NULL, OPT_CONTROL_DIR },
	{ "log-file", required_argument, NULL, OPT_LOG_FILE },
	{ "log-max-bytes", required_argument, NULL, OPT_LOG_MAX },
	{ "probe-port", required_argument, NULL, OPT_PROBE_PORT },
	{ "system-port", required_argument, NULL, OPT_SYSTEM_PORT },
	{ "no-seccomp", no_argument, NULL, OPT_NO_SECCOMP },
	{ "no-pid-cycle", no_argument, NULL, OPT_NO_PID_CYCLE },
	{ "thp-preload", required_argument, NULL, OPT_THP },
	{ "no-thp-preload", no_argument, NULL, OPT_NO_THP },
	{ "help", no_argument, NULL, 'h' },
	{ NULL, 0, NULL, 0 },
};

/* What the options said, before the checks that need all of them. */
struct args {
	const char *sysport, *log, *thp;
	bool thp_off;
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: dynsnap-entrypoint [options] [--] COMMAND [ARG...]\n"
		"Runs COMMAND (a Dynamo worker) as the child of a standby-aware PID 1.\n"
		"  --control-dir DIR   directory shared with the dynsnap agent (default %s)\n"
		"  --log-file PATH     worker stdout+stderr, copied to our stdout (default DIR/%s)\n"
		"  --log-max-bytes N   empty the log file past N bytes, once copied (default %lld; 0: never)\n"
		"  --probe-port N      port for /live and /health (default %d)\n"
		"  --system-port N     the worker's system port (default $DYN_SYSTEM_PORT)\n"
		"  --no-seccomp        do not refuse io_uring to the worker\n"
		"  --no-pid-cycle      reserve the pid range only by writing ns_last_pid, never by\n"
		"                      starting and reaping short-lived children\n"
		"  --thp-preload PATH  put this huge-page library first in the worker's LD_PRELOAD\n"
		"                      (default: %s next to this program, if there; $%s=PATH)\n"
		"  --no-thp-preload    do not preload it ($%s=off)\n"
		"  -h, --help          this text\n",
		DYNSNAP_CONTROL_DIR_DEFAULT, DYNSNAP_LOG_FILE, LOG_MAX_BYTES_DEFAULT,
		DYNSNAP_PROBE_PORT_DEFAULT, THP_LIBRARY, THP_PRELOAD_ENV, THP_PRELOAD_ENV);
}

static void __attribute__((noreturn, format(printf, 1, 2))) usage_error(const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "dynsnap-entrypoint: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n");
	usage(stderr);
	exit(EXIT_USAGE);
}

static const char *option_name(int val)
{
	static char name[40];
	for (const struct option *o = options; o->name; o++)
		if (o->val == val) {
			snprintf(name, sizeof(name), "--%s", o->name);
			return name;
		}
	return "option";
}

static int parse_port(const char *opt, const char *s)
{
	char *end;
	long v;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < 1 || v > 65535)
		usage_error("%s: not a port number: \"%s\"", opt, s);
	return (int)v;
}

/*
 * Which huge-page library the worker preloads (ep->thp_preload, empty: none).
 *
 * Why by default: at a checkpoint the CUDA driver copies the worker's GPU memory into a mapping it
 * makes with MAP_POPULATE inside the worker, faulted in 4 KiB at a time where the node's THP
 * setting is `madvise` (the usual one). libdynsnap-thp.so, loaded in the worker, makes that one
 * mapping on huge pages instead (native/thp/dynsnap-thp.c says how, and what else it leaves alone):
 * on the H200 a 16 GiB worker saved 1.43x and resumed 1.27x faster, without the node's setting
 * changing (docs/BENCHMARKS.md). Only the worker can ask for its own huge pages, hence the preload.
 *
 * `want` is the path from --thp-preload or $DYNSNAP_THP_PRELOAD, or NULL for the default: the
 * library next to this binary (the init container copies both), silently none when it is not
 * there. A path that was asked for and cannot be read is loud but not fatal: the worker still
 * serves, only its checkpoints are slower.
 */
static void thp_setup(struct ep *ep, const char *want)
{
	char self[PATH_MAX];
	ssize_t n;

	ep->thp_preload[0] = '\0';
	if (want) {
		if (access(want, R_OK) != 0) {
			ep_log("WARNING: HUGE-PAGE LIBRARY NOT PRELOADED: %s: %s. The worker runs without it; "
			       "its CUDA checkpoints land on 4 KiB pages and take longer.", want, strerror(errno));
			return;
		}
		snprintf(ep->thp_preload, sizeof(ep->thp_preload), "%s", want);
		return;
	}
	n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n <= 0 || (size_t)n + sizeof(THP_LIBRARY) >= sizeof(self))
		return;
	self[n] = '\0';
	*(strrchr(self, '/') + 1) = '\0'; /* the kernel's path of an executable is absolute */
	if ((size_t)snprintf(ep->thp_preload, sizeof(ep->thp_preload), "%s%s", self, THP_LIBRARY) >=
	    sizeof(ep->thp_preload) || access(ep->thp_preload, R_OK) != 0)
		ep->thp_preload[0] = '\0';
}

/* The worker's command line joined by spaces, as far as the control file carries it. */
static void join_command(struct ep *ep)
{
	size_t n = 0, cap = sizeof(ep->worker_command) - 1;

	for (char **a = ep->argv; *a && n < cap; a++) {
		if (a != ep->argv)
			ep->worker_command[n++] = ' ';
		for (const char *s = *a; *s && n < cap; s++)
			ep->worker_command[n++] = *s;
	}
	ep->worker_command[n] = '\0';
}

/* One option with its value (NULL for a flag). */
static void take_option(struct ep *ep, struct args *a, int opt, const char *val)
{
	if (val && !*val)
		usage_error("%s needs a value", option_name(opt));
	switch (opt) {
	case OPT_CONTROL_DIR:
		if (strlen(val) >= sizeof(ep->control_dir))
			usage_error("--control-dir: path too long");
		snprintf(ep->control_dir, sizeof(ep->control_dir), "%s", val);
		break;
	case OPT_LOG_FILE:
		if (strlen(val) >= sizeof(ep->log_path))
			usage_error("--log-file: path too long");
		a->log = val;
		break;
	case OPT_LOG_MAX: {
		char *end;
		errno = 0;
		ep->log_max_bytes = strtoll(val, &end, 10);
		if (errno || end == val || *end || ep->log_max_bytes < 0)
			usage_error("--log-max-bytes: not a byte count: \"%s\"", val);
		break;
	}
	case OPT_PROBE_PORT: ep->probe_port = parse_port("--probe-port", val); break;
	case OPT_SYSTEM_PORT: a->sysport = val; break;
	case OPT_NO_SECCOMP: ep->seccomp = false; break;
	case OPT_NO_PID_CYCLE: ep->pid_cycle = false; break;
	case OPT_THP:
		if (val[0] != '/')
			usage_error("--thp-preload must be an absolute path: \"%s\"", val);
		a->thp = val; /* the flag wins over the environment */
		break;
	case OPT_NO_THP: a->thp_off = true; break;
	}
}

static void parse_options(struct ep *ep, struct args *a, int argc, char **argv)
{
	int opt;

	opterr = 0; /* our own messages, with the usage text */
	/* "+": stop at the worker's command; ":": tell a missing value from an unknown option */
	while ((opt = getopt_long(argc, argv, "+:h", options, NULL)) != -1) {
		switch (opt) {
		case 'h':
			usage(stdout);
			exit(0);
		case ':':
			usage_error("%s needs a value", optopt >= OPT_CONTROL_DIR ? option_name(optopt) : "option");
		case '?':
			if (optopt >= OPT_CONTROL_DIR)
				usage_error("%s takes no value", option_name(optopt));
			if (optopt)
				usage_error("unknown option \"-%c\"", optopt);
			usage_error("unknown option \"%s\"", argv[optind - 1]);
		default:
			take_option(ep, a, opt, optarg);
		}
	}
}

void parse_args(struct ep *ep, int argc, char **argv)
{
	struct args a = { .sysport = getenv("DYN_SYSTEM_PORT"), .thp = getenv(THP_PRELOAD_ENV) };

	snprintf(ep->control_dir, sizeof(ep->control_dir), "%s", DYNSNAP_CONTROL_DIR_DEFAULT);
	ep->probe_port = DYNSNAP_PROBE_PORT_DEFAULT;
	ep->log_max_bytes = LOG_MAX_BYTES_DEFAULT;
	ep->seccomp = true;
	ep->pid_cycle = true;
	parse_options(ep, &a, argc, argv);
	if (optind >= argc)
		usage_error("no worker command given");
	ep->argv = argv + optind;
	join_command(ep);
	if (!a.sysport || !*a.sysport)
		usage_error("the worker's system port is unknown: set DYN_SYSTEM_PORT or --system-port");
	ep->system_port = parse_port("--system-port/DYN_SYSTEM_PORT", a.sysport);
	if (ep->system_port == ep->probe_port)
		usage_error("--probe-port %d is the worker's system port; pick another", ep->probe_port);
	if (ep->control_dir[0] != '/')
		usage_error("--control-dir must be an absolute path: \"%s\"", ep->control_dir);
	if (a.log)
		snprintf(ep->log_path, sizeof(ep->log_path), "%s", a.log);
	else
		snprintf(ep->log_path, sizeof(ep->log_path), "%s/%s", ep->control_dir, DYNSNAP_LOG_FILE);
	if (ep->log_path[0] != '/')
		usage_error("--log-file must be an absolute path: \"%s\"", ep->log_path);
	if (a.thp_off || (a.thp && strcmp(a.thp, "off") == 0))
		ep->thp_preload[0] = '\0';
	else if (a.thp && *a.thp && a.thp[0] != '/')
		usage_error("$%s must be an absolute path or \"off\": \"%s\"", THP_PRELOAD_ENV, a.thp);
	else
		thp_setup(ep, a.thp && *a.thp ? a.thp : NULL);
}
