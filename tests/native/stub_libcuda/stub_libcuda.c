/* stub_libcuda: stands in for the NVIDIA driver's libcuda checkpoint API in
 * dynsnap-cuda's tests (there is no GPU where they run), and for the driver an
 * engine calls from inside its own process (stub_process.c, built into the
 * same library; the hold and device memory, below).
 *
 * It follows the driver's per-process state machine
 * (running -lock-> locked -checkpoint-> checkpointed -restore-> locked
 * -unlock-> running; anything else is CUDA_ERROR_ILLEGAL_STATE), keeps that
 * state per pid in a file so separate invocations see it, records every call
 * in order, and fakes device enumeration and free memory. All of it lives in
 * $DYNSNAP_STUB_DIR, shared with ../stub_nvml (stub_files.h reads it):
 *
 *   state     "key state" lines (key: the pid, or see nskey; 0 running, 1 locked,
 *             2 checkpointed, 3 failed)
 *   log       one line per call, appended when the call returns:
 *               <function> pid=<pid> [timeout=<ms>] [pairs=<old>><new>;...] rc=<code>
 *             for the checkpoint API, and for the calls that read free
 *             memory (cuDevicePrimaryCtxRetain/Release, cuMemGetInfo, and
 *             stub_nvml's nvml* calls):
 *               <function> [dev=<index>] [uuid=<uuid>] rc=<code>
 *   inits     one line per cuInit: "cuInit rc=<code>"
 *   queries   one line per cuCheckpointProcessGetState that answered (not in
 *             log, whose call sequences the tests compare):
 *               cuCheckpointProcessGetState pid=<pid> state=<state>
 *             (how often the agent asks: each is a helper process)
 *   devices   "<uuid hex> <free bytes> <total bytes>" per visible GPU
 *             (absent: one GPU, uuid 11..11, 80 GiB free of 80 GiB)
 *   control   directives, read on every call:
 *               fail <function> <pid|*> <code>   return <code>, state unchanged
 *               hang <function> <pid|*> <ms>     sleep first; a lock with a
 *                                                shorter timeout returns
 *                                                CUDA_ERROR_NOT_READY instead
 *               nocuda <pid>                     pid holds no CUDA context
 *               mem <pid> <device> <bytes>       checkpoint frees, restore
 *                                                takes, that much on a device
 *               nvmlskew <device> <bytes>        stub_nvml reports that much
 *                                                less free than cuMemGetInfo
 *               nskey 0                          key state by (pid namespace,
 *                                                pid in it): survives an
 *                                                in-place CRIU restore
 *               copy <pid> <MiB>                 the host copy, below
 *               needinit all * 1                 the checkpoint API answers
 *                                                CUDA_ERROR_NOT_INITIALIZED
 *                                                until cuInit in this process
 *               holdmax 0 <ms>                   the hold's bound, below
 *               fail <call> <pid|*> <code>       also for the in-process
 *                                                calls of stub_process.c
 *                                                (pid: the caller's getpid())
 *   holds     the hold, below: "hold <call> key=<key> state=<state>" when a
 *             call starts waiting, "release <call> key=<key> state=<state>
 *             ms=<waited> rc=<code>" when it returns
 *   alloc     "<key> <device> <bytes> <resident 0|1>" per process holding
 *             device memory it allocated (cuMemAlloc_v2)
 *
 * A process's first cuInit finds its key running: a locked or checkpointed
 * state under it was left by a gone process whose pid namespace inode the
 * kernel gave to this one's (the real driver's state lives in the process and
 * goes with it); "stale key=<key> state=<state> dropped" in holds says so. A
 * process CRIU restored makes no first cuInit again (the flag is in its memory).
 *
 * The hold. The driver calls a process makes on its own behalf (what an engine
 * calls: cuInit, cuDeviceGetCount, cuDeviceGet, cuDeviceGetUuid,
 * cuDevicePrimaryCtxRetain/Release, cuCtxSetCurrent, cuCtxSynchronize,
 * cuMemGetInfo, cuMemAlloc, cuMemFree, cuMemcpyHtoD, cuMemcpyDtoH) look up the
 * CALLING process's own state, keyed as the checkpoint API keys it (its pid as
 * the /proc it sees first names it, or with nskey its pid namespace and its
 * pid there). While that state is locked (1) or checkpointed (2) the call
 * waits, polling the state file every 10 ms, and once the process runs again
 * (0) it does what it does and returns its normal result, as the H200's driver
 * did (DESIGN.md section 2: a call made after save got no answer until the
 * resume, then the right result). Bounded: past "holdmax" ms (default 600000,
 * 10 minutes) it returns CUDA_ERROR_UNKNOWN having done nothing. A failed (3)
 * process is not held. The checkpoint API (cuCheckpointProcess*, made by
 * dynsnap-cuda on another process) and cuGetErrorName are never held: a
 * process is not held for the state of the pid it acts on, only its own.
 *
 * Device memory (stub_process.c). cuMemAlloc_v2 needs a current context
 * (cuCtxSetCurrent) and takes its bytes from that device's free memory in
 * devices (CUDA_ERROR_OUT_OF_MEMORY past it); the "device" memory is an
 * anonymous mapping in the process, so pages never written cost nothing, and
 * cuMemcpyHtoD_v2/DtoH_v2 copy into and out of it (a range outside one live
 * allocation: CUDA_ERROR_INVALID_VALUE). cuMemFree_v2 gives the bytes back. A
 * checkpoint of the process frees its allocated bytes on the device, as it
 * frees a mem directive's, and a restore takes them again (on the target of
 * its device's pair when remapped); the contents stay where they are. A
 * process that exits gives back what is on the device; one killed outright
 * cannot (StubDriver.forget_pid_namespace gives a pod's back). One device per
 * process: an allocation on a second one is CUDA_ERROR_NOT_SUPPORTED. These
 * calls are not logged (an engine makes them per token).
 *
 * The host copy. At a checkpoint the real driver copies the process's GPU
 * memory into an anonymous mapping it makes INSIDE that process; driver 580
 * makes it with mmap(MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE) through libc's
 * dynamic mmap (seen on the H200, docs/BENCHMARKS.md), which is what
 * native/thp/libdynsnap-thp.so takes over. With "copy <pid> <MiB>" in control,
 * a checkpoint of that pid (the host pid the CLI is given) does the same: the
 * CLI queues the signal COPY_SIG to the pid, and this library, loaded in the
 * process (LD_PRELOAD), maps MiB MiB that way from the signal handler and
 * fills it with the "device" pattern (word i = COPY_WORD(i)); a restore
 * signals again, and the process checks every word, unmaps the copy and
 * answers. The process answers in $DYNSNAP_STUB_DIR/copy-<host pid> (as its
 * own environment names the directory: give it the CLI's) with one line
 * "save <addr hex> <bytes> <result>" or "restore <addr hex> <bytes> <result>",
 * result one of ok, bad (a word differs), none (no copy to restore), busy (a
 * copy already mapped), failed (mmap failed). Anything but ok, or no answer
 * within 30 s, fails the call with CUDA_ERROR_UNKNOWN and leaves the state as
 * it was. The log gets "copy pid=<pid> op=<save|restore> addr=<hex>
 * bytes=<n> result=<result> rc=<code>". Only a pid named in a copy line is
 * ever signalled (never "*"): the CLI tests use made-up pids, and a process
 * that has not loaded this library would die of the signal.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "stub_process.h"

#define MAXP 1024
#define COPY_SIG (SIGRTMIN + 8)
#define COPY_WORD(i) (0xC0FFEE0000000000ULL | (unsigned long long)(i))
#define COPY_WAIT_TICKS 600 /* of 50 ms: 30 s */

static __thread int cur_dev = -1;

static int nocuda(int pid)
{
	return control_keyed("nocuda", pid, NULL, 0);
}

static long long mem_of(int pid, int *devp)
{
	long long v[2];

	if (!control_keyed("mem", pid, v, 2)) {
		*devp = -1;
		return 0;
	}
	*devp = (int)v[0];
	return v[1];
}

/* With a line "nskey 0" in control, per-pid state is keyed by the process's
 * pid namespace and its pid there instead of its host pid. The real driver keeps
 * a process's checkpoint state inside the process, so it survives an in-place
 * CRIU dump and restore (same namespace, same in-namespace pid, a new host pid);
 * keyed this way, the stub's state does too. A pid with no /proc entry (the CLI
 * tests' made-up pids) keeps its own number. */
long long stub_state_key(int pid)
{
	char p[64], line[256];
	struct stat st;
	long long nspid = -1;
	FILE *f;

	if (!control_keyed("nskey", 0, NULL, 0))
		return pid;
	snprintf(p, sizeof(p), "/proc/%d/ns/pid", pid);
	if (stat(p, &st))
		return pid;
	snprintf(p, sizeof(p), "/proc/%d/status", pid);
	f = fopen(p, "r");
	if (!f)
		return pid;
	while (fgets(line, sizeof(line), f)) {
		char *tok, *save = NULL;

		if (strncmp(line, "NSpid:", 6))
			continue;
		for (tok = strtok_r(line + 6, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save))
			nspid = atoll(tok);
	}
	fclose(f);
	if (nspid < 0)
		return pid;
	return (long long)(st.st_ino << 22) | nspid; /* pid_max is at most 2^22 */
}

int stub_state_of(long long key)
{
	char p[4096];
	long long q;
	int s, st = CU_PROCESS_STATE_RUNNING;
	FILE *f;

	path(p, sizeof(p), "state");
	f = fopen(p, "r");
	if (!f)
		return st;
	while (fscanf(f, "%lld %d", &q, &s) == 2)
		if (q == key)
			st = s;
	fclose(f);
	return st;
}

static int read_state(int pid)
{
	return stub_state_of(stub_state_key(pid));
}

static void write_state(int pid, int st)
{
	stub_write_state_key(stub_state_key(pid), st);
}

void stub_write_state_key(long long key, int st)
{
	char p[4096], tmp[4200];
	long long keys[MAXP], q;
	int sts[MAXP], n = 0, s, found = 0;
	FILE *f;

	path(p, sizeof(p), "state");
	f = fopen(p, "r");
	if (f) {
		while (n < MAXP && fscanf(f, "%lld %d", &q, &s) == 2) {
			if (q == key) {
				s = st;
				found = 1;
			}
			keys[n] = q;
			sts[n++] = s;
		}
		fclose(f);
	}
	if (!found && n < MAXP) {
		keys[n] = key;
		sts[n++] = st;
	}
	snprintf(tmp, sizeof(tmp), "%s.tmp", p);
	f = fopen(tmp, "w");
	if (!f)
		return;
	for (int i = 0; i < n; i++)
		fprintf(f, "%lld %d\n", keys[i], sts[i]);
	fclose(f);
	rename(tmp, p);
}

void stub_write_devs(const struct devs *d)
{
	char p[4096], tmp[4200];
	FILE *f;

	path(p, sizeof(p), "devices");
	snprintf(tmp, sizeof(tmp), "%s.tmp", p);
	f = fopen(tmp, "w");
	if (!f)
		return;
	for (int i = 0; i < d->n; i++) {
		for (int b = 0; b < 16; b++)
			fprintf(f, "%02x", d->uuid[i][b]);
		fprintf(f, " %lld %lld\n", d->free_b[i], d->total_b[i]);
	}
	fclose(f);
	rename(tmp, p);
}

/* Moves a pid's GPU memory, what a mem directive records and what it
 * allocated itself (cuMemAlloc_v2): sign -1 frees it (checkpoint), +1 takes it
 * back (restore) on its device, or where remap (old device index -> new, -1:
 * none; NULL without a map) sends it. */
static void move_mem(int pid, int sign, const int *remap)
{
	struct devs d;
	int dev, moved;
	long long b = mem_of(pid, &dev);

	read_devs(&d);
	if (remap && dev >= 0 && dev < d.n && remap[dev] >= 0)
		dev = remap[dev];
	moved = b && dev >= 0 && dev < d.n;
	if (moved)
		d.free_b[dev] -= sign * b;
	moved |= stub_move_allocs(stub_state_key(pid), sign, remap, &d);
	if (moved)
		stub_write_devs(&d);
}

static void hang(const char *fn, int pid, unsigned int timeout_ms, int *timed_out)
{
	long long ms = control("hang", fn, pid);

	*timed_out = 0;
	if (ms <= 0)
		return;
	if (timeout_ms && ms > timeout_ms) {
		usleep(timeout_ms * 1000u);
		*timed_out = 1;
		return;
	}
	usleep((useconds_t)ms * 1000u);
}

/* ---- the host copy (see the header), the process's side: signal handler only ---- */

static char copy_dir[4096]; /* $DYNSNAP_STUB_DIR at load: no getenv in the handler */
static void *copy_addr;
static size_t copy_len;

static size_t put_str(char *b, size_t n, const char *s)
{
	while (*s)
		b[n++] = *s++;
	return n;
}

static size_t put_num(char *b, size_t n, unsigned long long v, unsigned base)
{
	char tmp[24];
	int k = 0;

	do {
		tmp[k++] = "0123456789abcdef"[v % base];
		v /= base;
	} while (v);
	while (k)
		b[n++] = tmp[--k];
	return n;
}

/* Async-signal-safe: system calls and plain loops only (the handler may interrupt malloc). */
static void copy_signal(int sig, siginfo_t *si, void *uc)
{
	uintptr_t v = (uintptr_t)si->si_value.sival_ptr;
	int saved = errno, restore = (int)(v & 1), key = (int)((v >> 1) & 0x7fffff), fd;
	size_t len = (size_t)(v >> 24) << 20, n = 0, line_len;
	const char *result = "ok";
	char ack[4200], tmp[4300], line[128];
	unsigned long long *w;

	(void)sig;
	(void)uc;
	if (si->si_code != SI_QUEUE)
		return;
	if (!restore) {
		if (copy_addr) {
			result = "busy";
		} else {
			/* the flags driver 580 maps its copy with, through the dynamic symbol */
			void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
				       -1, 0);
			if (p == MAP_FAILED) {
				result = "failed";
			} else {
				w = p;
				for (size_t i = 0; i < len / sizeof(*w); i++)
					w[i] = COPY_WORD(i);
				copy_addr = p;
				copy_len = len;
			}
		}
	} else if (!copy_addr) {
		result = "none";
	} else {
		w = copy_addr;
		for (size_t i = 0; i < copy_len / sizeof(*w); i++)
			if (w[i] != COPY_WORD(i)) {
				result = "bad";
				break;
			}
		munmap(copy_addr, copy_len);
	}
	n = put_str(line, n, restore ? "restore " : "save ");
	n = put_num(line, n, (uintptr_t)copy_addr, 16);
	n = put_str(line, n, " ");
	n = put_num(line, n, copy_len, 10);
	n = put_str(line, n, " ");
	n = put_str(line, n, result);
	line[n++] = '\n';
	line_len = n;
	if (restore && copy_addr) {
		copy_addr = NULL;
		copy_len = 0;
	}
	n = put_str(ack, 0, copy_dir);
	n = put_str(ack, n, "/copy-");
	n = put_num(ack, n, (unsigned)key, 10);
	ack[n] = '\0';
	n = put_str(tmp, put_str(tmp, 0, ack), ".tmp");
	tmp[n] = '\0';
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd >= 0) {
		ssize_t w_n = write(fd, line, line_len);
		if (close(fd) == 0 && w_n == (ssize_t)line_len)
			rename(tmp, ack);
	}
	errno = saved;
}

/* In every process that loads this library; never over a handler the process set itself. */
__attribute__((constructor)) static void copy_init(void)
{
	struct sigaction sa, old;

	snprintf(copy_dir, sizeof(copy_dir), "%s", dir());
	if (sigaction(COPY_SIG, NULL, &old) != 0 || old.sa_handler != SIG_DFL)
		return;
	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = copy_signal;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	sigemptyset(&sa.sa_mask);
	sigaction(COPY_SIG, &sa, NULL);
}

/* The CLI's side: ask the process for its copy (or its restore) and wait for the answer. */
static CUresult host_copy(int pid, int restore)
{
	long long mib;
	char ack[4200], line[256] = "", what[16] = "?", result[16] = "noanswer";
	unsigned long long addr = 0, bytes = 0;
	union sigval v;
	CUresult rc = CUDA_ERROR_UNKNOWN;

	if (!control_keyed("copy", pid, &mib, 1) || mib <= 0)
		return CUDA_SUCCESS;
	snprintf(ack, sizeof(ack), "%s/copy-%d", dir(), pid);
	unlink(ack);
	v.sival_ptr = (void *)(((uintptr_t)mib << 24) | ((uintptr_t)pid << 1) | (uintptr_t)restore);
	if (sigqueue(pid, COPY_SIG, v) != 0) {
		snprintf(result, sizeof(result), "errno%d", errno);
	} else {
		for (int i = 0; i < COPY_WAIT_TICKS; i++) {
			FILE *f = fopen(ack, "r");

			if (f) {
				if (!fgets(line, sizeof(line), f))
					line[0] = '\0';
				fclose(f);
			}
			if (strchr(line, '\n') && sscanf(line, "%15s %llx %llu %15s", what, &addr, &bytes, result) == 4)
				break;
			usleep(50000);
		}
	}
	if (!strcmp(result, "ok"))
		rc = CUDA_SUCCESS;
	logline("copy pid=%d op=%s addr=0x%llx bytes=%llu result=%s rc=%d", pid, restore ? "restore" : "save",
		addr, bytes, result, (int)rc);
	return rc;
}

/* One transition: check the injected faults, then the state machine. */
/* Set by a successful cuInit in this process. */
static int inited;

/* "needinit all * 1" in control: the checkpoint API answers
 * CUDA_ERROR_NOT_INITIALIZED until this process called cuInit (a driver that
 * wants it; the H200's did not, and dynsnap-cuda calls it only when needed). */
static int uninitialized(void)
{
	return !inited && control("needinit", "all", 0) > 0;
}

static CUresult transition(const char *fn, int pid, int from, int to, unsigned int timeout_ms,
			   const char *extra, int mem_sign, const int *remap, int copy_op)
{
	int timed_out, fd;
	long long code;
	CUresult rc = CUDA_SUCCESS;

	if (uninitialized()) {
		logline("%s pid=%d rc=%d", fn, pid, CUDA_ERROR_NOT_INITIALIZED);
		return CUDA_ERROR_NOT_INITIALIZED;
	}

	hang(fn, pid, timeout_ms, &timed_out);
	fd = lock_all();
	code = control("fail", fn, pid);
	/* The H200's driver (580.159.04) answers a lock that ran out of time
	 * with CUDA_ERROR_NOT_READY, not CUDA_ERROR_TIMEOUT. */
	if (timed_out)
		rc = CUDA_ERROR_NOT_READY;
	else if (code >= 0)
		rc = (CUresult)code;
	else if (nocuda(pid))
		rc = CUDA_ERROR_NOT_FOUND;
	else if (read_state(pid) != from)
		rc = CUDA_ERROR_ILLEGAL_STATE;
	if (rc == CUDA_SUCCESS && copy_op >= 0)
		rc = host_copy(pid, copy_op);
	if (rc == CUDA_SUCCESS) {
		write_state(pid, to);
		if (mem_sign)
			move_mem(pid, mem_sign, remap);
	}
	if (timeout_ms)
		logline("%s pid=%d timeout=%u%s rc=%d", fn, pid, timeout_ms, extra, (int)rc);
	else
		logline("%s pid=%d%s rc=%d", fn, pid, extra, (int)rc);
	unlock_all(fd);
	return rc;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
	return transition("cuCheckpointProcessLock", pid, CU_PROCESS_STATE_RUNNING,
			  CU_PROCESS_STATE_LOCKED, args ? args->timeoutMs : 0, "", 0, NULL, -1);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
	(void)args;
	return transition("cuCheckpointProcessCheckpoint", pid, CU_PROCESS_STATE_LOCKED,
			  CU_PROCESS_STATE_CHECKPOINTED, 0, "", -1, NULL, 0);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
	char extra[2048] = "";
	int remap[MAXD], mapped = 0;

	for (int k = 0; k < MAXD; k++)
		remap[k] = -1;
	if (args && args->gpuPairsCount) {
		struct devs d;
		size_t off;

		read_devs(&d);
		off = (size_t)snprintf(extra, sizeof(extra), " pairs=");
		for (unsigned i = 0; i < args->gpuPairsCount && off < sizeof(extra) - 80; i++) {
			const CUcheckpointGpuPair *p = &args->gpuPairs[i];
			int found = -1;

			for (int b = 0; b < 16; b++)
				off += (size_t)snprintf(extra + off, sizeof(extra) - off, "%02x",
							(unsigned char)p->oldUuid.bytes[b]);
			extra[off++] = '>';
			for (int b = 0; b < 16; b++)
				off += (size_t)snprintf(extra + off, sizeof(extra) - off, "%02x",
							(unsigned char)p->newUuid.bytes[b]);
			extra[off++] = ';';
			extra[off] = '\0';
			for (int k = 0; k < d.n; k++)
				if (!memcmp(d.uuid[k], p->newUuid.bytes, 16))
					found = k;
			/* The real driver refuses a pair naming a GPU it cannot see. */
			if (found < 0) {
				logline("cuCheckpointProcessRestore pid=%d%s rc=%d", pid, extra,
					CUDA_ERROR_INVALID_VALUE);
				return CUDA_ERROR_INVALID_VALUE;
			}
			/* The pid's memory moves to the target of its device's pair. */
			for (int k = 0; k < d.n; k++)
				if (!memcmp(d.uuid[k], p->oldUuid.bytes, 16)) {
					remap[k] = found;
					mapped = 1;
				}
		}
	}
	return transition("cuCheckpointProcessRestore", pid, CU_PROCESS_STATE_CHECKPOINTED,
			  CU_PROCESS_STATE_LOCKED, 0, extra, +1, mapped ? remap : NULL, 1);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
	(void)args;
	return transition("cuCheckpointProcessUnlock", pid, CU_PROCESS_STATE_LOCKED,
			  CU_PROCESS_STATE_RUNNING, 0, "", 0, NULL, -1);
}

CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
	long long code = control("fail", "cuCheckpointProcessGetState", pid);
	int fd;

	if (code >= 0)
		return (CUresult)code;
	if (uninitialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (nocuda(pid))
		return CUDA_ERROR_NOT_FOUND;
	fd = lock_all();
	*state = (CUprocessState)read_state(pid);
	unlock_all(fd);
	logline_to("queries", "cuCheckpointProcessGetState pid=%d state=%d", pid, (int)*state);
	return CUDA_SUCCESS;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
	long long code = control("fail", "cuCheckpointProcessGetRestoreThreadId", pid);

	if (code >= 0)
		return (CUresult)code;
	if (uninitialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (nocuda(pid))
		return CUDA_ERROR_NOT_FOUND;
	*tid = pid + 1000;
	return CUDA_SUCCESS;
}

/* ---- device enumeration and memory ---- */

/* A call a process makes on its own behalf waits while that process is locked
 * or checkpointed (stub_process.c), as the real driver's do. */
#define HOLD(fn)                                            \
	do {                                                \
		CUresult hold_rc = stub_hold(fn);           \
		if (hold_rc != CUDA_SUCCESS)                \
			return hold_rc;                     \
	} while (0)

int stub_current_device(void)
{
	return cur_dev;
}

CUresult cuInit(unsigned int flags)
{
	static int called; /* restored with the process by CRIU: 1 in a woken worker */
	CUresult rc;

	if (!called) {
		called = 1;
		stub_drop_stale_self();
	}
	rc = stub_hold("cuInit");
	long long code = rc == CUDA_SUCCESS ? control("fail", "cuInit", 0) : -1;

	if (code >= 0)
		rc = (CUresult)code;
	(void)flags;
	inited = rc == CUDA_SUCCESS;
	logline_to("inits", "cuInit rc=%d", (int)rc);
	return rc;
}

CUresult cuDeviceGetCount(int *count)
{
	struct devs d;
	long long code;

	HOLD("cuDeviceGetCount");
	code = control("fail", "cuDeviceGetCount", 0);
	if (code >= 0)
		return (CUresult)code;
	read_devs(&d);
	*count = d.n;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
	struct devs d;

	HOLD("cuDeviceGet");
	read_devs(&d);
	if (ordinal < 0 || ordinal >= d.n)
		return CUDA_ERROR_INVALID_DEVICE;
	*dev = ordinal;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	struct devs d;

	HOLD("cuDeviceGetUuid");
	read_devs(&d);
	if (dev < 0 || dev >= d.n)
		return CUDA_ERROR_INVALID_DEVICE;
	memcpy(uuid->bytes, d.uuid[dev], 16);
	return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
	long long code;
	CUresult rc;

	HOLD("cuDevicePrimaryCtxRetain");
	code = control("fail", "cuDevicePrimaryCtxRetain", dev);
	rc = code >= 0 ? (CUresult)code : CUDA_SUCCESS;
	if (rc == CUDA_SUCCESS)
		*ctx = (CUcontext)(uintptr_t)(dev + 1);
	logline("cuDevicePrimaryCtxRetain dev=%d rc=%d", dev, (int)rc);
	return rc;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
	HOLD("cuDevicePrimaryCtxRelease_v2");
	logline("cuDevicePrimaryCtxRelease dev=%d rc=0", dev);
	return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
	HOLD("cuCtxSetCurrent");
	cur_dev = ctx ? (int)(uintptr_t)ctx - 1 : -1;
	return CUDA_SUCCESS;
}

CUresult cuMemGetInfo(size_t *free_b, size_t *total_b)
{
	struct devs d;
	long long code;
	CUresult rc = CUDA_SUCCESS;
	int fd;

	HOLD("cuMemGetInfo_v2");
	code = control("fail", "cuMemGetInfo", 0);
	fd = lock_all();
	read_devs(&d);
	unlock_all(fd);
	if (code >= 0) {
		rc = (CUresult)code;
	} else if (cur_dev < 0 || cur_dev >= d.n) {
		rc = CUDA_ERROR_INVALID_CONTEXT;
	} else {
		*free_b = (size_t)d.free_b[cur_dev];
		*total_b = (size_t)d.total_b[cur_dev];
	}
	logline("cuMemGetInfo dev=%d rc=%d", cur_dev, (int)rc);
	return rc;
}

CUresult cuGetErrorName(CUresult error, const char **str)
{
	switch (error) {
	case CUDA_SUCCESS:
		*str = "CUDA_SUCCESS";
		break;
	case CUDA_ERROR_INVALID_VALUE:
		*str = "CUDA_ERROR_INVALID_VALUE";
		break;
	case CUDA_ERROR_ILLEGAL_STATE:
		*str = "CUDA_ERROR_ILLEGAL_STATE";
		break;
	case CUDA_ERROR_NOT_FOUND:
		*str = "CUDA_ERROR_NOT_FOUND";
		break;
	case CUDA_ERROR_TIMEOUT:
		*str = "CUDA_ERROR_TIMEOUT";
		break;
	case CUDA_ERROR_NOT_READY:
		*str = "CUDA_ERROR_NOT_READY";
		break;
	case CUDA_ERROR_OUT_OF_MEMORY:
		*str = "CUDA_ERROR_OUT_OF_MEMORY";
		break;
	case CUDA_ERROR_INVALID_CONTEXT:
		*str = "CUDA_ERROR_INVALID_CONTEXT";
		break;
	case CUDA_ERROR_NOT_SUPPORTED:
		*str = "CUDA_ERROR_NOT_SUPPORTED";
		break;
	case CUDA_ERROR_UNKNOWN:
		*str = "CUDA_ERROR_UNKNOWN";
		break;
	default:
		*str = "CUDA_ERROR_UNKNOWN";
		return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}
