"""Logging, metrics and traces; the only importer of opentelemetry. Layer above ``models``."""
