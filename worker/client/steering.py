"""What a `RolloutClient` tells the fleet and asks of it: weight updates and heartbeats, over
the control and status topics (`Fleet`), each call bounded by its own deadline and failing
with `RolloutError` only."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from aiokafka.errors import KafkaError

from schemas import CommandAck, InflightMode, Target, UpdateWeights, WorkerStatus
from worker.client.fleet import Fleet, new_command_id
from worker.client.inflight import RolloutError
from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.clock import Clock
from worker.core.errors import BrokerError

__all__ = ["Steering"]


class Steering:
    """The fleet of `group_id`, as `RolloutClient.update_weights` and `status` steer it: every
    call opens its own `Fleet` on `connection` and closes it. `clock`: what commands are dated
    and calls bounded by."""

    def __init__(
        self,
        connection: Mapping[str, Any],
        *,
        control_topic: str,
        status_topic: str,
        group_id: str,
        control_hmac_key: str | None,
        kafka_clients: KafkaClients = AIOKAFKA,
        clock: Clock,
    ) -> None:
        self._connection = connection
        self._clock = clock
        self._kafka_clients = kafka_clients
        self._control_topic = control_topic
        self._status_topic = status_topic
        self._group_id = group_id
        self._control_hmac_key = control_hmac_key

    async def update_weights(
        self,
        path: str,
        version: int,
        *,
        mode: InflightMode,
        target: Target | None,
        timeout_s: float,
        force: bool,
    ) -> dict[str, CommandAck]:
        """See `RolloutClient.update_weights`."""
        command = UpdateWeights(
            command_id=new_command_id(),
            target=target or Target(group=self._group_id),
            version=version,
            path=path,
            on_inflight=mode,
            issued_at=self._clock.wall(),
            force=force,
        )
        deadline = self._clock.monotonic() + timeout_s

        def left() -> float:
            return max(deadline - self._clock.monotonic(), 0.0)

        sent = False
        try:
            async with self._fleet() as fleet:
                live = await fleet.live_workers(command.target, timeout_s=left())
                since = await fleet.status_end(timeout_s=left())
                await fleet.send(command, timeout_s=left())
                sent = True
                acks = await fleet.acks(command.command_id, live, since, left())
        except (TimeoutError, BrokerError, KafkaError) as exc:
            raise RolloutError(
                f"update to version {version}: {exc} "
                f"({'sent, acknowledgements not read' if sent else 'not sent'})"
            ) from None
        _check_every_worker_updated(version, live, acks, timeout_s)
        return acks

    async def status(self, target: Target | None, *, timeout_s: float) -> dict[str, WorkerStatus]:
        """See `RolloutClient.status`."""
        try:
            async with self._fleet() as fleet:
                return await fleet.live_workers(
                    target or Target(group=self._group_id), timeout_s=timeout_s
                )
        except (TimeoutError, BrokerError, KafkaError) as exc:
            raise RolloutError(f"fleet status: {exc}") from None

    @contextlib.asynccontextmanager
    async def _fleet(self) -> AsyncIterator[Fleet]:
        fleet = Fleet(
            self._connection,
            control_topic=self._control_topic,
            status_topic=self._status_topic,
            control_hmac_key=self._control_hmac_key,
            kafka_clients=self._kafka_clients,
            clock=self._clock,
        )
        async with fleet:
            yield fleet


def _check_every_worker_updated(
    version: int, live: Iterable[str], acks: dict[str, CommandAck], timeout_s: float
) -> None:
    """Raise `RolloutError` unless every live worker acknowledged the update `ok`."""
    live = sorted(live)
    if not live:
        raise RolloutError("no live worker of the target to update")
    bad = {w: a for w, a in acks.items() if a.outcome != "ok"}
    missing = sorted(set(live) - set(acks))
    if bad or missing:
        details = [f"{w}: {a.detail}" for w, a in bad.items()] + [
            f"{w}: no answer in {timeout_s:.0f}s" for w in missing
        ]
        raise RolloutError(f"update to version {version} failed: " + "; ".join(details))
