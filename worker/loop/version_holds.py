"""Jobs that need newer weights than the worker serves: held in their partition, not run.

A job with `min_weight_version` above the engine's version is not started. Its partition is
rewound to it and paused (the worker stays in the group and keeps polling), so the job and
everything behind it keep their order and their uncommitted offsets. The partition resumes
when an update reaches the version, when the job's `deadline` passes, or when it has been held
for `max_hold_s` (`--max-version-hold-s`): it is then fetched again and answered `expired`. The
last bound is what keeps a job asking for a version no trainer will publish (anyone who can
write to the jobs topic can write one) from holding its partition forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import msgspec
from aiokafka import ConsumerRecord, TopicPartition

from worker.core.clock import Clock

__all__ = ["VersionHolds"]

logger = logging.getLogger(__name__)

# Only records that name the field are decoded a second time.
_FIELD: Final = b'"min_weight_version"'


class _Needs(msgspec.Struct):
    min_weight_version: int | None = None
    deadline: float | None = None


_DECODER: Final = msgspec.json.Decoder(_Needs)


class _Hold(msgspec.Struct):
    offset: int
    version: int
    deadline: float | None
    since: float


class VersionHolds:
    """Which partitions wait for a weight version, and until when."""

    def __init__(
        self,
        weight_version: Callable[[], int],
        max_hold_s: float,
        *,
        clock: Clock,
    ) -> None:
        self._weight_version = weight_version
        self._max_hold_s = max_hold_s
        self._clock = clock
        self._holds: dict[TopicPartition, _Hold] = {}
        # Records whose hold ran out: run when fetched again, to be answered `expired` with
        # this detail (`gave_up`), never held again.
        self._gave_up: dict[TopicPartition, tuple[int, str]] = {}

    def gave_up(self, tp: TopicPartition, offset: int) -> str | None:
        """Why the record at `offset` must be answered `expired` without running (its hold ran
        out), or None; asked once, when its job starts."""
        given_up = self._gave_up.get(tp)
        if given_up is None or given_up[0] != offset:
            return None
        del self._gave_up[tp]
        return given_up[1]

    def held(self) -> set[TopicPartition]:
        """The partitions held now; holds whose version has arrived or whose job's deadline
        has passed end here."""
        self._release()
        return set(self._holds)

    def runnable(
        self, tp: TopicPartition, records: list[ConsumerRecord[bytes, bytes]]
    ) -> tuple[list[ConsumerRecord[bytes, bytes]], int | None]:
        """The records to start now: those before the first that needs newer weights; and the
        offset to rewind the partition to (that record's), or None. The partition is held from
        then on."""
        if tp in self._holds:
            return [], None  # fetched before the hold took effect: fetched again after it
        version = self._weight_version()
        given_up = self._gave_up.get(tp)
        for i, record in enumerate(records):
            value = record.value
            if value is None or _FIELD not in value:
                continue
            if given_up is not None and given_up[0] == record.offset:
                continue  # held for max_hold_s already: run it, and be answered `expired`
            try:
                needs = _DECODER.decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # the answer builder says what is wrong with it
            wanted = needs.min_weight_version
            if wanted is None or wanted <= version:
                continue
            if needs.deadline is not None and needs.deadline < self._clock.wall():
                continue  # run it, and be answered `expired`
            self._holds[tp] = _Hold(record.offset, wanted, needs.deadline, self._clock.wall())
            logger.info(
                "%s-%s@%s needs weights >= %d (serving %d): holding the partition for at most "
                "%.0fs",
                tp.topic,
                tp.partition,
                record.offset,
                wanted,
                version,
                self._max_hold_s,
            )
            return records[:i], record.offset
        return records, None

    def _release(self) -> None:
        if not self._holds:
            return
        version, now = self._weight_version(), self._clock.wall()
        for tp, hold in list(self._holds.items()):
            if hold.version <= version or (hold.deadline is not None and hold.deadline < now):
                del self._holds[tp]
                logger.info("%s-%s: hold released (serving %d)", tp.topic, tp.partition, version)
            elif (held_s := now - hold.since) >= self._max_hold_s:
                del self._holds[tp]
                detail = (
                    f"held {held_s:.0f}s for weights >= {hold.version} (serving {version}); "
                    f"no update reached it within --max-version-hold-s {self._max_hold_s:g}"
                )
                self._gave_up[tp] = (hold.offset, detail)
                logger.warning(
                    "%s-%s@%s: %s; answering it expired",
                    tp.topic,
                    tp.partition,
                    hold.offset,
                    detail,
                )

    def forget(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self._holds.pop(tp, None)
            self._gave_up.pop(tp, None)
