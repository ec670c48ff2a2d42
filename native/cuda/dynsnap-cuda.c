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
 * See docs/NATIVE.md for usage, exit codes and the JSON format; dynsnap-cuda.h for the files
 * (by role) and who calls whom. This one is main. */
#define _GNU_SOURCE
#include <libgen.h>
#include <stdlib.h>
#include <string.h>

#include "dynsnap-cuda.h"

int main(int argc, char **argv)
{
	struct cli c;
	char *base = strdup(argv[0]);
	int rc;

	if (base)
		prog = strdup(basename(base));
	mark("start");
	if ((rc = parse_args(&c, argc, argv)) >= 0)
		return rc;
	if (c.mem_info)
		return print_mem_info();
	if (load_driver())
		return EXIT_NODRIVER;
	mark("driver loaded");
	jobs_reset();
	return c.action ? act(&c) : query(&c);
}
