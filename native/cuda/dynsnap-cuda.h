/* Internal interfaces of dynsnap-cuda (docs/NATIVE.md), one section per file.
 *
 * Who calls whom, with no cycle: dynsnap-cuda.c (main) calls args.c and actions.c; actions.c
 * calls phases.c, memory.c, output.c and driver.c; output.c calls memory.c and driver.c;
 * memory.c and phases.c call driver.c; every file may call diag.c, which calls none of them.
 * The pid table and the options of the driver calls (phases.c) are filled by args.c. */
#ifndef DYNSNAP_CUDA_H
#define DYNSNAP_CUDA_H

#include <cuda.h>
#include <stdio.h>

#include "gpumap.h"

#define MAX_PIDS 256
#define MAX_DEVS 64

enum exit_code {
	EXIT_OK = 0,
	EXIT_FAILED = 1,   /* a driver call failed; states are reported */
	EXIT_USAGE = 2,    /* bad arguments or map: nothing was touched */
	EXIT_NOMEM = 3,    /* free-memory check refused the restore: nothing was touched */
	EXIT_NODRIVER = 4, /* libcuda could not be loaded */
};

/* ---- diag.c: stderr ---- */
extern const char *prog; /* the name we were called by: dynsnap-cuda or cuda-checkpoint */
void diag(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void mark(const char *what); /* DYNSNAP_CUDA_TIMING=1: one line per stage */

/* ---- driver.c: libcuda, loaded at run time, and its devices ---- */
extern struct drv {
	__typeof__(cuInit) *Init;
	__typeof__(cuGetErrorName) *GetErrorName;
	__typeof__(cuDeviceGetCount) *DeviceGetCount;
	__typeof__(cuDeviceGet) *DeviceGet;
	__typeof__(cuDeviceGetUuid) *DeviceGetUuid;
	__typeof__(cuDevicePrimaryCtxRetain) *PrimaryCtxRetain;
	__typeof__(cuDevicePrimaryCtxRelease) *PrimaryCtxRelease;
	__typeof__(cuCtxSetCurrent) *CtxSetCurrent;
	__typeof__(cuMemGetInfo) *MemGetInfo;
	__typeof__(cuCheckpointProcessLock) *Lock;
	__typeof__(cuCheckpointProcessCheckpoint) *Checkpoint;
	__typeof__(cuCheckpointProcessRestore) *Restore;
	__typeof__(cuCheckpointProcessUnlock) *Unlock;
	__typeof__(cuCheckpointProcessGetState) *GetState;
	__typeof__(cuCheckpointProcessGetRestoreThreadId) *GetRestoreTid;
	int init_ok;
} drv;
extern struct gpu_uuid dev_uuid[MAX_DEVS];
extern int ndev; /* -1 until enumerate_devices */

void *sym(void *h, const char *a, const char *b); /* dlsym of a, else of b */
int load_driver(void);                           /* 0, or -1 after a diagnostic */
int retry_after_init(CUresult r);                /* whether to make a refused call again */
const char *errname(CUresult r);
const char *state_word(int st);
int enumerate_devices(void); /* 0, or -1 (no cuInit, no device API) */
int dev_index(const struct gpu_uuid *u);
CUresult get_state(int pid, int *st);
CUresult get_restore_tid(int pid, int *tid);

/* ---- phases.c: the pids and the driver calls made on them ---- */
enum op { OP_LOCK, OP_CHECKPOINT, OP_RESTORE, OP_UNLOCK, OP_NONE };
extern const char *const op_name[4];

struct job {
	int pid;
	long long start;   /* the start time the caller checked (/proc/<pid>/stat field 22), -1: none given */
	int state_before, state_after;
	double ms[4];      /* per op, -1 when not run */
	CUresult err;      /* first failing call */
	int err_op;        /* OP_NONE when ok */
	int skipped;       /* not attempted because an earlier pid failed (serial) */
	long long bytes;   /* GPU bytes freed (checkpoint) or needed (restore), -1 unknown */
};

extern struct opt {
	unsigned int timeout_ms;
	struct gpu_pair pairs[GPUMAP_MAX];
	int npairs;
	int serial;
} opt;
extern struct job jobs[MAX_PIDS];
extern int njobs;

void jobs_reset(void); /* nothing run yet, every state unknown */
CUresult do_op(struct job *j, enum op op);
int run_phase(enum op op, const int *sel, int stop_on_fail); /* number of failures */

/* ---- memory.c: free GPU memory, and what a checkpoint freed ---- */
enum mem_src { SRC_NONE, SRC_NVML, SRC_CUDA };
void sample_free(long long *free_b, signed char *src);
const char *mem_src_word(void); /* the sources behind this run's numbers, as a JSON value */
void write_records(const char *group, const long long *freed);
int read_records(long long *need); /* 1 when any record was found */
void drop_records(void);

/* ---- output.c: stdout ---- */
extern char refusal[256]; /* the whole action refused before any state change: why */
void gpus_line(const long long *before, const signed char *src_before, const long long *after,
	       const signed char *src_after);
void print_json(const char *action);
void report_failure(const char *action, const char *what);
int print_mem_info(void);

/* ---- args.c: the command line ---- */
struct cli {
	const char *action, *map;
	enum op first, second; /* the action's driver calls; second OP_NONE for one */
	int get_st, get_tid, mem_info, json, force, skip_mem;
	long long need_bytes;  /* -1: from the records */
};
void usage(FILE *f);
int parse_args(struct cli *c, int argc, char **argv); /* -1 to go on, else the exit code */

/* ---- actions.c: what the command line asked for ---- */
int query(const struct cli *c);  /* --get-state, --get-restore-tid */
int act(const struct cli *c);    /* --action */

#endif
