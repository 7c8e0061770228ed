"""What a worker says on the status topic: acknowledgements, heartbeats, and reports of the
control records it dropped.

A dropped record (unreadable, or not signed under `--control-hmac-key`) is counted, and the
counts are reported once per heartbeat interval at most, so a flood of junk costs no send
each; under a key nothing at all is sent about it (an unsigned record is nobody's command).
Without a status topic everything goes to the log only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final, Literal

import msgspec
from aiokafka import AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError

from schemas import (
    Abort,
    Command,
    CommandAck,
    ControlRecordError,
    Pause,
    ResetPrefixCache,
    Resume,
    StatusMessage,
    UpdateWeights,
    encode,
)
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.metrics import Metrics
from worker.engines.steerable import SteerableEngine

__all__ = ["StatusSender"]

logger = logging.getLogger(__name__)

_SEND_TIMEOUT_S: Final = 10.0


class StatusSender:
    """Sends this worker's status messages through `producer` once the plane has started it
    (`attach`); see the module's docstring."""

    def __init__(
        self,
        settings: Settings,
        engine: SteerableEngine,
        metrics: Metrics,
        *,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._metrics = metrics
        self._clock = clock
        self._producer: AIOKafkaProducer | None = None
        self._signed = settings.control_hmac_key is not None
        # Records dropped since the last report, by reason, and the latest unreadable one.
        self._dropped: dict[str, int] = {}
        self._unreadable: ControlRecordError | None = None
        self._dropped_reported = -float("inf")

    def attach(self, producer: AIOKafkaProducer | None) -> None:
        """Send through `producer` (started); None: the status topic does not exist."""
        self._producer = producer

    async def send(self, message: StatusMessage) -> None:
        if self._producer is None:
            return
        try:
            async with asyncio.timeout(_SEND_TIMEOUT_S):
                await self._producer.send_and_wait(
                    self._settings.status_topic,
                    value=encode(message),
                    key=self._settings.worker_id.encode(),
                )
        except (TimeoutError, KafkaError) as exc:
            logger.warning("status topic: %s not sent (%r)", type(message).__name__, exc)

    def acknowledgement(
        self,
        command: Command,
        outcome: Literal["ok", "failed"],
        detail: str,
        duration: float,
        offset: int | None,
    ) -> CommandAck:
        """What `command` (at `offset` in the control topic) came to, with the weight version
        after it: logged and counted here, for the caller to `send`."""
        kind = type(command).__name__
        ack = CommandAck(
            worker=self._settings.worker_id,
            group=self._settings.group_id,
            command_id=command.command_id,
            kind=_KINDS.get(type(command), kind),
            outcome=outcome,
            detail=detail[:2000],
            duration_s=duration,
            weight_version=self._engine.weight_version,
            at=self._clock.wall(),
            offset=offset,
        )
        log = logger.info if outcome == "ok" else logger.warning
        log(
            "command %s (%s) %s in %.2fs%s",
            command.command_id,
            ack.kind,
            outcome,
            duration,
            f": {detail}" if detail else "",
        )
        self._metrics.commands.labels(ack.kind, outcome).inc()
        return ack

    def drop(self, record: ConsumerRecord[bytes, bytes], reason: str, detail: str) -> None:
        """Count a record that is nobody's command; reported once per heartbeat interval at
        most, so a flood of them costs no send each (and, under a key, no send at all)."""
        self._metrics.control_records_dropped.labels(reason).inc()
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        if reason == "unreadable" and not self._signed:
            count = 1 if self._unreadable is None else self._unreadable.count + 1
            self._unreadable = ControlRecordError(
                worker=self._settings.worker_id,
                group=self._settings.group_id,
                offset=record.offset,
                detail=detail[:1000],
                at=0.0,
                count=count,
            )

    async def report_dropped(self, *, force: bool = False) -> None:
        if not self._dropped:
            return
        now = self._clock.monotonic()
        if not force and now - self._dropped_reported < self._settings.status_interval_s:
            return
        self._dropped_reported = now
        dropped, self._dropped = self._dropped, {}
        report, self._unreadable = self._unreadable, None
        logger.warning(
            "control records dropped unanswered since the last report: %s%s",
            ", ".join(f"{count} {reason}" for reason, count in sorted(dropped.items())),
            "" if report is None else f" (latest at offset {report.offset}: {report.detail})",
        )
        if report is not None:
            await self.send(msgspec.structs.replace(report, at=self._clock.wall()))


_KINDS: Final[dict[type[Any], str]] = {
    Pause: "pause",
    Resume: "resume",
    UpdateWeights: "update_weights",
    Abort: "abort",
    ResetPrefixCache: "reset_prefix_cache",
}
