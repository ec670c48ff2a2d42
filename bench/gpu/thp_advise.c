/* thp_advise.so: an LD_PRELOAD shim that asks for transparent huge pages on the large anonymous
 * mappings its process makes through mmap(), for bench/gpu/thp_bench.py (issue 12).
 *
 * The product is native/thp/dynsnap-thp.c (libdynsnap-thp.so, preloaded into every worker by
 * dynsnap-entrypoint): the same takeover narrowed to MAP_POPULATE mappings, with fallbacks and no
 * log. This file stays as the instrument the H200 runs in docs/BENCHMARKS.md measured (its log
 * feeds thp_bench.py), so that their command still reproduces them.
 *
 * Why: on a machine whose THP setting is `madvise`, only memory marked MADV_HUGEPAGE gets huge pages
 * at fault time, and only the process itself can mark it (process_madvise() refuses MADV_HUGEPAGE
 * for another process). The CUDA driver's host copy of a checkpointed process is an anonymous
 * mapping the driver makes inside that process during cuCheckpointProcessCheckpoint; if the driver
 * makes it through the dynamic mmap symbol, this shim sees it and marks it, and the copy is faulted
 * in 2 MiB at a time instead of 4 KiB. If the driver calls the system call directly, nothing here
 * runs, and the worker's AnonHugePages after a checkpoint says so.
 *
 * MAP_POPULATE: the H200 run of 2026-11-30 showed driver 580.159 maps its copy with
 * MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE (flags 0x8022) through this very symbol, so the kernel
 * faulted every page in, 4 KiB each, inside mmap() itself, before a madvise after it could matter
 * (the mapping had VM_HUGEPAGE, "hg", and 0 kB AnonHugePages). So a large anonymous MAP_POPULATE
 * mapping is made here without MAP_POPULATE, marked, then populated by MADV_POPULATE_WRITE (or
 * _READ when not writable): the same prefault, now on huge pages. MAP_POPULATE never fails the
 * mmap, so neither does a failed populate here.
 *
 * Env: DYNSNAP_THP_MIN (bytes, default 2 MiB): smallest mapping marked; DYNSNAP_THP_LOG (path):
 * append one line per marked mapping ("addr len prot flags madvise_rc errno").
 * Build: cc -O2 -shared -fPIC -o thp_advise.so thp_advise.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);

static mmap_fn real_mmap;
static mmap_fn real_mmap64;

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

static size_t min_len(void) {
	static size_t n;
	if (!n) {
		const char *m = getenv("DYNSNAP_THP_MIN");
		n = m ? strtoull(m, NULL, 0) : (2u << 20);
		if (!n)
			n = 1;
	}
	return n;
}

/* The mappings this shim takes over: anonymous and at least DYNSNAP_THP_MIN bytes. */
static int wanted(size_t len, int flags) {
	return (flags & MAP_ANONYMOUS) && len >= min_len();
}

static void advise(void *p, size_t len, int prot, int flags) {
	if (p == MAP_FAILED || !wanted(len, flags))
		return;
	int saved = errno;
	int rc = madvise(p, len, MADV_HUGEPAGE);
	int err = rc ? errno : 0;
	if (flags & MAP_POPULATE) {  /* mapped without it by the caller below: prefault now */
		int prc = madvise(p, len, (prot & PROT_WRITE) ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
		if (prc && !rc) {
			rc = prc;
			err = errno;
		}
	}
	const char *log = getenv("DYNSNAP_THP_LOG");
	if (log) {
		/* write(2) only: no stdio buffers inside an allocator's mmap call */
		int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
		if (fd >= 0) {
			char line[160];
			int n = snprintf(line, sizeof line, "%p %zu %d 0x%x %d %d\n", p, len, prot, flags, rc, err);
			if (n > 0)
				(void)!write(fd, line, (size_t)n);
			close(fd);
		}
	}
	errno = saved;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
	if (!real_mmap)
		real_mmap = (mmap_fn)dlsym(RTLD_NEXT, "mmap");
	void *p = real_mmap(addr, len, prot, wanted(len, flags) ? flags & ~MAP_POPULATE : flags, fd, off);
	advise(p, len, prot, flags);
	return p;
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
	if (!real_mmap64)
		real_mmap64 = (mmap_fn)dlsym(RTLD_NEXT, "mmap64");
	void *p = real_mmap64(addr, len, prot, wanted(len, flags) ? flags & ~MAP_POPULATE : flags, fd, off);
	advise(p, len, prot, flags);
	return p;
}
