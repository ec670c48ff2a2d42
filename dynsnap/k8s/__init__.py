"""Kubernetes access: the only importer of kubernetes_asyncio. Layer above ``telemetry``, below ``runtime``.

    client     ``Kube``: JSON verbs (SSA by default), watch, delete preconditions, TokenRequest
    config     kubeconfig / bearer token / in-cluster service account (token re-read on rotation)
    errors     the exception tree (drawn in its docstring)
    retry      named retry policies over tenacity for plain requests; the instant switch for tests
    backoff    jittered exponential delays, the failure-rate bound, Retry-After parsing
    store      the informer's cache: keys, pluggable indexes, relist diff with synthetic deletes
    informer   paginated list + watch + reconnect into a store, with handlers
    events     ``EventRecorder`` for events.k8s.io/v1 (never raises, series dedupe)
    leases     coordination.k8s.io/v1 Lease get / try_acquire / renew / release
    times      Time / MicroTime formatting and parsing
"""
