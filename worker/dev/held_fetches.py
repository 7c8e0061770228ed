"""Empty fetches held by the client, for brokers that answer them at once (noida-db).

Kafka holds a fetch that finds no records until one arrives or `fetch.max.wait.ms` passes, so an
idle consumer sends a few requests a second. The local noida-db broker answers it at once,
empty, whatever the wait and `fetch.min.bytes` say: one idle aiokafka consumer then sends
~4,000 fetches a second and burns ~0.7 s of CPU per second (measured). A benchmark that charges
a process its CPU would charge it that broker's busy loop, so on that broker it runs the
process through `python -m worker.dev.held_fetches HOLD_S ARGS...` (`python -m worker ARGS...`
with empty fetches held) and holds its own the same way.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

__all__ = ["hold_empty_fetches"]


def hold_empty_fetches(hold_s: float) -> None:
    """From now on, every aiokafka consumer of this process waits `hold_s` after a fetch that
    brought no records before it fetches again from that broker, as if the broker had held it.

    Records that arrive meanwhile wait up to `hold_s` longer than on Kafka (which answers as
    soon as one arrives): keep it short next to what is measured.
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
        found: bool = await fetch(self, *args, **kwargs)
        if not found:
            try:
                await asyncio.sleep(hold_s)
            except asyncio.CancelledError:
                # As aiokafka's own does when cancelled: the fetcher (closing or reassigned)
                # awaits it without expecting the cancellation back.
                return False
        return found

    held.held_s = hold_s  # type: ignore[attr-defined]
    Fetcher._proc_fetch_request = held


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: python -m worker.dev.held_fetches HOLD_S [worker arguments]")
    hold_empty_fetches(float(argv[0]))
    from worker.cli.main import main as worker_main  # noqa: PLC0415

    return worker_main(argv[1:])


if __name__ == "__main__":  # vLLM spawns engine processes that re-import __main__
    sys.exit(main(sys.argv[1:]))
