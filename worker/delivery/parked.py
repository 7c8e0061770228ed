"""Revoked partitions whose jobs run on through a rebalance, until the next assignment decides.

aiokafka's eager protocol revokes every partition at every rebalance, though most come straight
back. A revoked partition whose jobs still run past the grace awaits a verdict: whether the next
assignment gives it back unchanged (its jobs answer and commit here, as if nothing happened) or
it moved (its jobs are cancelled, their answers dropped unsent). Once handed over, its offsets
are kept aside here too: neither held nor committed, until they are adopted back or forgotten.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType
from typing import Generic, TypeVar

from aiokafka import TopicPartition

__all__ = ["ParkedPartitions"]

#: What a partition's offsets are kept as (the tracker's `PartitionOffsets`): any object, so
#: that this module needs nothing of the tracker that holds it.
Offsets = TypeVar("Offsets")


class ParkedPartitions(Generic[Offsets]):
    """The one record of which partitions are parked: the verdict each awaits (from the start
    of its hand-over until the next assignment), and its offsets once handed over.

    A verdict outlives the offsets: a partition whose parked offsets were dropped (a record
    started on it that will not run) still has jobs running, and they learn at the next
    assignment that it moved."""

    def __init__(self) -> None:
        self._verdicts: dict[TopicPartition, asyncio.Future[bool]] = {}
        self._offsets: dict[TopicPartition, Offsets] = {}

    def await_verdicts(self, partitions: set[TopicPartition]) -> None:
        """`partitions` are being handed over with jobs running: their jobs and answers wait
        for the next assignment's verdict (`decide`)."""
        loop = asyncio.get_running_loop()
        self._verdicts |= {tp: loop.create_future() for tp in partitions}

    def awaiting(self) -> set[TopicPartition]:
        """The partitions whose verdict is pending."""
        return set(self._verdicts)

    def verdict(self, tp: TopicPartition) -> asyncio.Future[bool] | None:
        """The verdict `tp` awaits (True: it came back), or None when it awaits none."""
        return self._verdicts.get(tp)

    def decide(self, tp: TopicPartition, *, stays: bool) -> None:
        """Give `tp` its verdict, if it awaits one."""
        if (verdict := self._verdicts.pop(tp, None)) is not None:
            verdict.set_result(stays)

    def decide_all(self, adopted: set[TopicPartition]) -> set[TopicPartition]:
        """The next assignment came (or a stop): every partition awaiting a verdict stays if
        `adopted`, and moved otherwise; returns those that moved."""
        verdicts, self._verdicts = self._verdicts, {}
        for tp, verdict in verdicts.items():
            verdict.set_result(tp in adopted)
        return set(verdicts) - adopted

    def park(self, tp: TopicPartition, offsets: Offsets) -> None:
        """Keep `tp`'s `offsets` aside: handed over, neither held nor committed."""
        self._offsets[tp] = offsets

    def offsets(self) -> Mapping[TopicPartition, Offsets]:
        """The offsets parked now, by partition (read-only)."""
        return MappingProxyType(self._offsets)

    def unpark(self, tp: TopicPartition) -> Offsets:
        """Take back the parked offsets of `tp`."""
        return self._offsets.pop(tp)

    def drop(self, tp: TopicPartition) -> None:
        """Forget the parked offsets of `tp`, if any; a verdict it awaits stays pending."""
        self._offsets.pop(tp, None)
