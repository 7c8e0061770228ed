"""Waiting on a condition, with an error that says what did not happen."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Mapping
from typing import Protocol


async def wait_for(
    predicate: Callable[..., object],
    timeout_s: float = 20.0,
    what: str | Callable[[], str] = "condition",
) -> None:
    """Until `predicate()` (plain or async) is truthy; `what` (or what it returns, read at the
    failure) says in the error what did not happen."""
    deadline = time.monotonic() + timeout_s
    while not await _settled(predicate()):
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s}s waiting for {said}")
        await asyncio.sleep(0.05)


class GeneratingEngine(Protocol):
    """An engine that tells how many tokens each running request has generated so far."""

    @property
    def generated_tokens(self) -> Mapping[str, int]: ...


async def wait_generating(
    engine: GeneratingEngine, count: int = 1, timeout_s: float = 60.0
) -> None:
    """Until `count` requests are running in `engine` and each has generated a token.

    Tests that act on running jobs (an update, a pause, an abort) wait for this instead of a
    fixed sleep: on a busy machine jobs can sit in the queue for longer than any such sleep.
    """

    def generating() -> bool:
        running = engine.generated_tokens
        return len(running) >= count and all(n > 0 for n in running.values())

    await wait_for(
        generating,
        timeout_s,
        lambda: (
            f"{count} requests generating in the engine (tokens so far: {engine.generated_tokens})"
        ),
    )


async def _settled(value: object) -> bool:
    return bool(await value) if inspect.isawaitable(value) else bool(value)
