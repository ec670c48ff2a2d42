"""A module's long, passive setup begun with the integration session instead of with the module.

Some setup is mostly waiting on a clock no test can shorten (the API server ending watches after the
``timeoutSeconds`` their client asked: test_agent_apiserver.py). A module that declares
``HEAD_START = HeadStart(factory)`` has ``factory`` entered in a task of the session's event loop when
the session's integration tests begin (tests/integration/conftest.py, ``_head_starts``), so the wait
runs while the suites before it run; its module fixture then takes the value with :meth:`HeadStart.value`
and ends it with :meth:`HeadStart.close`. A head start its module never took is closed (its setup
cancelled, or its context exited) when the session ends.

``factory(selected, session)`` gets the names of the module's selected tests (so that it does only what
they need) and the pytest session; it returns an async context manager whose value the module uses.

The task runs only while the loop does: while the suites before the module run async tests (the node
package, all async). Its waits are bounded by time as everywhere in the harness.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Generic, TypeVar

import pytest

T = TypeVar("T")
Factory = Callable[[set[str], pytest.Session], AbstractAsyncContextManager[T]]


class HeadStart(Generic[T]):
    def __init__(self, factory: Factory[T]) -> None:
        self._factory = factory
        self._selected: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[T] | None = None
        self._done: asyncio.Event | None = None
        self._told: BaseException | None = None

    def select(self, name: str) -> None:
        """One of the module's tests is selected in this session (before :meth:`start`)."""
        self._selected.add(name)

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self, session: pytest.Session) -> None:
        """Enter the factory's context in a task of the running loop (once)."""
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self._ready, self._done = loop.create_future(), asyncio.Event()
        self._task = loop.create_task(self._run(session), name="head-start")

    async def _run(self, session: pytest.Session) -> None:
        assert self._ready is not None and self._done is not None
        try:
            async with self._factory(set(self._selected), session) as value:
                self._ready.set_result(value)
                await self._done.wait()
        except BaseException as e:
            if not self._ready.done():
                if isinstance(e, asyncio.CancelledError):
                    self._ready.cancel()
                else:
                    self._ready.set_exception(e)
            raise

    async def value(self, session: pytest.Session) -> T:
        """The factory's value once its setup is done (started now if the session did not: a run of the
        module alone); its setup's error, if it failed."""
        self.start(session)
        assert self._ready is not None
        try:
            return await asyncio.shield(self._ready)
        except Exception as e:
            self._told = e  # the module's fixture raised it: close() does not raise it again
            raise

    async def close(self) -> None:
        """The factory's context exited (its teardown's errors raised); a setup still under way is
        cancelled first. Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        assert self._ready is not None and self._done is not None
        if not self._ready.done():
            task.cancel()
        self._done.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception as e:
            if e is not self._told:  # a setup error no test was told of, or the teardown's own
                raise
        finally:
            if self._ready.done() and not self._ready.cancelled():
                with contextlib.suppress(BaseException):
                    self._ready.exception()  # read: never "exception was never retrieved"
