"""The simulation's `worker.core.clients.KafkaClients`: the same calls, with aiokafka's options,
building simulated clients of the process that the client id names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.dev.sim.clients import Process, SimAdmin, SimConsumer, SimProducer

__all__ = ["SimKafkaClients"]


class SimKafkaClients:
    """Builds clients on the simulated cluster from the options the code passes aiokafka.

    `process_of` names the process a client belongs to, from its `client_id` (its death
    silences the client). Options the simulation models are taken: group membership and its
    timeouts, the incarnation assignor's metadata, idempotence, request and batch sizes, the
    produce timeout; `linger_ms` only when `linger` (the workers' simulated timeline, which the
    recorded seeds replay, predates lingering), the rest (security, fetch sizes, codecs) has no
    effect on a simulated broker.
    """

    def __init__(self, process_of: Callable[[str], Process], *, linger: bool = True) -> None:
        self._process_of = process_of
        self._linger = linger

    @classmethod
    def of_process(cls, process: Process) -> SimKafkaClients:
        """Every client of one process (a trainer's), whatever its client id."""
        return cls(lambda _client_id: process)

    def producer(self, **options: Any) -> SimProducer:
        client_id = str(options["client_id"])
        modelled: dict[str, Any] = {
            name: options[name]
            for name in (
                "enable_idempotence",
                "max_request_size",
                "max_batch_size",
                "request_timeout_ms",
            )
            if name in options
        }
        if self._linger and "linger_ms" in options:
            modelled["linger_ms"] = options["linger_ms"]
        return SimProducer(self._process_of(client_id), client_id=client_id, **modelled)

    def consumer(self, *topics: str, **options: Any) -> SimConsumer:
        client_id = str(options["client_id"])
        modelled = {
            name: options[name]
            for name in (
                "group_instance_id",
                "session_timeout_ms",
                "heartbeat_interval_ms",
                "max_poll_interval_ms",
                "rebalance_timeout_ms",
            )
            if name in options
        }
        strategies = options.get("partition_assignment_strategy") or ()
        consumer = SimConsumer(
            self._process_of(client_id),
            client_id=client_id,
            group_id=options.get("group_id"),
            assignor=next(iter(strategies), None),
            **modelled,
        )
        if topics:
            consumer.subscribe(list(topics))
        return consumer

    def admin(self, **options: Any) -> SimAdmin:
        return SimAdmin(self._process_of(str(options["client_id"])))
