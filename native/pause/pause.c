/* dynsnap-pause: the pod sandbox's process (the "pause" container) of the local real node.
 *
 * It holds the pod's namespaces for as long as the pod lives: it waits, reaps any child it
 * inherits (a pod sharing its pid namespace makes it PID 1 of every container), and exits 0 on
 * SIGTERM or SIGINT, which is how containerd stops a sandbox. Nothing else: no files, no network.
 * Built static (no libraries in its image) by native/pause/Makefile; hack/lib-node.sh packs it as
 * a one-layer OCI image. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
	(void)sig;
	_exit(0);
}

static void on_child(int sig) {
	(void)sig;
	int saved = errno;
	/* Every exited child, not one per signal: SIGCHLDs that arrive together are merged. */
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
	errno = saved;
}

static int handle(int sig, void (*fn)(int)) {
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = fn;
	sa.sa_flags = SA_RESTART | (sig == SIGCHLD ? SA_NOCLDSTOP : 0);
	sigemptyset(&sa.sa_mask);
	return sigaction(sig, &sa, NULL);
}

int main(int argc, char **argv) {
	if (argc > 1) {
		fprintf(stderr, "usage: %s (no arguments: it waits for SIGTERM or SIGINT)\n", argv[0]);
		return 2;
	}
	if (handle(SIGTERM, on_stop) || handle(SIGINT, on_stop) || handle(SIGCHLD, on_child)) {
		perror("dynsnap-pause: sigaction");
		return 1;
	}
	if (getpid() != 1)
		fprintf(stderr, "dynsnap-pause: not PID 1 (pid %d): it reaps only its own children\n", (int)getpid());
	for (;;)
		pause();
}
