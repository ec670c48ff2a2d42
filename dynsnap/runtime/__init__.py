"""Generic controller machinery (work queue, workers, manager, health). Above ``k8s``."""
