/*
 * Constants shared by dynsnap's C programs and its Python agent.
 *
 * The agent mirrors every DYNSNAP_ macro below in dynsnap/models/protocol.py
 * (section "dynsnap-entrypoint"), and tests/unit/test_protocol_native.py parses
 * this file and fails when the two disagree. Keep each definition on one line,
 * as `#define DYNSNAP_NAME value`, with value an integer or a string literal.
 * The contract itself is described in docs/ENTRYPOINT.md.
 */
#ifndef DYNSNAP_PROTOCOL_H
#define DYNSNAP_PROTOCOL_H

/*
 * The entrypoint sets ns_last_pid to DYNSNAP_PID_FLOOR - 1 before it starts the
 * worker, so every process of the worker tree has a pid >= the floor; the agent
 * refuses to capture a worker whose pids are below it. 10000 fits under the
 * kernel's smallest default pid_max (32768) with room for the worker's threads.
 */
#define DYNSNAP_PID_FLOOR 10000

/* Control directory: a volume the entrypoint shares with the node agent. */
#define DYNSNAP_CONTROL_DIR_DEFAULT "/run/dynsnap"
/* Written by the entrypoint only (temp file + rename), JSON. */
#define DYNSNAP_CONTROL_FILE "entrypoint.json"
/* Bumped on any incompatible change to the control file or the request file. */
#define DYNSNAP_CONTROL_FORMAT 1
/* Written by the agent only (temp file + rename): one line "SEQ STATE\n". */
#define DYNSNAP_REQUEST_FILE "state-request"
/* Default worker log, inside the control directory (never /tmp). */
#define DYNSNAP_LOG_FILE "worker.log"

/* The entrypoint's own probe port (the worker keeps DYN_SYSTEM_PORT). */
#define DYNSNAP_PROBE_PORT_DEFAULT 8081

/* Entrypoint states, as written in the control file and the request file. */
#define DYNSNAP_STATE_ACTIVE "active"
#define DYNSNAP_STATE_SUSPENDING "suspending"
#define DYNSNAP_STATE_SUSPENDED "suspended"
#define DYNSNAP_STATE_SNAPSHOTTED "snapshotted"
#define DYNSNAP_STATE_RESTORING "restoring"
/* Asleep like suspended, but routable: /health answers 200, so the pod stays Ready and its endpoint in
 * serving; a request that reaches the worker waits in its own CUDA calls until the agent wakes it. */
#define DYNSNAP_STATE_ROUTABLE "routable"

/* Exit status when the agent sets `active` but no worker is running any more. */
#define DYNSNAP_EXIT_NO_WORKER 75

#endif
