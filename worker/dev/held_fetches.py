"""Empty fetches held by the client, for brokers that answer them at once (noida-db).

Kafka holds a fetch that finds no records until one arrives or `fetch.max.wait.ms` passes, so an
idle consumer sends a few requests a second. The local noida-db broker answers it at once,
empty, whatever the wait and `fetch.min.bytes` say: one idle aiokafka consumer then sends
~4,000 fetches a second and burns ~0.7 s of CPU per second (measured). A benchmark that charges
a process its CPU would charge it that broker's busy loop, so on that broker it runs the
process through `python -m worker.dev.held_fetches HOLD_S ARGS...` (`python -m worker ARGS...`
with empty fetches held) and tells it with SIGUSR1 when it has produced records, which is when
Kafka would answer the held fetches.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import Any

__all__ = ["hold_empty_fetches", "wake_held_fetches"]

# The holds waiting now, each with the loop it waits in (the wake may come from a signal
# handler), and when the last wake came.
_holds: dict[asyncio.Future[None], asyncio.AbstractEventLoop] = {}
_woken_at = float("-inf")


def hold_empty_fetches(hold_s: float) -> None:
    """From now on, every aiokafka consumer of this process waits `hold_s` after a fetch that
    brought no records before it fetches again from that broker, as if the broker had held it;
    `wake_held_fetches` ends the holds early, as a record arriving at the broker would.
    """
    if hold_s <= 0:
        raise ValueError(f"hold_s must be positive, got {hold_s}")
    # A private method: the fetcher starts one of these per broker and fetches from that
    # broker again only once it returns (True when it buffered new records).
    from aiokafka.consumer.fetcher import Fetcher  # noqa: PLC0415

    fetch = Fetcher._proc_fetch_request
    if getattr(fetch, "held_s", None) is not None:
        raise RuntimeError("empty fetches are held already")

    async def held(self: Any, *args: Any, **kwargs: Any) -> bool:
        sent = time.monotonic()
        found: bool = await fetch(self, *args, **kwargs)
        # Records announced while this fetch was on its way may have missed it: no hold.
        if found or _woken_at >= sent:
            return found
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        _holds[woken] = loop
        try:
            await asyncio.wait([woken], timeout=hold_s)
        except asyncio.CancelledError:
            # As aiokafka's own does when cancelled: the fetcher (closing or reassigned)
            # awaits it without expecting the cancellation back.
            return False
        finally:
            _holds.pop(woken, None)
        return False

    held.held_s = hold_s  # type: ignore[attr-defined]
    Fetcher._proc_fetch_request = held


def wake_held_fetches() -> None:
    """Records were produced: end the holds now (safe in a signal handler)."""
    global _woken_at  # noqa: PLW0603 - one process-wide clock, as the fetcher patch is
    _woken_at = time.monotonic()
    for woken, loop in list(_holds.items()):
        loop.call_soon_threadsafe(_wake, woken)


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: python -m worker.dev.held_fetches HOLD_S [worker arguments]")
    hold_empty_fetches(float(argv[0]))
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: wake_held_fetches())
    from worker.cli.main import main as worker_main  # noqa: PLC0415

    return worker_main(argv[1:])


if __name__ == "__main__":  # vLLM spawns engine processes that re-import __main__
    sys.exit(main(sys.argv[1:]))
