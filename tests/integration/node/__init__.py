"""The suites on the real node with one shared node and helm install (conftest.py)."""
