/*
 * libdynsnap-thp.so: puts the CUDA driver's host copy of a checkpointed worker on transparent huge
 * pages, with no system-wide setting. dynsnap-entrypoint preloads it into the worker (LD_PRELOAD,
 * prepended; --no-thp-preload turns it off). docs/NATIVE.md, "libdynsnap-thp".
 *
 * Why: at cuCheckpointProcessCheckpoint the driver copies the process's GPU memory into an
 * anonymous mapping it makes inside the process. Driver 580 makes it with
 * mmap(MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE) through libc's dynamic `mmap`, so the kernel faults
 * every page in, 4 KiB each, inside mmap() itself. Nodes usually run THP in `madvise` mode, where
 * only memory marked MADV_HUGEPAGE gets huge pages, and only the process itself can mark it
 * (process_madvise refuses MADV_HUGEPAGE for another process). Taken over here, the same mapping is
 * made without MAP_POPULATE, marked MADV_HUGEPAGE, then prefaulted with MADV_POPULATE_WRITE: the
 * same prefault, now 2 MiB at a time. On the H200 (docs/BENCHMARKS.md, "The second shim on the
 * H200") a 16 GiB worker saved 1.43x and resumed 1.27x faster, as fast as THP `always` system-wide.
 *
 * What it touches, and nothing else: mmap/mmap64 calls that ask for a private, anonymous, writable
 * mapping WITH MAP_POPULATE, of at least DYNSNAP_THP_MIN bytes (default 64 MiB; read once at load).
 * Such a mapping is resident in full the moment mmap returns anyway, so huge pages add no memory: a
 * sparse mapping (a thread stack, an allocator's arena, a PROT_NONE reservation) is never marked,
 * since huge pages there would make untouched memory resident. MAP_HUGETLB, MAP_LOCKED (faulted in
 * by the lock itself), MAP_GROWSDOWN and MAP_SHARED mappings pass through untouched.
 *
 * Safety: the caller gets what MAP_POPULATE promises, a fully faulted-in mapping, or exactly the
 * result of its own call. If the mapping without MAP_POPULATE fails, the caller's own call is made.
 * If marking or prefaulting fails (a kernel without MADV_POPULATE_WRITE, < 5.14: EINVAL), the
 * caller's own call is made over the mapping at the same address (MAP_FIXED replaces it
 * atomically: no other thread can get the range in between). errno is left as the caller's call
 * would leave it. The hook path makes system calls only: no allocation, no lock, no getenv, so it
 * is safe where malloc itself calls mmap, and in a signal handler.
 *
 * Every call goes to the kernel from here (the mmap system call, all that glibc's mmap makes on
 * 64-bit Linux), not to the next `mmap` in the search order: finding that one needs dlsym, which a
 * current toolchain binds to its GLIBC_2.34 version, and a preloaded library whose symbol version
 * the worker image's glibc lacks stops the worker from starting at all. The price: a library later
 * in the worker's LD_PRELOAD that hooks mmap itself (a heap profiler's hook) no longer sees the
 * calls. tests/native/test_thp.py checks that the built library needs nothing newer than glibc's
 * first version.
 */
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

/* The mmap system call takes the byte offset as libc's mmap does on 64-bit Linux only. */
_Static_assert(sizeof(long) == 8 && sizeof(off_t) == 8, "libdynsnap-thp is for 64-bit Linux");

#define EXPORT __attribute__((visibility("default")))
#define MIN_DEFAULT (64UL << 20)

static size_t min_len = MIN_DEFAULT; /* the default until thp_init has run */

__attribute__((constructor)) static void thp_init(void)
{
	int saved = errno;
	const char *m = getenv("DYNSNAP_THP_MIN");

	if (m && *m) {
		char *end;
		unsigned long long v = strtoull(m, &end, 0);
		if (!*end && v > 0)
			min_len = (size_t)v;
	}
	errno = saved;
}

/* The mappings taken over (see the header). */
static int taken(size_t len, int prot, int flags)
{
	return (flags & MAP_TYPE) == MAP_PRIVATE && (flags & MAP_ANONYMOUS) && (flags & MAP_POPULATE) &&
	       !(flags & (MAP_HUGETLB | MAP_LOCKED | MAP_GROWSDOWN)) && (prot & PROT_WRITE) && len >= min_len;
}

/* glibc's mmap on 64-bit Linux: the system call; -1 (MAP_FAILED) and errno on failure. Every
 * argument as a long: the upper half of an int in a register is undefined, and the kernel reads
 * all six as longs. */
static void *sys_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	return (void *)syscall(SYS_mmap, (long)addr, (long)len, (long)prot, (long)flags, (long)fd, (long)off);
}

static void *hook(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	int saved = errno;
	void *p, *q;

	if (!taken(len, prot, flags))
		return sys_mmap(addr, len, prot, flags, fd, off);
	p = sys_mmap(addr, len, prot, flags & ~MAP_POPULATE, fd, off);
	if (p == MAP_FAILED) {
		errno = saved;
		return sys_mmap(addr, len, prot, flags, fd, off);
	}
	if (madvise(p, len, MADV_HUGEPAGE) == 0 && madvise(p, len, MADV_POPULATE_WRITE) == 0) {
		errno = saved;
		return p;
	}
	/* The caller's own call, over ours: a plain MAP_POPULATE mapping at the same place. */
	q = sys_mmap(p, len, prot, (flags & ~MAP_FIXED_NOREPLACE) | MAP_FIXED, fd, off);
	if (q == MAP_FAILED) {
		int e = errno;
		munmap(p, len);
		errno = e;
		return MAP_FAILED;
	}
	errno = saved;
	return q;
}

EXPORT void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	return hook(addr, len, prot, flags, fd, off);
}

EXPORT void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	return hook(addr, len, prot, flags, fd, off);
}
