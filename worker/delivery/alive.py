"""Whether the last owner of a partition is still a live member of the group."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from aiokafka.errors import KafkaError

from worker.core.clock import Clock

__all__ = ["AliveWriters", "LiveIncarnations"]

logger = logging.getLogger(__name__)

#: The incarnations the group's live members announce (`GroupOffsetsReader.live_incarnations`);
#: None when the group cannot say (it is rebalancing).
LiveIncarnations = Callable[[], Awaitable[set[int] | None]]

# How often a new owner asks again who is alive while the group cannot say.
_ASK_AGAIN_S: Final = 0.5


class AliveWriters:
    """Whether the writer of a map is a live member of the group: this process itself, or an
    incarnation a live member announces. The group is asked once per assignment, and only
    about a map that was not a clean hand-over; a writer that names no incarnation counts as
    dead. A group that cannot say (rebalancing: its members come back without the metadata
    that announces them; or not answering) is asked again once the new owner has waited for
    the writer's hand-over (`waited`); a writer it still cannot vouch for, whose hand-over
    never landed, counts as dead (the breaker's counts stay on the safe side)."""

    def __init__(
        self, own: int, ask: LiveIncarnations | None, timeout_s: float, *, clock: Clock
    ) -> None:
        self._own = own
        self._clock = clock
        self._ask = ask
        self._timeout_s = timeout_s
        self._asked = False
        self._waited = False
        self._asked_again = False
        self._live: set[int] | None = None

    async def __call__(self, writer: int) -> bool | None:
        """Whether `writer` is alive; None when the group could not say."""
        if not writer:
            return False
        if writer == self._own:
            return True
        if not self._asked:
            self._asked = True
            self._live = await self._ask_group(within_s=0.0)
        if self._live is None and self._waited and not self._asked_again:
            self._asked_again = True
            self._live = await self._ask_group(within_s=self._timeout_s)
        if self._live is None:
            return None
        return writer in self._live

    def waited(self) -> None:
        """The new owner has waited for the hand-overs: a group that could not say is asked
        again, when a map still needs its answer."""
        self._waited = True

    async def _ask_group(self, *, within_s: float) -> set[int] | None:
        """Ask; while the coordinator does not answer, again every `_ASK_AGAIN_S` until
        `within_s` has passed (asked again after the wait for the hand-overs: a coordinator
        away for a few seconds, a broker restarting as the group formed, must not make a live
        member's jobs suspects of a death that did not happen; the partitions wait paused
        meanwhile, and nothing of theirs could be committed before it is back anyway). A group
        that answers that it cannot say (None) is not asked again."""
        deadline = self._clock.monotonic() + within_s
        while True:
            try:
                return await self._ask_once()
            except (KafkaError, TimeoutError) as exc:
                if self._clock.monotonic() >= deadline:
                    logger.warning("cannot ask the group which members are alive (%r)", exc)
                    return None
            await asyncio.sleep(_ASK_AGAIN_S)

    async def _ask_once(self) -> set[int] | None:
        if self._ask is None:
            return set()
        async with asyncio.timeout(self._timeout_s):
            return await self._ask()
