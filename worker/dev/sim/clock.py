"""A virtual clock and an event loop on it: time jumps to the next timer instead of passing.

Like FoundationDB's sim2 (apple/foundationdb `fdbrpc/sim2.actor.cpp`), the real code runs in
one thread on a clock nobody waits for: `asyncio.sleep(60)` costs nothing, and nothing that
happens depends on how fast the machine is. The loop has no sockets: the selector's `select`
advances the clock by the timeout it is given (the distance to the next timer), and refuses to
block for ever, which in a closed simulation means every task waits on something that never
comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future as ConcurrentFuture
from typing import Any, Final, TypeVar

__all__ = ["EPOCH_S", "Deadlock", "VirtualClock", "VirtualLoop", "virtual_time"]

T = TypeVar("T")

#: The wall-clock time the simulation starts at (time.time()): fixed, so traces compare.
EPOCH_S: Final = 1_800_000_000.0


class Deadlock(RuntimeError):
    """No task is ready and no timer is set: the simulation can never move again."""


class VirtualClock:
    """Seconds since the simulation started; only the loop moves them. A
    `worker.core.clock.Clock`: the fleet builds every worker on it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return 1_000.0 + self.now

    def wall(self) -> float:
        return EPOCH_S + self.now


class _JumpingSelector(selectors.BaseSelector):
    """`select(timeout)` moves the clock by `timeout`; there is never anything to read."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, 0, events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("every task waits and no timer is set")
        if timeout > 0:
            self._clock.now += timeout
        return []

    def get_map(self) -> Any:
        return self._map


class VirtualLoop(asyncio.BaseEventLoop):
    """An event loop whose `time()` is the virtual clock's; executors run inline (a thread
    would bring the machine's scheduling into the simulation)."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        self._selector = _JumpingSelector(clock)
        # Timers closer than this are run together; asyncio's default is the real clock's.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.clock.monotonic()

    def _process_events(self, event_list: Any) -> None:
        return

    def _write_to_self(self) -> None:
        return

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        done: ConcurrentFuture[T] = ConcurrentFuture()
        try:
            done.set_result(func(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            done.set_exception(exc)
        return asyncio.wrap_future(done, loop=self)


async def _inline_to_thread(func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    return func(*args, **kwargs)


@contextlib.contextmanager
def virtual_time(clock: VirtualClock) -> Iterator[None]:
    """While inside: `time.monotonic`, `time.time` (and their `_ns` forms) read the virtual
    clock, and `asyncio.to_thread` runs inline: for what reads the `time` module itself (the
    dev harness, third-party code). The worker reads the clock it is built with."""
    saved = {name: getattr(time, name) for name in ("monotonic", "time", "monotonic_ns", "time_ns")}
    saved_to_thread = asyncio.to_thread
    time.monotonic = clock.monotonic
    time.time = clock.wall
    time.monotonic_ns = lambda: int(clock.monotonic() * 1e9)
    time.time_ns = lambda: int(clock.wall() * 1e9)
    asyncio.to_thread = _inline_to_thread
    try:
        yield
    finally:
        for name, func in saved.items():
            setattr(time, name, func)
        asyncio.to_thread = saved_to_thread
