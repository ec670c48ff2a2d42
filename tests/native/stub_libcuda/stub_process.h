/* stub_process.h: what stub_libcuda.c (the checkpoint API, acting on another
 * process) and stub_process.c (the calls a process makes on its own behalf:
 * the hold while it is locked or checkpointed, its device memory) share. Both
 * are one library; these are hidden, never exported as driver symbols.
 * Formats of the files in stub_libcuda.c's header. */
#ifndef DYNSNAP_STUB_PROCESS_H
#define DYNSNAP_STUB_PROCESS_H

#include <cuda.h>

#include "stub_files.h"

#define STUB_HIDDEN __attribute__((visibility("hidden")))

/* The key a process's checkpoint state is kept under: its host pid, or with
 * "nskey 0" its pid namespace and pid there (stub_libcuda.c, state_key). */
STUB_HIDDEN long long stub_state_key(int pid);
/* The same key for the calling process itself, from inside it. */
STUB_HIDDEN long long stub_self_key(void);
/* A key's state in the state file (0 running when it has no line). */
STUB_HIDDEN int stub_state_of(long long key);
/* Writes a key's state into the state file (stub_libcuda.c). */
STUB_HIDDEN void stub_write_state_key(long long key, int st);
/* At a process's first cuInit: a held state under its own key, left by a gone
 * process (a reused pid namespace inode), set back to running. */
STUB_HIDDEN void stub_drop_stale_self(void);

/* A call a process makes on its own behalf waits here while that process is
 * locked or checkpointed; returns CUDA_SUCCESS once it runs again, or
 * CUDA_ERROR_UNKNOWN past the bound ("holdmax"). fn names it in the holds log. */
STUB_HIDDEN CUresult stub_hold(const char *fn);

/* The calling thread's current device (cuCtxSetCurrent), -1 without one. */
STUB_HIDDEN int stub_current_device(void);
/* Writes the devices file (the caller holds lock_all). */
STUB_HIDDEN void stub_write_devs(const struct devs *d);

/* The device memory a key's process allocated (cuMemAlloc_v2), from the alloc
 * file: moved by a checkpoint (sign -1: freed on its device) and by a restore
 * (+1: taken again, on remap[its device] where that is >= 0; remap may be
 * NULL). Returns 1 when d changed. The caller holds lock_all and writes d back. */
STUB_HIDDEN int stub_move_allocs(long long key, int sign, const int *remap, struct devs *d);

#endif
