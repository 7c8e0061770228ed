"""An async context that runs one task while it is open."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class InBackground:
    """An async context that runs one task while it is open and cancels it on exit."""

    _task: asyncio.Task[None] | None = None

    def _run_in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.create_task(coroutine)

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
