"""Where Kafka clients come from: one factory, passed to what needs clients when it is built.

aiokafka's clients by default. The simulation (`worker.dev.sim`) and test doubles pass their
own, with the same calls and the same options, so the code under them runs unchanged and no
module name is patched: TigerBeetle and FoundationDB run their production state machines under
simulation the same way, with the network behind an interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from worker.core.consumer_port import GroupConsumer

if TYPE_CHECKING:
    from worker.core.paced_consumer import PacedConsumer

__all__ = ["AIOKAFKA", "AIOKafkaClients", "KafkaClients"]


class KafkaClients(Protocol):
    """Builds Kafka clients from aiokafka's keyword arguments (connection, security, sizes).

    The objects returned answer the calls of aiokafka's `AIOKafkaProducer`,
    `AIOKafkaConsumer` and `AIOKafkaAdminClient` that this project makes. A consumer is a
    `GroupConsumer`, the worker's port, which mypy holds each factory's consumer to; the
    control plane and the trainer's client also make calls beyond it (aiokafka's, untyped).
    Producers and admin clients are typed `Any`: aiokafka has no type hints to hold a double to.
    """

    def producer(self, **options: Any) -> Any:
        """A producer, not started."""

    def consumer(self, *topics: str, **options: Any) -> GroupConsumer:
        """A consumer, not started; subscribed to `topics` when given."""

    def admin(self, **options: Any) -> Any:
        """An admin client, not started."""


class AIOKafkaClients:
    """aiokafka's own clients; consumers are `PacedConsumer`s (see there why)."""

    def producer(self, **options: Any) -> AIOKafkaProducer:
        return AIOKafkaProducer(**options)

    def consumer(self, *topics: str, **options: Any) -> PacedConsumer:
        # Imported here: `PacedConsumer` makes its group calls through `worker.core.kafka`,
        # which builds its clients with this factory.
        from worker.core.paced_consumer import PacedConsumer  # noqa: PLC0415

        return PacedConsumer(*topics, **options)

    def admin(self, **options: Any) -> AIOKafkaAdminClient:
        return AIOKafkaAdminClient(**options)


#: The factory everything uses unless it is given another.
AIOKAFKA: Final = AIOKafkaClients()
