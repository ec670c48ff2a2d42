"""Kubernetes access: the only importer of kubernetes_asyncio (client, watch, SSA, events). Above ``telemetry``."""
