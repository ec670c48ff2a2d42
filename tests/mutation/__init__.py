"""Mutation checks of load-bearing code (runner.py): break a guard on purpose, run the tests that
should notice, restore. Not collected by pytest (no test_ files here)."""
