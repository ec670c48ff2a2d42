"""Generic controller machinery (work queue, workers, manager, leader election, health). Above ``k8s``."""
