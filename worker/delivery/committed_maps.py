"""The committed positions and offset maps of partitions, read back as a new owner reads them:
bounded by `--commit-timeout-s`, decoded as untrusted input (a map that cannot be decoded is
ignored with a warning: plain at-least-once for its records)."""

from __future__ import annotations

import asyncio
import logging

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from worker.core.consumer_port import GroupConsumer
from worker.delivery.hand_overs import CommittedReader
from worker.delivery.offset_map import OffsetMap, decode_offset_map

__all__ = ["CommittedMaps"]

logger = logging.getLogger(__name__)


class CommittedMaps:
    """Reads committed positions and maps through `read_committed` (none: nothing is read),
    and the partitions' end offsets through `consumer`, each read bounded by `timeout_s`."""

    def __init__(
        self,
        consumer: GroupConsumer,
        read_committed: CommittedReader | None,
        timeout_s: float,
    ) -> None:
        self._consumer = consumer
        self._read_committed = read_committed
        self._timeout_s = timeout_s

    async def read(
        self, partitions: set[TopicPartition]
    ) -> dict[TopicPartition, tuple[int, OffsetMap | None]] | None:
        """The committed position and offset map of each of `partitions` that has a commit
        (None for a map that cannot be decoded); None when they cannot be read at all. Read
        again and again while that lasts: the callers say it once."""
        read = await self.read_with_ends(partitions)
        return None if read is None else read[0]

    async def read_with_ends(
        self, partitions: set[TopicPartition]
    ) -> (
        tuple[dict[TopicPartition, tuple[int, OffsetMap | None]], dict[TopicPartition, int]] | None
    ):
        """`read`, with the partitions' end offsets read for them (none when those could
        not be read)."""
        if self._read_committed is None:
            return {}, {}
        try:
            async with asyncio.timeout(self._timeout_s):
                committed = await self._read_committed(sorted(partitions))
            ends = await self.ends(partitions)
        except (KafkaError, TimeoutError) as exc:
            logger.debug("cannot read the committed offset maps (%r)", exc)
            return None
        maps: dict[TopicPartition, tuple[int, OffsetMap | None]] = {}
        for tp, (position, metadata) in committed.items():
            if tp not in partitions or position < 0:
                continue
            try:
                maps[tp] = (position, decode_offset_map(position, metadata, end=ends.get(tp)))
            except Exception as exc:  # noqa: BLE001 - any unreadable map: plain at-least-once
                logger.warning(
                    "%s-%s@%d: ignoring the committed metadata (%s); records past the committed "
                    "offset will run again",
                    tp.topic,
                    tp.partition,
                    position,
                    exc,
                )
                maps[tp] = (position, None)
        return maps, ends

    async def ends(self, partitions: set[TopicPartition]) -> dict[TopicPartition, int]:
        """The partitions' end offsets, or none when they cannot be read: map offsets at or
        past the end name no record (the log was truncated under them)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                ends: dict[TopicPartition, int] = await self._consumer.end_offsets(
                    sorted(partitions)
                )
        except (KafkaError, TimeoutError) as exc:
            logger.warning("cannot read the partitions' end offsets (%r)", exc)
            return {}
        return ends
